"""Settings parsing, salts/keys, KV geometry and metrics binding (pure, no processes)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import contract
from kvoffload.connector.backends.base import kv_geometry
from kvoffload.connector.keys import cache_model_name, chunk_layout, normalize_salt, salt_of
from kvoffload.connector.settings import (
    SettingsError,
    parse_settings,
)
from kvoffload.policy import Policy

pytestmark = pytest.mark.connector
STANDIN = str(Path(__file__).resolve().parents[2] / "standin")
if STANDIN not in sys.path:
    sys.path.insert(0, STANDIN)


def _args(**kwargs: Any) -> Any:
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig, TorchLlmArgs

    return TorchLlmArgs(
        model=kwargs.pop("model", "m"),
        tensor_parallel_size=kwargs.pop("tp", 1),
        kv_cache_config=KvCacheConfig(tokens_per_block=kwargs.pop("block", 32)),
        kv_connector_config=KvCacheConnectorConfig(server_url=kwargs.pop("server_url", None)),
        **kwargs,
    )


def test_defaults_match_design() -> None:
    s = parse_settings({}, _args())
    assert s.backend == contract.BACKEND_SIDECAR
    assert s.server_url == contract.server_url()
    assert (
        (s.lookup_timeout_ms, s.retrieve_timeout_ms, s.store_timeout_ms)
        == (
            Policy.lookup_timeout_ms,
            Policy.retrieve_timeout_ms,
            Policy.store_timeout_ms,
        )
        == (100, 5000, 5000)
    )
    assert not s.save_decode_tokens and s.metrics_enabled and s.chunk_size is None
    assert s.async_save  # measured to remove the engine's wait in wait_for_save


def test_server_url_from_llm_args_overrides_env() -> None:
    env = {contract.ENV_SERVER_URL: "tcp://127.0.0.1:1"}
    assert parse_settings(env, _args()).server_url == "tcp://127.0.0.1:1"
    assert parse_settings(env, _args(server_url="tcp://127.0.0.1:2")).server_url == "tcp://127.0.0.1:2"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({contract.ENV_BACKEND: "disk"}, "KVOFFLOAD_BACKEND='disk' is not allowed; allowed: sidecar, inprocess"),
        ({contract.ENV_SERVER_URL: "http://x"}, "is not a ZMQ URL"),
        (
            {contract.ENV_LOOKUP_TIMEOUT_MS: "fast"},
            "KVOFFLOAD_LOOKUP_TIMEOUT_MS='fast' is not allowed; an integer from 1 to 600000",
        ),
        ({contract.ENV_STORE_TIMEOUT_MS: "0"}, "STORE_TIMEOUT_MS=.0. is not allowed; an integer from 1 to 600000"),
        ({contract.ENV_SAVE_DECODE_TOKENS: "maybe"}, "is not a boolean"),
        ({contract.ENV_CHUNK_SIZE: "100"}, "must be a multiple of tokens_per_block=32"),
        ({contract.ENV_TOKENS_PER_BLOCK: "64"}, "disagrees with kv_cache_config.tokens_per_block=32"),
    ],
)
def test_errors_name_setting_and_value(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        parse_settings(env, _args())


def test_pipeline_parallel_rejected() -> None:
    args = _args()
    args.pipeline_parallel_size = 2
    with pytest.raises(SettingsError, match="pipeline_parallel_size=2"):
        parse_settings({}, args)


def test_world_size_and_flags() -> None:
    env = {contract.ENV_SAVE_DECODE_TOKENS: "yes", contract.ENV_METRICS_ENABLED: "0", contract.ENV_ASYNC_SAVE: "off"}
    s = parse_settings(env, _args(tp=2))
    assert s.world_size == 2 and s.save_decode_tokens and not s.metrics_enabled and not s.async_save


def test_async_load_threshold_from_env_zero_turns_it_off_and_negative_is_refused() -> None:
    assert parse_settings({}, _args()).async_load_min_tokens == 4096
    assert parse_settings({contract.ENV_ASYNC_LOAD_MIN_TOKENS: "0"}, _args()).async_load_min_tokens == 0
    with pytest.raises(SettingsError, match="KVOFFLOAD_ASYNC_LOAD_MIN_TOKENS='-1' must be an integer of at least 0"):
        parse_settings({contract.ENV_ASYNC_LOAD_MIN_TOKENS: "-1"}, _args())


@pytest.mark.parametrize(
    ("matched", "threshold", "world", "expected"),
    [(4096, 4096, 1, True), (4095, 4096, 1, False), (32768, 4096, 2, False), (32768, 0, 1, False)],
)
def test_loads_are_async_from_the_threshold_with_one_rank_only(
    matched: int, threshold: int, world: int, expected: bool
) -> None:
    from kvoffload.connector.planning import load_is_async

    assert load_is_async(matched, threshold, world) is expected


def test_attention_dp_ranks_hold_whole_kv_heads_and_in_process_is_refused_with_it() -> None:
    s = parse_settings({}, _args(tp=4, enable_attention_dp=True))
    assert s.attention_dp and s.world_size == 1
    with pytest.raises(SettingsError, match="enable_attention_dp: the in-process cache lives in one engine process"):
        parse_settings({contract.ENV_BACKEND: contract.BACKEND_INPROCESS}, _args(tp=2, enable_attention_dp=True))


def test_block_reuse_off_is_refused_at_start_because_every_load_would_be_dropped() -> None:
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig

    args = _args()
    args.kv_cache_config = KvCacheConfig(tokens_per_block=32, enable_block_reuse=False)
    with pytest.raises(
        SettingsError, match=r"kv_cache_config\.enable_block_reuse=false: TensorRT-LLM then applies none"
    ):
        parse_settings({}, args)


@pytest.mark.parametrize("manager_v2", [True, False, "auto"])
def test_either_kv_cache_manager_starts_the_connector(manager_v2: bool | str) -> None:
    """KVCacheManagerV2 is main's default for most models ("auto" resolves to it): it is served."""
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig

    args = _args()
    args.kv_cache_config = KvCacheConfig(tokens_per_block=32, use_kv_cache_manager_v2=manager_v2)
    assert parse_settings({}, args).tokens_per_block == 32


@given(st.text(max_size=300))
def test_salt_is_lmcache_safe_and_injective_enough(raw: str) -> None:
    salt = normalize_salt(raw)
    if raw == "":
        assert salt == ""
        return
    assert len(salt) <= 128 and not set(salt) & set("@/\\\x00")
    assert salt != normalize_salt(raw + "x")


def test_cache_model_name_tags_the_chunk_layout_without_lmcache_key_separators() -> None:
    import torch
    from lmcache.utils import CacheEngineKey

    tagged = cache_model_name("meta-llama/Llama-3.1-8B", chunk_layout(torch.float8_e4m3fn, 32, 2**21))
    assert tagged != "meta-llama/Llama-3.1-8B" and tagged.startswith("meta-llama/Llama-3.1-8B")
    assert "@" not in tagged.removeprefix("meta-llama/Llama-3.1-8B")
    key = CacheEngineKey(model_name=tagged, world_size=1, worker_id=0, chunk_hash=7, dtype=torch.bfloat16)
    assert CacheEngineKey.from_string(key.to_string()).model_name == tagged


def test_salt_of_reads_newer_and_older_fields() -> None:
    class New:
        cache_salt = "tenant"
        cache_salt_id = None

    class Old:
        cache_salt_id = 42

    class Neither:
        pass

    assert salt_of(New()) == normalize_salt("tenant")
    assert salt_of(Old()) == normalize_salt(42)
    assert salt_of(Neither()) == ""
    assert salt_of(Old()) != salt_of(New())


def test_kv_geometry_from_hf_config_and_fallback() -> None:
    llama = {"num_key_value_heads": 8, "num_attention_heads": 32, "hidden_size": 4096}
    assert kv_geometry(8 * 32 * 128, 32, llama, 1).num_kv_heads == 8
    assert kv_geometry(4 * 32 * 128, 32, llama, 2).num_kv_heads == 4
    fallback = kv_geometry(4 * 32 * 128, 32, None, 1)
    assert (fallback.num_kv_heads, fallback.head_dim) == (1, 4 * 128)
    with pytest.raises(ValueError, match="not a multiple of tokens_per_block"):
        kv_geometry(100, 32, None, 1)


def test_metrics_bound_once_and_errors_bounded() -> None:
    from kvoffload.connector.metrics import ConnectorMetrics, ProcessMetrics

    m = ConnectorMetrics("unit-model", contract.BACKEND_SIDECAR)
    m.error("lookup", "timeout")
    m.error("store", "never-heard-of")
    m.lookup_requests.inc()
    process = ProcessMetrics()
    assert process.get("unit-model-2", "sidecar", True) is process.get("unit-model-2", "sidecar", True)
    names = {mf.name for mf in m.registry.collect()}
    assert contract.M_LOOKUP_REQUESTS in names and contract.M_CONNECTOR_ERRORS in names
    errors = {
        (s.labels["operation"], s.labels["reason"]): s.value
        for mf in m.registry.collect()
        if mf.name == contract.M_CONNECTOR_ERRORS
        for s in mf.samples
        if s.name.endswith("_total")
    }
    assert errors[("lookup", "timeout")] == 1 and errors[("store", "error")] == 1
    disabled = ConnectorMetrics("unit-model", contract.BACKEND_SIDECAR, enabled=False)
    disabled.lookup_requests.inc()
    disabled.error("lookup", "timeout")
