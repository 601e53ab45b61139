"""The kopf operator: opt-in by annotation, policy from KVCachePolicy, pure decisions, thin effects.

Stages, top to bottom (``.importlinter`` checks the order): ``control`` (the effectful loop),
``admission``, ``node``, ``plan`` (pure), ``intent`` (pure); ``api`` is the Kubernetes API.
"""

__version__ = "0.1.0"
PROG = "kvoffload-operator"
"""The command's name: ``--version`` and every line it stops with start with it."""
