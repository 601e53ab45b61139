"""TensorRT-LLM KV connector: the thin hooks TensorRT-LLM calls every step.

Enable it in a trtllm-serve options file::

    kv_cache_config: {enable_block_reuse: true}
    kv_connector_config:
      connector_module: kvoffload.connector.trtllm
      connector_scheduler_class: KvoffloadConnectorScheduler
      connector_worker_class: KvoffloadConnectorWorker

This module is that entry point: the classes live in ``scheduler`` and ``worker``, what they
share in ``runtime``. Decisions and their reasons are in docs/connector.md.
"""

from kvoffload.connector.runtime import KvoffloadLoadError
from kvoffload.connector.scheduler import KvoffloadConnectorScheduler
from kvoffload.connector.worker import KvoffloadConnectorWorker

__all__ = ["KvoffloadConnectorScheduler", "KvoffloadConnectorWorker", "KvoffloadLoadError"]
