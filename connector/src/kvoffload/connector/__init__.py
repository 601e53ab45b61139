"""TensorRT-LLM KV connector: the scheduler and worker hooks over the sidecar or an in-process LMCache."""
