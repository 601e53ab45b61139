"""kvoffload: KV-cache offload for TensorRT-LLM on Kubernetes.

Three components that never import each other, over one shared floor:

- ``kvoffload.operator``: the kopf operator that injects the cache server (installs without torch or lmcache);
- ``kvoffload.sidecar``: the LMCache cache-server container's entrypoint;
- ``kvoffload.connector``: TensorRT-LLM's KV connector, loaded by the engine from the bundle;
- ``kvoffload.contract``, ``kvoffload.policy``, ``kvoffload.quantity``, ``kvoffload.multiproc``: the
  names, policy rules and helpers all three share.

The layering is checked by import-linter (``.importlinter``) in ``make test``.
"""

__version__ = "0.1.0"
