"""Older module path of the connector API (TensorRT-LLM 1.1/1.2). The stand-in serves main's classes
here too; what 1.2's own ABCs lack (the attention-DP flag, the layer-group forms) is pinned per version
in ``tests/standin/upstream_api.py`` and checked against the connector there."""

from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
    KvCacheConnectorScheduler,
    KvCacheConnectorWorker,
    RequestData,
    SchedulerOutput,
)

__all__ = ["KvCacheConnectorScheduler", "KvCacheConnectorWorker", "RequestData", "SchedulerOutput"]
