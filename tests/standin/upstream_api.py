"""TensorRT-LLM's KV connector API per supported version, as data for the contract tests.

Read from NVIDIA/TensorRT-LLM through the code index: the 1.2 line's
``tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py`` (@3277953, @00fdcbf) and main's
``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` (@035ab91c) and
``connectors/kv_cache_layout.py`` (@ae7a7216, the version with ``valid_page_slots``, ``slot_tensor``,
``dtype`` and ``as_single_pool_tensor``: what KVCacheManagerV2 hands ``register_kv_cache_layout``).

Main's prefix-reservation trio and ``PrefixLoad``: no stored version of ``kv_cache_connector.py``
carries them (re-read 2026-12-07, docs/results/trtllm-main-repin.md: the index lists 48 versions of
the file, @5a06f334 the one it names; no text of any version holds ``reserve_prefix``, ``PrefixLoad``
or ``prefix_loads``, nor does any stored ``py_executor.py`` hold the executor's prefix-load path). So
they come from the upstream code that uses them: ``connectors/prefix_load_completion.py`` @785b0128
(the only stored version), the example ``examples/llm-api/llm_kv_cache_connector.py`` (its overrides'
parameter names), the manager's reservation unit tests (index id 68375241723), KVCacheManagerV2's
real-manager prefix tests (id 68652947412), and the connector docs' ``PrefixLoad`` table (ids
68329737772, 70169266543: fields in the order below, ``is_async`` included). A method maps to
``(parameters, abstract)``; ``attention_dp`` says whether the version has the ``supports_attention_dp``
opt-in (``KvCacheConnectorManager.validate_attention_dp``).
"""

from __future__ import annotations

from typing import Any

_WORKER_12: dict[str, tuple[list[str], bool]] = {
    "bind_connector_meta": (["self", "metadata"], False),
    "get_connector_meta": (["self"], False),
    "register_forward_pass_callable": (["self"], False),
    "register_kv_caches": (["self", "kv_cache_tensor"], True),
    "start_load_kv": (["self", "stream"], True),
    "wait_for_layer_load": (["self", "layer_idx", "stream"], True),
    "save_kv_layer": (["self", "layer_idx", "stream"], True),
    "wait_for_save": (["self", "stream"], True),
    "get_finished": (["self", "finished_gen_req_ids", "started_loading_req_ids"], True),
}
_SCHEDULER_12: dict[str, tuple[list[str], bool]] = {
    "build_connector_meta": (["self", "scheduler_output"], True),
    "get_num_new_matched_tokens": (["self", "request", "num_computed_tokens"], True),
    "request_finished": (["self", "request", "cache_block_ids"], True),
    "update_state_after_alloc": (["self", "request", "block_ids"], True),
}

UPSTREAM_API: dict[str, dict[str, Any]] = {
    "1.2": {
        "module": "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
        "attention_dp": False,
        "RequestData": ["request_id", "new_tokens", "new_block_ids", "computed_position", "num_scheduled_tokens"],
        "SchedulerOutput": ["new_requests", "cached_requests"],
        "KvCacheConnectorWorker": _WORKER_12,
        "KvCacheConnectorScheduler": _SCHEDULER_12,
    },
    "main": {
        "module": "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector",
        "attention_dp": True,
        "RequestData": [
            *("request_id", "new_tokens", "new_block_ids", "computed_position", "num_scheduled_tokens"),
            *("block_hashes", "priorities", "cache_salt", "new_block_ids_by_layer_group"),
        ],
        "SchedulerOutput": ["new_requests", "cached_requests", "attention_dp_rank", "prefix_loads"],
        "PrefixLoad": [
            *("reservation_id", "request_id", "start", "end", "is_async", "block_ids_by_layer_group"),
            *("tokens", "cache_salt"),
        ],
        "KvCacheConnectorWorker": {
            **_WORKER_12,
            "register_kv_cache_layout": (["self", "layout"], False),
            "get_finished_prefix_loads": (["self"], False),
        },
        "KvCacheConnectorScheduler": {
            **_SCHEDULER_12,
            "request_finished_by_layer_group": (["self", "request", "cache_block_ids_by_layer_group"], False),
            "update_state_after_alloc_by_layer_group": (["self", "request", "block_ids_by_layer_group"], False),
            "wait_for_initialization": (["self"], False),
            "reserve_prefix": (["self", "request", "num_computed_tokens", "reservation_id"], False),
            "release_prefix_reservation": (["self", "request", "reservation_id", "start", "end"], False),
        },
    },
}

LAYOUT_API: dict[str, Any] = {
    "module": "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout",
    "commit": "ae7a72167ae7ea146648bb1c54d5f064f49eee01",
    "KvCacheBufferRef": ["layer_id", "role", "expansion"],
    "KvCacheRegion": ["base", "size", "stride", "num_slots", "buffers"],
    "KvCacheLayerGroupLayout": ["layer_group_id", "layer_ids", "window_size", "regions"],
    "KvCacheLayout": ["tokens_per_block", "groups", "dtype"],
    "functions": ["valid_page_slots"],
}
"""Main's layout classes (fields in order) and free functions, @ae7a7216."""
