"""Connector settings: environment + TensorRT-LLM ``llm_args`` -> typed ``ConnectorSettings``.

Parsed once, at connector construction. Every error names the setting, the bad
value and what is allowed. ``llm_args.kv_connector_config.server_url`` (when
the TensorRT-LLM build has that field) overrides ``KVOFFLOAD_SERVER_URL``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload import contract
from kvoffload import policy_values as polv
from kvoffload.cache_keys import CacheKeysError, ClientKeys, read_client_keys
from kvoffload.policy import Policy
from kvoffload.policy_values import PolicyError
from kvoffload.quantity import QuantityError, parse_bytes

DEFAULT_HEARTBEAT_INTERVAL_MS = 2000
DEFAULT_TOKENS_PER_BLOCK = 32
DEFAULT_ASYNC_SAVE = True
DEFAULT_L1_BYTES = 2**30
"""The in-process backend's L1 when ``KVOFFLOAD_L1_SIZE`` is unset (1Gi)."""
"""Measured: removes the engine's wait in wait_for_save (docs/connector.md)."""
DEFAULT_ASYNC_LOAD_MIN_TOKENS = 4096
"""Measured on an H200 (docs/connector.md, "Async loads"): from 4,096 tokens (the smallest size
measured) a parked load stalls the other requests less than a blocking one and is in the pool as
early; below it, parking costs the loading request an iteration for a copy of a few ms."""
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})
_URL_SCHEMES = ("tcp://", "ipc://", "inproc://")


class SettingsError(ValueError):
    """A connector setting is invalid; the message names setting, value and what is allowed."""


@dataclass(frozen=True)
class ConnectorSettings:
    """Everything the connector needs to know about its deployment."""

    backend: str
    server_url: str
    model_name: str
    tokens_per_block: int
    chunk_size: int | None
    """None: ask the LMCache server (sidecar) or use LMCache's config (inprocess)."""
    world_size: int
    """Ranks that split one request's KV heads (tensor parallelism); 1 under attention DP."""
    lookup_timeout_ms: int
    retrieve_timeout_ms: int
    store_timeout_ms: int
    heartbeat_interval_ms: int
    save_decode_tokens: bool
    async_save: bool
    metrics_enabled: bool
    metrics_dir: str | None
    metrics_port: int | None = None
    """Serve the pod's connector metrics on this port (no sidecar in the pod to do it)."""
    async_load_min_tokens: int = 0
    """Loads of at least this many tokens are asynchronous (tensor parallelism: never); 0: never."""
    kv_events: bool = False
    """Report committed stores to the cache server's KV-event module (``KVOFFLOAD_KV_EVENTS``)."""
    cache_keys: ClientKeys | None = None
    """Node mode: the policy's CURVE keys (``KVOFFLOAD_CACHE_KEYS_DIR``); the connection to the cache
    server authenticates with them. None: a plain connection (the sidecar on the pod's loopback)."""
    l1_bytes: int | None = None
    """The in-process backend's L1 size (``KVOFFLOAD_L1_SIZE``); None with the sidecar (it sizes its own)."""
    attention_dp: bool = False
    """``enable_attention_dp``: every rank holds whole KV heads for its own requests, runs its own
    scheduler, and shares the cache with the other ranks as rank 0 of one."""
    model_source: str = ""
    """``llm_args.model``: the checkpoint (a path here, or a hub id) whose weights the keys identify."""
    model_revision: str | None = None
    """``llm_args.revision``: the hub revision pinned, which identifies a hub id's weights."""
    load_cost_guard: bool = True
    """Compute a hit instead of loading it where its load is measured slower (``load_cost``)."""
    layerwise_loads: bool = True
    """Copy synchronous loads span of layers by span, the forward pass's layers each waiting for its
    own (``KVOFFLOAD_LAYERWISE_LOADS``; ``layer_copies``)."""
    recompute_tokens_per_s: float | None = None
    """The engine's prefill rate as the operator gives it (``KVOFFLOAD_RECOMPUTE_TOKENS_PER_S``);
    None: measured on the device."""


def _parse_bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise SettingsError(f"{name}={raw!r} is not a boolean; allowed: true/false/1/0/yes/no/on/off")


def _parse_int(env: Mapping[str, str], name: str, default: int | None, minimum: int = 1) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    allowed = "a positive integer" if minimum == 1 else f"an integer of at least {minimum}"
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer; allowed: {allowed}") from None
    if value < minimum:
        raise SettingsError(f"{name}={raw!r} must be {allowed}")
    return value


def _parse_count(env: Mapping[str, str], name: str, default: int) -> int:
    value = _parse_int(env, name, default, minimum=0)
    assert value is not None
    return value


def _parse_rate(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        rate = float(raw)
    except ValueError:
        rate = -1.0
    if not rate > 0 or rate == float("inf"):
        raise SettingsError(f"{name}={raw!r} is not a rate; allowed: a positive number of tokens per second")
    return rate


def _parse_port(env: Mapping[str, str], name: str) -> int | None:
    port = _parse_int(env, name, None)
    if port is not None and port > 65535:
        raise SettingsError(f"{name}={port} is not a TCP port; allowed: 1-65535")
    return port


def _policy_value(env: Mapping[str, str], name: str, read: Any, default: Any, numeric: bool = False) -> Any:
    """A policy field set through env, read by the policy module's own reader."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = read(int(raw) if numeric and raw.strip().isdigit() else raw.strip(), name)
    if isinstance(value, PolicyError):
        raise SettingsError(f"{name}={raw!r} is not allowed; {value.allowed}")
    return value


def _attr(obj: Any, *path: str) -> Any:
    for name in path:
        if obj is None:
            return None
        obj = getattr(obj, name, None)
    return obj


def parse_settings(env: Mapping[str, str], llm_args: Any) -> ConnectorSettings:
    """Validate env + ``llm_args`` into settings, or raise ``SettingsError``."""
    backend = _policy_value(env, contract.ENV_BACKEND, polv.read_choice(polv.BACKENDS), Policy.backend)

    config_url = _attr(llm_args, "kv_connector_config", "server_url")
    server_url = str(config_url or env.get(contract.ENV_SERVER_URL) or contract.server_url())
    if backend == contract.BACKEND_SIDECAR and not server_url.startswith(_URL_SCHEMES):
        raise SettingsError(
            f"server_url={server_url!r} (kv_connector_config.server_url or {contract.ENV_SERVER_URL}) "
            f"is not a ZMQ URL; allowed schemes: {', '.join(_URL_SCHEMES)} (e.g. {contract.server_url()})"
        )

    model_name = env.get(contract.ENV_MODEL_NAME) or str(_attr(llm_args, "model") or "")
    if not model_name:
        raise SettingsError(f"{contract.ENV_MODEL_NAME} is empty and llm_args.model is unset; set either")

    tpb_args = _attr(llm_args, "kv_cache_config", "tokens_per_block")
    tokens_per_block = _parse_int(
        env, contract.ENV_TOKENS_PER_BLOCK, int(tpb_args) if tpb_args else DEFAULT_TOKENS_PER_BLOCK
    )
    assert tokens_per_block is not None
    if tpb_args and int(tpb_args) != tokens_per_block:
        raise SettingsError(
            f"{contract.ENV_TOKENS_PER_BLOCK}={tokens_per_block} disagrees with "
            f"kv_cache_config.tokens_per_block={tpb_args}; they must match"
        )
    chunk_size = _parse_int(env, contract.ENV_CHUNK_SIZE, None)
    if chunk_size is not None and chunk_size % tokens_per_block != 0:
        raise SettingsError(
            f"{contract.ENV_CHUNK_SIZE}={chunk_size} must be a multiple of tokens_per_block={tokens_per_block}"
        )

    tp = int(_attr(llm_args, "tensor_parallel_size") or 1)
    pp = int(_attr(llm_args, "pipeline_parallel_size") or 1)
    if pp != 1:
        raise SettingsError(f"pipeline_parallel_size={pp}: TensorRT-LLM's KV connector requires 1")
    problem = engine_config_problem(llm_args)
    if problem:
        raise SettingsError(problem)
    attention_dp = _attr(llm_args, "enable_attention_dp") is True
    if attention_dp and backend == contract.BACKEND_INPROCESS:
        raise SettingsError(
            f"{contract.ENV_BACKEND}={backend!r} with enable_attention_dp: the in-process cache lives in one "
            f"engine process and attention DP runs one per rank; use {contract.BACKEND_SIDECAR!r}"
        )

    def timeout(name: str, default: int) -> int:
        return _policy_value(env, name, polv.read_int(polv.MIN_TIMEOUT_MS, polv.MAX_TIMEOUT_MS), default, numeric=True)

    return ConnectorSettings(
        backend=backend,
        server_url=server_url,
        model_name=model_name,
        tokens_per_block=tokens_per_block,
        chunk_size=chunk_size,
        world_size=1 if attention_dp else tp * pp,
        lookup_timeout_ms=timeout(contract.ENV_LOOKUP_TIMEOUT_MS, Policy.lookup_timeout_ms),
        retrieve_timeout_ms=timeout(contract.ENV_RETRIEVE_TIMEOUT_MS, Policy.retrieve_timeout_ms),
        store_timeout_ms=timeout(contract.ENV_STORE_TIMEOUT_MS, Policy.store_timeout_ms),
        heartbeat_interval_ms=timeout(contract.ENV_HEARTBEAT_INTERVAL_MS, DEFAULT_HEARTBEAT_INTERVAL_MS),
        save_decode_tokens=_parse_bool(env, contract.ENV_SAVE_DECODE_TOKENS, False),
        async_save=_parse_bool(env, contract.ENV_ASYNC_SAVE, DEFAULT_ASYNC_SAVE),
        kv_events=_parse_bool(env, contract.ENV_KV_EVENTS, False),
        metrics_enabled=_parse_bool(env, contract.ENV_METRICS_ENABLED, True),
        metrics_dir=env.get(contract.ENV_PROMETHEUS_MULTIPROC_DIR) or None,
        metrics_port=_parse_port(env, contract.ENV_METRICS_PORT),
        async_load_min_tokens=_parse_count(env, contract.ENV_ASYNC_LOAD_MIN_TOKENS, DEFAULT_ASYNC_LOAD_MIN_TOKENS),
        attention_dp=attention_dp,
        cache_keys=_cache_keys(env),
        l1_bytes=_inprocess_l1_bytes(env) if backend == contract.BACKEND_INPROCESS else None,
        model_source=str(_attr(llm_args, "model") or ""),
        model_revision=str(_attr(llm_args, "revision")) if _attr(llm_args, "revision") else None,
        load_cost_guard=_parse_bool(env, contract.ENV_LOAD_COST_GUARD, True),
        layerwise_loads=_parse_bool(env, contract.ENV_LAYERWISE_LOADS, True),
        recompute_tokens_per_s=_parse_rate(env, contract.ENV_RECOMPUTE_TOKENS_PER_S),
    )


def _inprocess_l1_bytes(env: Mapping[str, str]) -> int:
    raw = env.get(contract.ENV_L1_SIZE)
    if raw is None or not raw.strip():
        return DEFAULT_L1_BYTES
    try:
        return parse_bytes(raw.strip(), contract.ENV_L1_SIZE)
    except QuantityError as exc:
        raise SettingsError(str(exc)) from None


def _cache_keys(env: Mapping[str, str]) -> ClientKeys | None:
    directory = env.get(contract.ENV_CACHE_KEYS_DIR)
    if not directory:
        return None
    try:
        return read_client_keys(directory)
    except CacheKeysError as exc:
        raise SettingsError(str(exc)) from None


def engine_config_problem(llm_args: Any) -> str | None:
    """Why TensorRT-LLM, configured so, would not use this connector's loads correctly, or None.

    Without block reuse TensorRT-LLM asks for matched tokens but applies none of them (V1), or
    refuses the connector (KVCacheManagerV2). Either KV cache manager is served: the honoured count
    is read per request (``scheduler._honoured``), and a layout of several layer groups is moved as
    one chunk per block range (``worker.register_kv_cache_layout``, ``layout.GroupedLayout``).
    """
    if _attr(llm_args, "kv_cache_config", "enable_block_reuse") is False:
        return (
            "kv_cache_config.enable_block_reuse=false: TensorRT-LLM then applies none of the tokens a KV "
            "connector loads; set it to true (the kvoffload operator does unless the options file says false)"
        )
    return None
