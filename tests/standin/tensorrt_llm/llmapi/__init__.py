"""Stand-in for tensorrt_llm.llmapi."""
