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
from kvoffload import policy as pol
from kvoffload.policy import Policy, PolicyError

DEFAULT_HEARTBEAT_INTERVAL_MS = 2000
DEFAULT_TOKENS_PER_BLOCK = 32
DEFAULT_ASYNC_SAVE = True
"""Measured: removes the engine's wait in wait_for_save (docs/connector.md)."""
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


def _parse_positive_int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise SettingsError(f"{name}={raw!r} is not an integer; allowed: a positive integer") from None
    if value <= 0:
        raise SettingsError(f"{name}={raw!r} must be a positive integer")
    return value


def _parse_port(env: Mapping[str, str], name: str) -> int | None:
    port = _parse_positive_int(env, name, None)
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
    backend = _policy_value(env, contract.ENV_BACKEND, pol.read_choice(pol.BACKENDS), Policy.backend)

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
    tokens_per_block = _parse_positive_int(
        env, contract.ENV_TOKENS_PER_BLOCK, int(tpb_args) if tpb_args else DEFAULT_TOKENS_PER_BLOCK
    )
    assert tokens_per_block is not None
    if tpb_args and int(tpb_args) != tokens_per_block:
        raise SettingsError(
            f"{contract.ENV_TOKENS_PER_BLOCK}={tokens_per_block} disagrees with "
            f"kv_cache_config.tokens_per_block={tpb_args}; they must match"
        )
    chunk_size = _parse_positive_int(env, contract.ENV_CHUNK_SIZE, None)
    if chunk_size is not None and chunk_size % tokens_per_block != 0:
        raise SettingsError(
            f"{contract.ENV_CHUNK_SIZE}={chunk_size} must be a multiple of tokens_per_block={tokens_per_block}"
        )

    tp = int(_attr(llm_args, "tensor_parallel_size") or 1)
    pp = int(_attr(llm_args, "pipeline_parallel_size") or 1)
    if pp != 1:
        raise SettingsError(f"pipeline_parallel_size={pp}: TensorRT-LLM's KV connector requires 1")

    def timeout(name: str, default: int) -> int:
        return _policy_value(env, name, pol.read_int(pol.MIN_TIMEOUT_MS, pol.MAX_TIMEOUT_MS), default, numeric=True)

    return ConnectorSettings(
        backend=backend,
        server_url=server_url,
        model_name=model_name,
        tokens_per_block=tokens_per_block,
        chunk_size=chunk_size,
        world_size=tp * pp,
        lookup_timeout_ms=timeout(contract.ENV_LOOKUP_TIMEOUT_MS, Policy.lookup_timeout_ms),
        retrieve_timeout_ms=timeout(contract.ENV_RETRIEVE_TIMEOUT_MS, Policy.retrieve_timeout_ms),
        store_timeout_ms=timeout(contract.ENV_STORE_TIMEOUT_MS, Policy.store_timeout_ms),
        heartbeat_interval_ms=timeout(contract.ENV_HEARTBEAT_INTERVAL_MS, DEFAULT_HEARTBEAT_INTERVAL_MS),
        save_decode_tokens=_parse_bool(env, contract.ENV_SAVE_DECODE_TOKENS, False),
        async_save=_parse_bool(env, contract.ENV_ASYNC_SAVE, DEFAULT_ASYNC_SAVE),
        metrics_enabled=_parse_bool(env, contract.ENV_METRICS_ENABLED, True),
        metrics_dir=env.get(contract.ENV_PROMETHEUS_MULTIPROC_DIR) or None,
        metrics_port=_parse_port(env, contract.ENV_METRICS_PORT),
    )
