"""Stand-in for ``tensorrt_llm.bindings`` (the C++ bindings): only what connectors import."""
