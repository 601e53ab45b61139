"""Stand-in for ``tensorrt_llm.bindings.internal``."""
