"""Minimal stand-ins for ``tensorrt_llm.llmapi.llm_args`` objects the connector reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KvCacheConfig:
    """``kv_cache_config``: only the fields the connector and stand-in executor use."""

    tokens_per_block: int = 32
    enable_block_reuse: bool = True
    use_kv_cache_manager_v2: bool | str = "auto"
    """Main's default since PR #15823: ``"auto"``, resolved per model class and written back
    (``llm_utils._resolve_kv_cache_manager_v2_auto``) before the connector is built."""
    dtype: str = "auto"
    """The KV cache's data type (``auto``: the checkpoint's)."""
    enable_partial_reuse: bool = True
    """Reuse a block whose tokens match only in part (``KvCacheConfig``'s default: on)."""
    copy_on_partial_reuse: bool = True
    """A partially matched block is copied into a fresh one (default: on)."""


@dataclass
class KvCacheConnectorConfig:
    """``kv_connector_config`` as in TensorRT-LLM 1.3+ (``server_url`` is newer)."""

    connector_module: str | None = None
    connector_scheduler_class: str | None = None
    connector_worker_class: str | None = None
    connector: str | None = None
    server_url: str | None = None


@dataclass
class TorchLlmArgs:
    """The parts of ``TorchLlmArgs`` a connector reads."""

    model: str = "standin-model"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_attention_dp: bool = False
    kv_cache_config: KvCacheConfig = field(default_factory=KvCacheConfig)
    kv_connector_config: KvCacheConnectorConfig | None = None
    revision: str | None = None
    """The hub revision of ``model`` (``BaseLlmArgs.revision``)."""
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_options(cls, model: str, options: dict[str, Any], tensor_parallel_size: int = 1) -> TorchLlmArgs:
        """Build from a trtllm-serve ``--extra_llm_api_options`` YAML mapping."""
        kv_cache = options.get("kv_cache_config") or {}
        connector = options.get("kv_connector_config")
        return cls(
            model=model,
            tensor_parallel_size=int(options.get("tensor_parallel_size", tensor_parallel_size)),
            pipeline_parallel_size=int(options.get("pipeline_parallel_size", 1)),
            enable_attention_dp=bool(options.get("enable_attention_dp", False)),
            kv_cache_config=KvCacheConfig(
                tokens_per_block=int(kv_cache.get("tokens_per_block", 32)),
                enable_block_reuse=bool(kv_cache.get("enable_block_reuse", True)),
                use_kv_cache_manager_v2=kv_cache.get("use_kv_cache_manager_v2", "auto"),
                enable_partial_reuse=bool(kv_cache.get("enable_partial_reuse", True)),
                copy_on_partial_reuse=bool(kv_cache.get("copy_on_partial_reuse", True)),
            ),
            kv_connector_config=KvCacheConnectorConfig(**connector) if connector is not None else None,
        )
