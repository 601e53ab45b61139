"""Pure readers of intent: annotations and policies to settings, the workload as the user wrote it, TensorRT-LLM options."""
