"""The sidecar's settings: environment plus the mounted policy file, validated once.

``load_settings`` is pure: it takes the environment mapping and the parsed policy
``spec`` (a dict, or ``None`` when no policy file is mounted) and returns a frozen
``SidecarSettings`` or raises ``SettingsError``. Each error message is one line that
names the setting, the bad value and what is allowed, so ``__main__`` can print it
as is and exit before anything starts.

Precedence per setting: environment variable, then the policy file, then the default.
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import unquote, urlsplit

from kvoffload import contract
from kvoffload import policy_values as polv
from kvoffload.cache_keys import CacheKeysError, read_server_keys
from kvoffload.policy import Policy, parse_policy
from kvoffload.policy_values import PolicyError

DEFAULT_GRACE_SECONDS = 25.0
DEFAULT_REDIS_PORT = 6379
MAX_GRACE_SECONDS = 3600.0
DEFAULT_POLICY_FILE = f"{contract.POLICY_MOUNT_PATH}/{contract.POLICY_FILE}"
SHM_NAME_PREFIX = "kvoffload_"

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingsError(ValueError):
    """A setting that cannot be used; ``str()`` is one line naming setting, value and what is allowed."""


@dataclass(frozen=True)
class FsTier:
    """Local-filesystem L2 tier."""

    path: str
    size_bytes: int | None
    """Upper bound on the tier's bytes, or ``None`` for unbounded (LMCache's plain ``fs`` adapter)."""


@dataclass(frozen=True)
class RedisTier:
    """Redis (RESP) L2 tier."""

    host: str
    port: int
    username: str
    password: str = ""  # never in argv or logs: handed to LMCache through its env var


@dataclass(frozen=True)
class SidecarSettings:
    """Everything the sidecar needs, validated; the rest of the sidecar never sees raw strings."""

    request_port: int
    lmcache_http_port: int
    sidecar_http_port: int
    l1_size_bytes: int
    eviction_policy: str
    chunk_size: int
    max_workers: int
    l2_fs: FsTier | None
    l2_redis: RedisTier | None
    instance_id: str
    shm_name: str
    grace_seconds: float
    metrics_dir: str
    track_usage: bool
    policy_file: str | None
    """The policy file the settings were read from, ``None`` when none was mounted."""
    warm_standby: bool = True
    """Keep a standby process with LMCache's server imported (about 0.65 GiB resident), which forks
    a new server at once when the running one crashes (``KVOFFLOAD_WARM_STANDBY``)."""
    kv_events_port: int | None = None
    """Publish KV events for routers on this port (``KVOFFLOAD_KV_EVENTS_PORT``); None: no events."""
    kv_events_topic: str = ""
    """The topic of every event batch (``KVOFFLOAD_KV_EVENTS_TOPIC``; llm-d's index reads ``kv@<pod>@<model>``)."""
    kv_events_format: str = polv.KV_EVENTS_FORMATS[0]
    """The events' wire format (``KVOFFLOAD_KV_EVENTS_FORMAT``, one of ``policy_values.KV_EVENTS_FORMATS``)."""
    request_host: str = "127.0.0.1"
    """Where the ZMQ request port binds: loopback beside the engine; all addresses in a
    node-shared cache pod (``KVOFFLOAD_REQUEST_HOST=0.0.0.0``)."""
    cache_keys_dir: str | None = None
    """The policy's CURVE keys (``KVOFFLOAD_CACHE_KEYS_DIR``, checked readable): the server then
    admits only the policy's client key. Required when the request port leaves the loopback."""

    def describe(self) -> dict[str, str]:
        """Non-secret settings as strings, for logs and the config-info metric."""
        return {
            "instance_id": self.instance_id,
            "request_port": str(self.request_port),
            "l1_size_bytes": str(self.l1_size_bytes),
            "eviction_policy": self.eviction_policy,
            "chunk_size": str(self.chunk_size),
            "max_workers": str(self.max_workers),
            "l2_fs": self.l2_fs.path if self.l2_fs else "",
            "l2_fs_size_bytes": str(self.l2_fs.size_bytes or "") if self.l2_fs else "",
            "l2_redis": f"{self.l2_redis.host}:{self.l2_redis.port}" if self.l2_redis else "",
            "kv_events_port": str(self.kv_events_port or ""),
            "kv_events_topic": self.kv_events_topic,
            "kv_events_format": self.kv_events_format,
        }


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _fail(setting: str, value: object, allowed: str) -> SettingsError:
    return SettingsError(f"{setting}: {_one_line(repr(value))} is not allowed; {allowed}")


def _checked(value: Any) -> Any:
    """A policy reader's value, or its error raised as a one-line ``SettingsError``."""
    if isinstance(value, PolicyError):
        raise SettingsError(value.message)
    return value


def _port(env: Mapping[str, str], env_name: str, default: int) -> int:
    raw = env.get(env_name)
    return default if raw is None else _int(env_name, raw, 1, 65535, "a TCP port number from 1 to 65535")


def _int(setting: str, raw: object, low: int, high: int, allowed: str) -> int:
    value = _env_int(raw) if isinstance(raw, str) else raw
    if isinstance(value, int) and low <= value <= high:
        return value
    raise _fail(setting, raw, f"use {allowed}")


def _env_int(raw: str) -> object:
    """An env var's text as the integer a policy field holds (anything else stays text, to be refused)."""
    # ASCII digits between spaces only: re's \s also matches \x1c-\x1f, which int() refuses.
    return int(raw) if re.fullmatch(r"[ \t]*[0-9]+[ \t]*", raw) else raw


def _absolute_path(setting: str, raw: object) -> str:
    if not isinstance(raw, str) or not polv.is_plain_absolute_path(raw):
        raise _fail(setting, raw, "use an absolute path without '..', e.g. /var/cache/kvoffload")
    return str(PurePosixPath(raw))


_ENV_OVERRIDES: tuple[tuple[str, str, Any, bool], ...] = (
    (contract.ENV_L1_SIZE, "l1_bytes", polv.read_quantity(minimum=contract.MIN_L1_SIZE), False),
    (contract.ENV_EVICTION_POLICY, "eviction_policy", polv.read_choice(polv.EVICTION_POLICIES), False),
    (contract.ENV_CHUNK_SIZE, "chunk_size", polv.read_int(polv.MIN_CHUNK_SIZE, polv.MAX_CHUNK_SIZE,
                                                         polv.CHUNK_SIZE_MULTIPLE), True),
    (contract.ENV_MAX_WORKERS, "max_workers", polv.read_int(polv.MIN_WORKERS, polv.MAX_WORKERS), True),
)  # fmt: skip
"""Env vars that override one policy field, each read by that field's policy reader."""


def _policy(env: Mapping[str, str], spec: Mapping[str, Any] | None) -> Policy:
    """The policy file's spec over the defaults, then the env overrides: the policy's own readers."""
    policy = _checked(parse_policy(spec or {}, Policy(), "policy spec"))
    updates: dict[str, Any] = {}
    for name, attr, read, numeric in _ENV_OVERRIDES:
        if name in env:
            value = read(_env_int(env[name]) if numeric else env[name], name)
            if isinstance(value, PolicyError):  # name the env var's own text, not its parsed form
                raise SettingsError(replace(value, value=env[name]).message)
            updates[attr] = value
    return replace(policy, **updates)


def _fs_tier(env: Mapping[str, str], policy: Policy) -> FsTier | None:
    """Env path and size each override the policy's (an empty value: none)."""
    tier = policy.fs_tier
    path = env.get(contract.ENV_L2_FS_PATH, tier.path if tier else "")
    size = env.get(contract.ENV_L2_FS_SIZE)
    if not path:
        if size:
            raise _fail(contract.ENV_L2_FS_SIZE, size,
                        f"a size needs a filesystem L2 path too ({contract.ENV_L2_FS_PATH} or policy l2.fs.path)")  # fmt: skip
        return None
    if size is None:
        size_bytes = tier.size_bytes if tier else None
    else:
        size_bytes = _checked(polv.read_quantity()(size, contract.ENV_L2_FS_SIZE)) if size else None
    plain = _absolute_path(contract.ENV_L2_FS_PATH, path)
    problem = polv.fs_path_problem(plain)
    if problem is not None:
        raise _fail(contract.ENV_L2_FS_PATH, path, problem)
    return FsTier(path=plain, size_bytes=size_bytes)


def _redis_tier(env: Mapping[str, str], policy: Policy) -> RedisTier | None:
    """The env URL overrides the policy's inline one (an empty value: no Redis tier); a policy whose URL
    is in a Secret (``urlSecretRef``) gets it only by env, which must then hold one."""
    tier = policy.redis_tier
    raw = env.get(contract.ENV_L2_REDIS_URL, (tier.url or "") if tier else "")
    password = env.get(contract.ENV_L2_REDIS_PASSWORD, "")
    if not raw and tier is not None and tier.url is None:
        raise SettingsError(
            f"{contract.ENV_L2_REDIS_URL}: is empty, and policy l2.redis.urlSecretRef (Secret "
            f"{tier.url_secret_name}, key {tier.url_secret_key}) names no URL anywhere else: put the URL in that key"
        )
    if not raw:
        if password:
            raise SettingsError(
                f"{contract.ENV_L2_REDIS_PASSWORD}: is set but no Redis L2 is configured; "
                f"set {contract.ENV_L2_REDIS_URL} or policy l2.redis.url, or unset the password"
            )
        return None
    url = urlsplit(_checked(polv.read_redis_url(raw, contract.ENV_L2_REDIS_URL)))
    return RedisTier(host=url.hostname or "", port=url.port or DEFAULT_REDIS_PORT,
                     username=unquote(url.username or ""), password=password)  # fmt: skip


def _grace(env: Mapping[str, str]) -> float:
    raw = env.get(contract.ENV_GRACE_SECONDS)
    if raw is None:
        return DEFAULT_GRACE_SECONDS
    setting = contract.ENV_GRACE_SECONDS
    allowed = f"use a number of seconds greater than 0 and at most {MAX_GRACE_SECONDS:g}"
    try:
        value = float(str(raw))
    except ValueError:
        raise _fail(setting, raw, allowed) from None
    if not math.isfinite(value) or not 0 < value <= MAX_GRACE_SECONDS:
        raise _fail(setting, raw, allowed)
    return value


def _bool(setting: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise _fail(setting, raw, "use true or false")


def _name(setting: str, raw: str) -> str:
    if not _NAME.match(raw):
        raise _fail(
            setting,
            raw,
            "use 1-200 characters of letters, digits, '.', '_' or '-', starting with a letter or digit",
        )
    return raw


def load_settings(
    env: Mapping[str, str], spec: Mapping[str, Any] | None, policy_file: str | None = None
) -> SidecarSettings:
    """Validated settings from ``env`` and the policy ``spec``; raises ``SettingsError``."""
    if spec is not None and not isinstance(spec, Mapping):
        raise _fail("policy spec", spec, "the policy file must hold a JSON object (the policy spec)")
    request_port = _port(env, contract.ENV_REQUEST_PORT, contract.REQUEST_PORT)
    lmcache_http_port = _port(env, contract.ENV_LMCACHE_HTTP_PORT, contract.LMCACHE_HTTP_PORT)
    sidecar_http_port = _port(env, contract.ENV_SIDECAR_HTTP_PORT, contract.SIDECAR_HTTP_PORT)
    ports = {contract.ENV_REQUEST_PORT: request_port, contract.ENV_LMCACHE_HTTP_PORT: lmcache_http_port,
             contract.ENV_SIDECAR_HTTP_PORT: sidecar_http_port}  # fmt: skip
    events_raw = env.get(contract.ENV_KV_EVENTS_PORT, "").strip()
    kv_events_port = _port(env, contract.ENV_KV_EVENTS_PORT, 0) if events_raw else None
    if kv_events_port is not None:
        ports[contract.ENV_KV_EVENTS_PORT] = kv_events_port
    _distinct_ports(ports)
    policy = _policy(env, spec)

    instance_id = _name(contract.ENV_INSTANCE_ID, env.get(contract.ENV_INSTANCE_ID, "") or "kvoffload")
    shm_raw = env.get(contract.ENV_SHM_NAME, "")
    shm_name = _name(contract.ENV_SHM_NAME, shm_raw) if shm_raw else SHM_NAME_PREFIX + instance_id

    track_raw = env.get(contract.ENV_LMCACHE_TRACK_USAGE, "false")
    request_host = _request_host(env.get(contract.ENV_REQUEST_HOST, "") or "127.0.0.1")
    return SidecarSettings(
        request_port=request_port,
        lmcache_http_port=lmcache_http_port,
        sidecar_http_port=sidecar_http_port,
        l1_size_bytes=policy.l1_bytes,
        eviction_policy=policy.eviction_policy,
        chunk_size=policy.chunk_size,
        max_workers=policy.max_workers,
        l2_fs=_fs_tier(env, policy),
        l2_redis=_redis_tier(env, policy),
        instance_id=instance_id,
        shm_name=shm_name,
        grace_seconds=_grace(env),
        metrics_dir=_absolute_path(
            contract.ENV_PROMETHEUS_MULTIPROC_DIR,
            env.get(contract.ENV_PROMETHEUS_MULTIPROC_DIR, contract.METRICS_DIR),
        ),
        track_usage=_bool(contract.ENV_LMCACHE_TRACK_USAGE, track_raw),
        policy_file=policy_file,
        request_host=request_host,
        cache_keys_dir=_cache_keys_dir(env, request_host),
        warm_standby=_bool(contract.ENV_WARM_STANDBY, env.get(contract.ENV_WARM_STANDBY, "true")),
        kv_events_port=kv_events_port,
        kv_events_topic=_kv_events_topic(env.get(contract.ENV_KV_EVENTS_TOPIC, "")),
        kv_events_format=_kv_events_format(env.get(contract.ENV_KV_EVENTS_FORMAT, "")),
    )


def _kv_events_format(raw: str) -> str:
    """The wire format named in the env (unset or empty: the default), or a one-line error naming the choices."""
    value = raw.strip() or polv.KV_EVENTS_FORMATS[0]
    if value not in polv.KV_EVENTS_FORMATS:
        raise _fail(contract.ENV_KV_EVENTS_FORMAT, raw, f"use one of {', '.join(polv.KV_EVENTS_FORMATS)}")
    return value


def _kv_events_topic(raw: str) -> str:
    topic = polv.read_kv_events_topic(raw, contract.ENV_KV_EVENTS_TOPIC)
    if isinstance(topic, PolicyError):
        raise _fail(contract.ENV_KV_EVENTS_TOPIC, raw, topic.allowed)
    return topic


def _distinct_ports(ports: Mapping[str, int]) -> None:
    names = list(ports)
    for i, name in enumerate(names):
        for other in names[i + 1 :]:
            if ports[name] == ports[other]:
                raise _fail(other, ports[other], f"it must differ from {name}")


def _request_host(raw: str) -> str:
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        raise _fail(contract.ENV_REQUEST_HOST, raw, "an IP address, e.g. 127.0.0.1 or 0.0.0.0") from None


def _cache_keys_dir(env: Mapping[str, str], request_host: str) -> str | None:
    """The keys directory, its files checked; a request port off the loopback must have one."""
    raw = env.get(contract.ENV_CACHE_KEYS_DIR, "")
    if not raw:
        if not ipaddress.ip_address(request_host).is_loopback:
            raise _fail(
                contract.ENV_REQUEST_HOST, request_host,
                f"a request port off the loopback needs {contract.ENV_CACHE_KEYS_DIR} (the policy's CURVE "
                "keys, which the operator mounts in node mode): LMCache's port would otherwise serve any client",
            )  # fmt: skip
        return None
    try:
        read_server_keys(raw)
    except CacheKeysError as exc:
        raise SettingsError(str(exc)) from None
    return raw


def parse_policy_text(text: str, path: str) -> dict[str, Any]:
    """The policy ``spec`` held in a policy file's text; raises ``SettingsError`` naming the file."""
    try:
        spec = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SettingsError(
            f"{contract.ENV_POLICY_FILE}: {path!r} is not valid JSON ({exc.msg} at line {exc.lineno}); "
            "it must hold the KVCachePolicy spec as a JSON object"
        ) from None
    if not isinstance(spec, dict):
        raise SettingsError(
            f"{contract.ENV_POLICY_FILE}: {path!r} holds a JSON {type(spec).__name__}; "
            "it must hold the KVCachePolicy spec as a JSON object"
        )
    return spec
