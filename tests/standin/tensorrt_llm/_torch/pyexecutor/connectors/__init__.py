"""Stand-in for tensorrt_llm._torch.pyexecutor.connectors (newer module path)."""
