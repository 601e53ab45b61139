"""The kopf operator: opt-in by annotation, policy from KVCachePolicy, pure decisions, thin effects.

Stages, top to bottom (``.importlinter`` checks the order): ``cli`` (the command line), ``run_loop``
and ``uninstall``; ``control`` (the effectful loop) beside ``admission`` (the webhook), neither
importing the other; ``node``; ``plan`` (pure) beside ``api`` (the Kubernetes API); ``intent`` (pure).
"""

__version__ = "0.1.0"
PROG = "kvoffload-operator"
"""The command's name: ``--version`` and every line it stops with start with it."""
