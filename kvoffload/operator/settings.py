"""Raw workload annotations + KVCachePolicy spec + operator defaults -> validated settings.

Everything that reaches the fragment renderer has been parsed here once; the rest of the
operator never sees a raw annotation string. Problems come back as a :class:`SettingsError`
value naming the field, the bad value and what is allowed, never as an exception.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvoffload import contract as c
from kvoffload.quantity import QuantityError, format_bytes, parse_bytes

MODES = ("sidecar", "node")
EVICTION_POLICIES = ("LRU", "ARC")
BACKENDS = (c.BACKEND_SIDECAR, c.BACKEND_INPROCESS)
CONNECTOR_SOURCES = ("init-container", "image")
GPU_ACCESS_MODES = ("nvidia-runtime", "none")
ENABLED_VALUES = ("true", "false")
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
CHUNK_SIZE_MULTIPLE = 16
"""TensorRT-LLM's tokens_per_block is a power of two >= 16; a chunk must hold whole blocks."""
MAX_CHUNK_SIZE = 65536
MAX_WORKERS = 64
MAX_TIMEOUT_MS = 600_000
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_REDIS_URL = re.compile(c.REDIS_URL_PATTERN)
_IMAGE = re.compile(r"^[^\s\x00-\x1f\x7f]{1,1024}$")
"""An image reference: one token, no whitespace or control characters (else every pod fails to pull)."""
_QUANTITY = re.compile(r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[KMGTPE]i|[numkMGTPE])?$")
"""Kubernetes' resource.Quantity syntax (any unit: cpu, memory, extended resources)."""
_RESOURCE_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
RESOURCE_KEYS = ("limits", "requests")


@dataclass(frozen=True)
class SettingsError:
    """Why a workload cannot be injected: the field, the value and what would be allowed."""

    field: str
    value: object
    allowed: str
    reason: str = "invalid_settings"
    """Short machine-readable cause, used as the error metric's ``reason`` label."""

    @property
    def message(self) -> str:
        return f"{self.field}: {self.value!r} is not allowed; {self.allowed}"


@dataclass(frozen=True)
class RedisTier:
    url: str
    password_secret_name: str | None = None
    password_secret_key: str | None = None


@dataclass(frozen=True)
class FsTier:
    path: str
    size_bytes: int


@dataclass(frozen=True)
class OperatorDefaults:
    """What applies when neither a policy nor an annotation says otherwise (Helm values)."""

    sidecar_image: str = "ghcr.io/kvoffload/sidecar:0.1.0"
    bundle_image: str = "ghcr.io/kvoffload/connector-bundle:0.1.0"
    l1_bytes: int = 20 * 2**30
    shm_bytes: int = 8 * 2**30
    eviction_policy: str = "LRU"
    chunk_size: int = 256
    max_workers: int = 4
    gpu_access: str = "none"
    """The sidecar's data path (shared-memory L1) needs no GPU; nvidia-runtime is for CUDA-IPC transfer."""
    runtime_class_name: str | None = None
    sidecar_memory_overhead_bytes: int = 2 * 2**30
    sidecar_cpu_request: str = "1"
    lookup_timeout_ms: int = 100
    retrieve_timeout_ms: int = 5000
    store_timeout_ms: int = 5000
    image_pull_policy: str = "IfNotPresent"
    spec: Mapping[str, Any] = field(default_factory=dict)
    """A KVCachePolicy-shaped ``spec`` (the Helm ``defaults`` value) laid over the fields above."""


@dataclass(frozen=True)
class InjectionSettings:
    """Everything the renderer needs for one workload, validated."""

    policy_name: str | None
    mode: str
    backend: str
    connector_source: str
    container: str | None
    l1_bytes: int
    shm_bytes: int
    eviction_policy: str
    chunk_size: int
    max_workers: int
    sidecar_image: str
    bundle_image: str
    sidecar_resources: Mapping[str, Any] | None
    sidecar_memory_overhead_bytes: int
    sidecar_cpu_request: str
    gpu_access: str
    runtime_class_name: str | None
    lookup_timeout_ms: int
    retrieve_timeout_ms: int
    store_timeout_ms: int
    save_decode_tokens: bool
    image_pull_policy: str
    fs_tier: FsTier | None = None
    redis_tier: RedisTier | None = None

    def policy_document(self) -> dict[str, Any]:
        """The effective policy ``spec`` (camelCase, as in the CRD) the sidecar reads as policy.json."""
        doc: dict[str, Any] = {
            "mode": self.mode,
            "cache": {
                "l1Size": format_bytes(self.l1_bytes),
                "evictionPolicy": self.eviction_policy,
                "chunkSize": self.chunk_size,
                "maxWorkers": self.max_workers,
            },
            "shmSize": format_bytes(self.shm_bytes),
            "connector": {
                "backend": self.backend,
                "source": self.connector_source,
                "lookupTimeoutMs": self.lookup_timeout_ms,
                "retrieveTimeoutMs": self.retrieve_timeout_ms,
                "storeTimeoutMs": self.store_timeout_ms,
                "saveDecodeTokens": self.save_decode_tokens,
            },
            "ports": {
                "request": c.REQUEST_PORT,
                "lmcacheHttp": c.LMCACHE_HTTP_PORT,
                "sidecarHttp": c.SIDECAR_HTTP_PORT,
            },
        }
        l2: dict[str, Any] = {}
        if self.fs_tier:
            l2["fs"] = {"path": self.fs_tier.path, "size": format_bytes(self.fs_tier.size_bytes)}
        if self.redis_tier:
            redis: dict[str, Any] = {"url": self.redis_tier.url}
            if self.redis_tier.password_secret_name:
                redis["passwordSecretRef"] = {
                    "name": self.redis_tier.password_secret_name,
                    "key": self.redis_tier.password_secret_key,
                }
            l2["redis"] = redis
        if l2:
            doc["l2"] = l2
        return doc


def enabled_state(annotations: Mapping[str, str] | None) -> bool | SettingsError:
    """Whether ``kvoffload.io/enabled`` opts the workload in; absent means no."""
    raw = (annotations or {}).get(c.ANN_ENABLED)
    if raw is None:
        return False
    if raw not in ENABLED_VALUES:  # exactly: "TRUE" or " true " would be a silent reading of a typo
        return SettingsError(c.ANN_ENABLED, raw, 'allowed: "true" or "false"')
    return raw == "true"


# --- small typed readers: each returns the value or a SettingsError -----------


def _choice(value: object, field_name: str, allowed: tuple[str, ...]) -> str | SettingsError:
    if isinstance(value, str) and value in allowed:
        return value
    return SettingsError(field_name, value, "allowed: " + ", ".join(allowed))


def _quantity(value: object, field_name: str) -> int | SettingsError:
    if not isinstance(value, str):
        return SettingsError(field_name, value, "a byte quantity string such as 20Gi")
    try:
        return parse_bytes(value, field_name)
    except QuantityError as exc:
        return SettingsError(field_name, value, str(exc).split("; ", 1)[-1])


def _l1_size(value: object, field_name: str) -> int | SettingsError:
    size = _quantity(value, field_name)
    if isinstance(size, int) and size < parse_bytes(c.MIN_L1_SIZE, field_name):
        return SettingsError(field_name, value, f"at least {c.MIN_L1_SIZE} (LMCache's L1 must hold whole chunks)")
    return size


def _int(value: object, field_name: str, lo: int, hi: int, multiple: int = 1) -> int | SettingsError:
    if isinstance(value, bool) or not isinstance(value, int):
        return SettingsError(field_name, value, f"an integer from {lo} to {hi}")
    if not lo <= value <= hi:
        return SettingsError(field_name, value, f"an integer from {lo} to {hi}")
    if value % multiple:
        return SettingsError(field_name, value, f"a multiple of {multiple} (whole TensorRT-LLM blocks)")
    return value


def _bool(value: object, field_name: str) -> bool | SettingsError:
    if isinstance(value, bool):
        return value
    return SettingsError(field_name, value, "true or false")


def _mapping(value: object, field_name: str) -> Mapping[str, Any] | SettingsError:
    if isinstance(value, Mapping):
        return value
    return SettingsError(field_name, value, "an object")


def _image(value: object, field_name: str) -> str | SettingsError:
    if isinstance(value, str) and _IMAGE.fullmatch(value):
        return value
    return SettingsError(field_name, value, "an image reference without whitespace or control characters")


def _resources(value: object, field_name: str) -> Mapping[str, Any] | SettingsError:
    """A container ``resources`` object: only limits/requests, each resource name -> quantity."""
    res = _mapping(value, field_name)
    if isinstance(res, SettingsError):
        return res
    for key, amounts in res.items():
        if key not in RESOURCE_KEYS:
            return SettingsError(f"{field_name}.{key}", amounts, "allowed keys: " + ", ".join(RESOURCE_KEYS))
        if not isinstance(amounts, Mapping):
            return SettingsError(f"{field_name}.{key}", amounts, "an object of resource name to quantity")
        for name, amount in amounts.items():
            if not isinstance(name, str) or not _RESOURCE_NAME.fullmatch(name):
                return SettingsError(f"{field_name}.{key}", name, "a resource name such as memory or cpu")
            text = str(amount) if isinstance(amount, int) and not isinstance(amount, bool) else amount
            if not isinstance(text, str) or not _QUANTITY.fullmatch(text) or text.startswith("-"):
                return SettingsError(
                    f"{field_name}.{key}.{name}", amount, "a non-negative quantity such as 8Gi or 500m"
                )
    return res


def _apply_policy(base: InjectionSettings, spec: Mapping[str, Any], prefix: str) -> InjectionSettings | SettingsError:
    """``base`` overlaid with a KVCachePolicy ``spec``; ``prefix`` names the policy in messages."""
    updates: dict[str, Any] = {}

    def take(result: object, key: str) -> SettingsError | None:
        if isinstance(result, SettingsError):
            return result
        updates[key] = result
        return None

    checks: list[SettingsError | None] = []
    if "mode" in spec:
        checks.append(take(_choice(spec["mode"], f"{prefix}.mode", MODES), "mode"))
    if "shmSize" in spec:
        checks.append(take(_quantity(spec["shmSize"], f"{prefix}.shmSize"), "shm_bytes"))
    cache = _mapping(spec.get("cache", {}), f"{prefix}.cache")
    if isinstance(cache, SettingsError):
        return cache
    if "l1Size" in cache:
        checks.append(take(_l1_size(cache["l1Size"], f"{prefix}.cache.l1Size"), "l1_bytes"))
    if "evictionPolicy" in cache:
        checks.append(
            take(
                _choice(cache["evictionPolicy"], f"{prefix}.cache.evictionPolicy", EVICTION_POLICIES),
                "eviction_policy",
            )
        )
    if "chunkSize" in cache:
        checks.append(
            take(
                _int(cache["chunkSize"], f"{prefix}.cache.chunkSize", CHUNK_SIZE_MULTIPLE, MAX_CHUNK_SIZE,
                     CHUNK_SIZE_MULTIPLE),
                "chunk_size",
            )
        )  # fmt: skip
    if "maxWorkers" in cache:
        checks.append(take(_int(cache["maxWorkers"], f"{prefix}.cache.maxWorkers", 1, MAX_WORKERS), "max_workers"))
    sidecar = _mapping(spec.get("sidecar", {}), f"{prefix}.sidecar")
    if isinstance(sidecar, SettingsError):
        return sidecar
    if "image" in sidecar:
        checks.append(take(_image(sidecar["image"], f"{prefix}.sidecar.image"), "sidecar_image"))
    if "imagePullPolicy" in sidecar:
        checks.append(take(_choice(sidecar["imagePullPolicy"], f"{prefix}.sidecar.imagePullPolicy",
                                   PULL_POLICIES), "image_pull_policy"))  # fmt: skip
    if "resources" in sidecar:
        res = _resources(sidecar["resources"], f"{prefix}.sidecar.resources")
        if isinstance(res, SettingsError):
            checks.append(res)
        else:
            updates["sidecar_resources"] = dict(res) or None
    if "gpuAccess" in sidecar:
        checks.append(take(_choice(sidecar["gpuAccess"], f"{prefix}.sidecar.gpuAccess", GPU_ACCESS_MODES),
                           "gpu_access"))  # fmt: skip
    if "runtimeClassName" in sidecar:
        rc = sidecar["runtimeClassName"]
        if rc in (None, ""):
            updates["runtime_class_name"] = None
        elif isinstance(rc, str) and _DNS_LABEL.fullmatch(rc):
            updates["runtime_class_name"] = rc
        else:
            checks.append(SettingsError(f"{prefix}.sidecar.runtimeClassName", rc, "a DNS-1123 label or empty"))
    connector = _mapping(spec.get("connector", {}), f"{prefix}.connector")
    if isinstance(connector, SettingsError):
        return connector
    if "bundleImage" in connector:
        checks.append(take(_image(connector["bundleImage"], f"{prefix}.connector.bundleImage"), "bundle_image"))
    if "backend" in connector:
        checks.append(take(_choice(connector["backend"], f"{prefix}.connector.backend", BACKENDS), "backend"))
    if "source" in connector:
        checks.append(
            take(_choice(connector["source"], f"{prefix}.connector.source", CONNECTOR_SOURCES), "connector_source")
        )
    for key, attr in (
        ("lookupTimeoutMs", "lookup_timeout_ms"),
        ("retrieveTimeoutMs", "retrieve_timeout_ms"),
        ("storeTimeoutMs", "store_timeout_ms"),
    ):
        if key in connector:
            checks.append(take(_int(connector[key], f"{prefix}.connector.{key}", 1, MAX_TIMEOUT_MS), attr))
    if "saveDecodeTokens" in connector:
        checks.append(
            take(_bool(connector["saveDecodeTokens"], f"{prefix}.connector.saveDecodeTokens"), "save_decode_tokens")
        )
    l2 = _mapping(spec.get("l2", {}), f"{prefix}.l2")
    if isinstance(l2, SettingsError):
        return l2
    if "fs" in l2:
        fs = _parse_fs(l2["fs"], f"{prefix}.l2.fs")
        checks.append(take(fs, "fs_tier"))
    if "redis" in l2:
        checks.append(take(_parse_redis(l2["redis"], f"{prefix}.l2.redis"), "redis_tier"))
    for check in checks:
        if check is not None:
            return check
    return replace(base, **updates)


def _parse_fs(raw: object, prefix: str) -> FsTier | SettingsError:
    fs = _mapping(raw, prefix)
    if isinstance(fs, SettingsError):
        return fs
    path = fs.get("path")
    if not isinstance(path, str) or not path.startswith("/"):
        return SettingsError(f"{prefix}.path", path, "an absolute path")
    size = _quantity(fs.get("size"), f"{prefix}.size")
    if isinstance(size, SettingsError):
        return size
    return FsTier(path=path, size_bytes=size)


def _parse_redis(raw: object, prefix: str) -> RedisTier | SettingsError:
    redis = _mapping(raw, prefix)
    if isinstance(redis, SettingsError):
        return redis
    url = redis.get("url")
    if not isinstance(url, str) or not _REDIS_URL.fullmatch(url):
        return SettingsError(
            f"{prefix}.url", url, "redis://[user@]host[:port][/0] (LMCache's Redis adapter: plain Redis, database 0)"
        )
    ref = redis.get("passwordSecretRef")
    if ref is None:
        return RedisTier(url=url)
    ref_map = _mapping(ref, f"{prefix}.passwordSecretRef")
    if isinstance(ref_map, SettingsError):
        return ref_map
    name, key = ref_map.get("name"), ref_map.get("key")
    if not isinstance(name, str) or not _DNS_LABEL.fullmatch(name.replace(".", "-")):
        return SettingsError(f"{prefix}.passwordSecretRef.name", name, "a Secret name")
    if not isinstance(key, str) or not key:
        return SettingsError(f"{prefix}.passwordSecretRef.key", key, "a key of that Secret")
    return RedisTier(url=url, password_secret_name=name, password_secret_key=key)


def _apply_annotations(base: InjectionSettings, annotations: Mapping[str, str]) -> InjectionSettings | SettingsError:
    updates: dict[str, Any] = {}
    if c.ANN_CPU_CACHE_SIZE in annotations:
        size = _l1_size(annotations[c.ANN_CPU_CACHE_SIZE], c.ANN_CPU_CACHE_SIZE)
        if isinstance(size, SettingsError):
            return size
        updates["l1_bytes"] = size
    if c.ANN_SHM_SIZE in annotations:
        shm = _quantity(annotations[c.ANN_SHM_SIZE], c.ANN_SHM_SIZE)
        if isinstance(shm, SettingsError):
            return shm
        updates["shm_bytes"] = shm
    for key, attr, allowed in (
        (c.ANN_BACKEND, "backend", BACKENDS),
        (c.ANN_MODE, "mode", MODES),
        (c.ANN_CONNECTOR_SOURCE, "connector_source", CONNECTOR_SOURCES),
    ):
        if key in annotations:
            value = _choice(annotations[key], key, allowed)
            if isinstance(value, SettingsError):
                return value
            updates[attr] = value
    if c.ANN_CONTAINER in annotations:
        name = annotations[c.ANN_CONTAINER]
        if not isinstance(name, str) or not _DNS_LABEL.fullmatch(name):
            return SettingsError(c.ANN_CONTAINER, name, "the name of one container of the pod (a DNS-1123 label)")
        updates["container"] = name
    return replace(base, **updates)


def base_settings(defaults: OperatorDefaults) -> InjectionSettings | SettingsError:
    """The operator's defaults as settings, before any policy or annotation."""
    flags = InjectionSettings(
        policy_name=None,
        mode="sidecar",
        backend=c.BACKEND_SIDECAR,
        connector_source="init-container",
        container=None,
        l1_bytes=defaults.l1_bytes,
        shm_bytes=defaults.shm_bytes,
        eviction_policy=defaults.eviction_policy,
        chunk_size=defaults.chunk_size,
        max_workers=defaults.max_workers,
        sidecar_image=defaults.sidecar_image,
        bundle_image=defaults.bundle_image,
        sidecar_resources=None,
        sidecar_memory_overhead_bytes=defaults.sidecar_memory_overhead_bytes,
        sidecar_cpu_request=defaults.sidecar_cpu_request,
        gpu_access=defaults.gpu_access,
        runtime_class_name=defaults.runtime_class_name,
        lookup_timeout_ms=defaults.lookup_timeout_ms,
        retrieve_timeout_ms=defaults.retrieve_timeout_ms,
        store_timeout_ms=defaults.store_timeout_ms,
        save_decode_tokens=False,
        image_pull_policy=defaults.image_pull_policy,
    )
    if not defaults.spec:
        return flags
    return _apply_policy(flags, defaults.spec, "operator defaults")


def policy_name(annotations: Mapping[str, str] | None) -> str | None | SettingsError:
    """The KVCachePolicy a workload selects with ``kvoffload.io/policy``, if any."""
    raw = (annotations or {}).get(c.ANN_POLICY)
    if raw is None:
        return None
    if not isinstance(raw, str) or not _DNS_LABEL.fullmatch(raw.replace(".", "-")) or len(raw) > 253:
        return SettingsError(c.ANN_POLICY, raw, "the name of a KVCachePolicy in the workload's namespace")
    return raw


def resolve_settings(
    annotations: Mapping[str, str] | None,
    policy: Mapping[str, Any] | None,
    defaults: OperatorDefaults,
    namespace: str = "",
) -> InjectionSettings | SettingsError:
    """Validated settings for an opted-in workload: defaults < policy ``spec`` < annotations.

    ``policy`` is the KVCachePolicy object the workload's ``kvoffload.io/policy`` names, or
    None when it names none or the policy does not exist (then that is the error).
    """
    annotations = annotations or {}
    name = policy_name(annotations)
    if isinstance(name, SettingsError):
        return name
    settings = base_settings(defaults)
    if isinstance(settings, SettingsError):
        return settings
    if name is not None:
        if policy is None:
            where = f" in namespace {namespace}" if namespace else ""
            return SettingsError(
                c.ANN_POLICY, name, f"no KVCachePolicy of that name exists{where}; create it or remove the annotation",
                reason="policy_missing",
            )  # fmt: skip
        spec = policy.get("spec") or {}
        if not isinstance(spec, Mapping):
            return SettingsError(f"KVCachePolicy {name}.spec", spec, "an object")
        overlaid = _apply_policy(settings, spec, f"KVCachePolicy {name}.spec")
        if isinstance(overlaid, SettingsError):
            return overlaid
        settings = replace(overlaid, policy_name=name)
    annotated = _apply_annotations(settings, annotations)
    if isinstance(annotated, SettingsError):
        return annotated
    source = c.ANN_MODE if c.ANN_MODE in annotations else f"KVCachePolicy {name}.spec.mode"
    if annotated.mode == "node":
        # The shared cache pods are owned by (and configured from) one KVCachePolicy.
        if name is None:
            return SettingsError(source, "node", f"mode node needs {c.ANN_POLICY} naming a KVCachePolicy: its "
                                 "cache pods are shared by every workload of that policy")  # fmt: skip
        if annotated.backend != c.BACKEND_SIDECAR:
            where = c.ANN_BACKEND if c.ANN_BACKEND in annotations else f"KVCachePolicy {name}.spec.connector.backend"
            return SettingsError(where, annotated.backend,
                                 "mode node needs backend sidecar (the cache server runs in the node's cache pod)")  # fmt: skip
    return annotated
