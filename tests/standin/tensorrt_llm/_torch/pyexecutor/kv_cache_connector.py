"""Older module path of the connector API (TensorRT-LLM 1.1/1.2); same classes."""

from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    RequestData,
    SchedulerOutput,
)

__all__ = ["KvCacheConnectorScheduler", "KvCacheConnectorWorker", "RequestData", "SchedulerOutput"]
