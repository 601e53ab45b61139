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
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import unquote, urlsplit

from kvoffload import contract
from kvoffload.quantity import QuantityError, parse_bytes

DEFAULT_L1_SIZE = "20Gi"
DEFAULT_EVICTION_POLICY = "LRU"
DEFAULT_CHUNK_SIZE = 256
DEFAULT_MAX_WORKERS = 4
DEFAULT_GRACE_SECONDS = 25.0
DEFAULT_REDIS_PORT = 6379
EVICTION_POLICIES = ("LRU", "ARC")
MAX_CHUNK_SIZE = 65536
MAX_WORKERS = 64
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
    request_host: str = "127.0.0.1"
    """Where the ZMQ request port binds: loopback beside the engine; all addresses in a
    node-shared cache pod (``KVOFFLOAD_REQUEST_HOST=0.0.0.0``)."""

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
        }


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _fail(setting: str, value: object, allowed: str) -> SettingsError:
    return SettingsError(f"{setting}: {_one_line(repr(value))} is not allowed; {allowed}")


class _Source:
    """Looks a setting up in env first, then in the policy spec, naming where it came from."""

    def __init__(self, env: Mapping[str, str], spec: Mapping[str, Any] | None) -> None:
        self.env = env
        self.spec = spec or {}

    def get(self, env_name: str, policy_path: tuple[str, ...] | None) -> tuple[str, object] | None:
        if env_name in self.env:
            return env_name, self.env[env_name]
        if policy_path is None:
            return None
        node: object = self.spec
        for i, part in enumerate(policy_path):
            if node is None:
                return None
            if not isinstance(node, Mapping):
                where = "policy " + ".".join(policy_path[:i]) if i else "policy spec"
                raise _fail(where, node, "must be a JSON object")
            node = node.get(part)
        if node is None:
            return None
        return "policy " + ".".join(policy_path), node


def _port(src: _Source, env_name: str, default: int) -> int:
    found = src.get(env_name, None)
    if found is None:
        return default
    setting, raw = found
    return _int(setting, raw, 1, 65535, "a TCP port number from 1 to 65535")


def _int(setting: str, raw: object, low: int, high: int, allowed: str) -> int:
    if isinstance(raw, bool):
        raise _fail(setting, raw, f"use {allowed}")
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, str) and re.fullmatch(r"\s*[0-9]+\s*", raw):
        value = int(raw)
    else:
        raise _fail(setting, raw, f"use {allowed}")
    if not low <= value <= high:
        raise _fail(setting, raw, f"use {allowed}")
    return value


def _quantity(setting: str, raw: object) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):
        raw = str(raw)
    if not isinstance(raw, str):
        raise _fail(setting, raw, "use a byte quantity such as 20Gi")
    try:
        return parse_bytes(raw, setting)
    except QuantityError as exc:
        raise SettingsError(_one_line(exc)) from None


def _absolute_path(setting: str, raw: object) -> str:
    if not isinstance(raw, str) or not raw.startswith("/") or "\x00" in raw or ".." in raw.split("/"):
        raise _fail(setting, raw, "use an absolute path without '..', e.g. /var/cache/kvoffload")
    return str(PurePosixPath(raw))


def _eviction_policy(src: _Source) -> str:
    found = src.get(contract.ENV_EVICTION_POLICY, ("cache", "evictionPolicy"))
    if found is None:
        return DEFAULT_EVICTION_POLICY
    setting, raw = found
    if isinstance(raw, str) and raw.strip().upper() in EVICTION_POLICIES:
        return raw.strip().upper()
    raise _fail(setting, raw, "use one of " + ", ".join(EVICTION_POLICIES))


def _fs_tier(src: _Source) -> FsTier | None:
    path_found = src.get(contract.ENV_L2_FS_PATH, ("l2", "fs", "path"))
    size_found = src.get(contract.ENV_L2_FS_SIZE, ("l2", "fs", "size"))
    if path_found is None or path_found[1] == "":
        if size_found is not None and size_found[1] != "":
            setting, raw = size_found
            raise _fail(
                setting,
                raw,
                f"a size needs a filesystem L2 path too ({contract.ENV_L2_FS_PATH} or policy l2.fs.path)",
            )
        return None
    path = _absolute_path(*path_found)
    size = None if size_found is None or size_found[1] == "" else _quantity(*size_found)
    return FsTier(path=path, size_bytes=size)


def _redis_tier(src: _Source) -> RedisTier | None:
    found = src.get(contract.ENV_L2_REDIS_URL, ("l2", "redis", "url"))
    password = src.env.get(contract.ENV_L2_REDIS_PASSWORD, "")
    if found is None or found[1] == "":
        if password:
            raise SettingsError(
                f"{contract.ENV_L2_REDIS_PASSWORD}: is set but no Redis L2 is configured; "
                f"set {contract.ENV_L2_REDIS_URL} or policy l2.redis.url, or unset the password"
            )
        return None
    setting, raw = found
    allowed = "use redis://[user@]host[:port][/0] (the password goes in " + contract.ENV_L2_REDIS_PASSWORD + ")"
    if not isinstance(raw, str):
        raise _fail(setting, raw, allowed)
    try:
        url = urlsplit(raw.strip())
        port = url.port
    except ValueError:
        raise _fail(setting, raw, allowed) from None
    if url.scheme != "redis" or not url.hostname or url.query or url.fragment:
        raise _fail(setting, raw, allowed)
    if url.password is not None:
        raise _fail(setting, _redact(raw), f"keep the password out of the URL: {allowed}")
    if url.path not in ("", "/", "/0"):
        raise _fail(setting, raw, f"LMCache's Redis adapter uses database 0 only: {allowed}")
    if not re.fullmatch(contract.REDIS_URL_PATTERN, raw.strip()):  # the CRD's rule, exactly
        raise _fail(setting, raw, allowed)
    return RedisTier(
        host=url.hostname,
        port=port or DEFAULT_REDIS_PORT,
        username=unquote(url.username or ""),
        password=password,
    )


def _redact(raw: str) -> str:
    return re.sub(r"//([^:/@]*):[^@]*@", r"//\1:***@", raw)


def _grace(src: _Source) -> float:
    found = src.get(contract.ENV_GRACE_SECONDS, None)
    if found is None:
        return DEFAULT_GRACE_SECONDS
    setting, raw = found
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
    src = _Source(env, spec)
    request_port = _port(src, contract.ENV_REQUEST_PORT, contract.REQUEST_PORT)
    lmcache_http_port = _port(src, contract.ENV_LMCACHE_HTTP_PORT, contract.LMCACHE_HTTP_PORT)
    sidecar_http_port = _port(src, contract.ENV_SIDECAR_HTTP_PORT, contract.SIDECAR_HTTP_PORT)
    ports = {
        contract.ENV_REQUEST_PORT: request_port,
        contract.ENV_LMCACHE_HTTP_PORT: lmcache_http_port,
        contract.ENV_SIDECAR_HTTP_PORT: sidecar_http_port,
    }
    if len(set(ports.values())) != len(ports):
        names = list(ports)
        for i, name in enumerate(names):
            for other in names[i + 1 :]:
                if ports[name] == ports[other]:
                    raise _fail(other, ports[other], f"it must differ from {name}")

    l1_found = src.get(contract.ENV_L1_SIZE, ("cache", "l1Size"))
    l1_size = _quantity(*l1_found) if l1_found else parse_bytes(DEFAULT_L1_SIZE, contract.ENV_L1_SIZE)
    if l1_found and l1_size < parse_bytes(contract.MIN_L1_SIZE, l1_found[0]):
        raise _fail(*l1_found, f"use at least {contract.MIN_L1_SIZE} (LMCache's L1 must hold whole chunks)")

    chunk_found = src.get(contract.ENV_CHUNK_SIZE, ("cache", "chunkSize"))
    chunk_size = (
        _int(*chunk_found, 1, MAX_CHUNK_SIZE, f"a whole number of tokens from 1 to {MAX_CHUNK_SIZE}")
        if chunk_found
        else DEFAULT_CHUNK_SIZE
    )
    workers_found = src.get(contract.ENV_MAX_WORKERS, ("cache", "maxWorkers"))
    max_workers = (
        _int(*workers_found, 1, MAX_WORKERS, f"a whole number from 1 to {MAX_WORKERS}")
        if workers_found
        else DEFAULT_MAX_WORKERS
    )

    instance_id = _name(contract.ENV_INSTANCE_ID, env.get(contract.ENV_INSTANCE_ID, "") or "kvoffload")
    shm_raw = env.get(contract.ENV_SHM_NAME, "")
    shm_name = _name(contract.ENV_SHM_NAME, shm_raw) if shm_raw else SHM_NAME_PREFIX + instance_id

    track_raw = env.get(contract.ENV_LMCACHE_TRACK_USAGE, "false")
    return SidecarSettings(
        request_port=request_port,
        lmcache_http_port=lmcache_http_port,
        sidecar_http_port=sidecar_http_port,
        l1_size_bytes=l1_size,
        eviction_policy=_eviction_policy(src),
        chunk_size=chunk_size,
        max_workers=max_workers,
        l2_fs=_fs_tier(src),
        l2_redis=_redis_tier(src),
        instance_id=instance_id,
        shm_name=shm_name,
        grace_seconds=_grace(src),
        metrics_dir=_absolute_path(
            contract.ENV_PROMETHEUS_MULTIPROC_DIR,
            env.get(contract.ENV_PROMETHEUS_MULTIPROC_DIR, contract.METRICS_DIR),
        ),
        track_usage=_bool(contract.ENV_LMCACHE_TRACK_USAGE, track_raw),
        policy_file=policy_file,
        request_host=_request_host(env.get(contract.ENV_REQUEST_HOST, "") or "127.0.0.1"),
    )


def _request_host(raw: str) -> str:
    try:
        return str(ipaddress.ip_address(raw))
    except ValueError:
        raise _fail(contract.ENV_REQUEST_HOST, raw, "an IP address, e.g. 127.0.0.1 or 0.0.0.0") from None


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
