"""The kopf operator: opt-in by annotation, policy from KVCachePolicy, pure decisions, thin effects.

Stages, top to bottom (``.importlinter`` checks the order): ``control`` (the effectful loop),
``admission``, ``node``, ``plan`` (pure), ``intent`` (pure); ``api`` is the Kubernetes API.
"""

__version__ = "0.1.0"
