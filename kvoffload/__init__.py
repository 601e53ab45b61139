"""kvoffload: KV-cache offload for TensorRT-LLM on Kubernetes.

The component folders (``operator/``, ``sidecar/``, ``connector/``) live at the
repository root and are reached as ``kvoffload.operator`` etc. through symlinks in
this folder; they carry no ``__init__.py`` so that running Python from the
repository root still imports the standard library's ``operator``.
"""

__version__ = "0.1.0"
