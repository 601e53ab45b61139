"""The KVCachePolicy: its typed form, defaults, its fields and the one validator every component uses.

The operator lays a policy ``spec`` (and its own flags, as a spec) over :class:`Policy`'s
defaults; the sidecar reads the policy file the operator writes (``Policy.document()``) and
its env through the same field readers; the connector reads its env through them too. So a
value the CRD admits is a value every component accepts: the CRD's schema is checked against
:data:`FIELDS` by a test, and a property test drives CRD-valid specs through all three.

Validation never raises: a reader (:mod:`kvoffload.policy_values`) returns the value or a
:class:`PolicyError` naming the field, the bad value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from kvoffload import contract as c
from kvoffload.policy_values import (
    BACKENDS,
    CHUNK_SIZE_MULTIPLE,
    CONNECTOR_SOURCES,
    EVICTION_POLICIES,
    GPU_ACCESS_MODES,
    KV_EVENTS_FORMATS,
    MAX_CHUNK_SIZE,
    MAX_TIMEOUT_MS,
    MAX_WORKERS,
    MIN_CHUNK_SIZE,
    MIN_TIMEOUT_MS,
    MIN_WORKERS,
    MODES,
    PULL_POLICIES,
    WORKLOAD_DEPENDENT,
    FsTier,
    PolicyError,
    PolicyField,
    RedisTier,
    read_bool,
    read_choice,
    read_fields,
    read_fs_tier,
    read_image,
    read_int,
    read_kv_events_topic,
    read_mapping,
    read_quantity,
    read_redis_tier,
    read_resources,
    read_runtime_class,
)
from kvoffload.quantity import format_bytes


@dataclass(frozen=True)
class Policy:
    """One effective policy: every field of a KVCachePolicy ``spec``, defaults filled in."""

    mode: str = "sidecar"
    shm_bytes: int = 8 * 2**30
    l1_bytes: int = 20 * 2**30
    eviction_policy: str = "LRU"
    chunk_size: int = 256
    max_workers: int = 4
    fs_tier: FsTier | None = None
    redis_tier: RedisTier | None = None
    sidecar_image: str = "ghcr.io/kvoffload/sidecar:0.1.0"
    image_pull_policy: str = "IfNotPresent"
    sidecar_resources: Mapping[str, Any] | None = None
    gpu_access: str = "none"
    """The sidecar's data path (shared-memory L1) needs no GPU; nvidia-runtime is for CUDA-IPC transfer."""
    runtime_class_name: str | None = None
    bundle_image: str = "ghcr.io/kvoffload/connector-bundle:0.1.0"
    backend: str = c.BACKEND_SIDECAR
    connector_source: str = "init-container"
    lookup_timeout_ms: int = 100
    retrieve_timeout_ms: int = 5000
    store_timeout_ms: int = 5000
    save_decode_tokens: bool = False
    kv_events: bool = False
    """The cache server publishes KV events for routers (on ``contract.KV_EVENTS_PORT``) and the
    connector reports its stores to it. Off by default: the events carry prompt token ids, unauthenticated,
    to anyone on the pod network who subscribes (docs/routing.md)."""
    kv_events_topic: str = ""
    kv_events_format: str = KV_EVENTS_FORMATS[0]
    """The events' wire format (``kvEvents.format``): vLLM >= 0.24's maps, or ``vllm-positional``."""

    def document(self) -> dict[str, Any]:
        """The policy as a CRD ``spec`` (camelCase): what the sidecar reads as policy.json."""
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
            redis: dict[str, Any] = (
                {"url": self.redis_tier.url}
                if self.redis_tier.url is not None
                else {"urlSecretRef": {"name": self.redis_tier.url_secret_name, "key": self.redis_tier.url_secret_key}}
            )
            if self.redis_tier.password_secret_name:
                redis["passwordSecretRef"] = {
                    "name": self.redis_tier.password_secret_name,
                    "key": self.redis_tier.password_secret_key,
                }
            l2["redis"] = redis
        if l2:
            doc["l2"] = l2
        if self.kv_events:  # only when on: a policy without events renders byte for byte as before
            doc["kvEvents"] = {"enabled": True, "topic": self.kv_events_topic}
            if self.kv_events_format != KV_EVENTS_FORMATS[0]:
                doc["kvEvents"]["format"] = self.kv_events_format
        return doc


FIELDS: tuple[PolicyField, ...] = (
    PolicyField(("mode",), "mode", read_choice(MODES)),
    PolicyField(("shmSize",), "shm_bytes", read_quantity()),
    PolicyField(("cache", "l1Size"), "l1_bytes", read_quantity(minimum=c.MIN_L1_SIZE)),
    PolicyField(("cache", "evictionPolicy"), "eviction_policy", read_choice(EVICTION_POLICIES)),
    PolicyField(("cache", "chunkSize"), "chunk_size", read_int(MIN_CHUNK_SIZE, MAX_CHUNK_SIZE, CHUNK_SIZE_MULTIPLE)),
    PolicyField(("cache", "maxWorkers"), "max_workers", read_int(MIN_WORKERS, MAX_WORKERS)),
    PolicyField(("l2", "fs"), "fs_tier", read_fs_tier),
    PolicyField(("l2", "redis"), "redis_tier", read_redis_tier),
    PolicyField(("sidecar", "image"), "sidecar_image", read_image),
    PolicyField(("sidecar", "imagePullPolicy"), "image_pull_policy", read_choice(PULL_POLICIES)),
    PolicyField(("sidecar", "resources"), "sidecar_resources", read_resources),
    PolicyField(("sidecar", "gpuAccess"), "gpu_access", read_choice(GPU_ACCESS_MODES)),
    PolicyField(("sidecar", "runtimeClassName"), "runtime_class_name", read_runtime_class),
    PolicyField(("connector", "bundleImage"), "bundle_image", read_image),
    PolicyField(("connector", "backend"), "backend", read_choice(BACKENDS)),
    PolicyField(("connector", "source"), "connector_source", read_choice(CONNECTOR_SOURCES)),
    PolicyField(("connector", "lookupTimeoutMs"), "lookup_timeout_ms", read_int(MIN_TIMEOUT_MS, MAX_TIMEOUT_MS)),
    PolicyField(("connector", "retrieveTimeoutMs"), "retrieve_timeout_ms", read_int(MIN_TIMEOUT_MS, MAX_TIMEOUT_MS)),
    PolicyField(("connector", "storeTimeoutMs"), "store_timeout_ms", read_int(MIN_TIMEOUT_MS, MAX_TIMEOUT_MS)),
    PolicyField(("connector", "saveDecodeTokens"), "save_decode_tokens", read_bool),
    PolicyField(("kvEvents", "enabled"), "kv_events", read_bool),
    PolicyField(("kvEvents", "topic"), "kv_events_topic", read_kv_events_topic),
    PolicyField(("kvEvents", "format"), "kv_events_format", read_choice(KV_EVENTS_FORMATS)),
)
"""Every field a KVCachePolicy ``spec`` may set (the CRD's properties, checked by a test)."""
SECTIONS = ("cache", "l2", "sidecar", "connector", "kvEvents")
"""The object-valued top-level keys of a ``spec``."""

P = TypeVar("P", bound=Policy)


def parse_policy(spec: object, base: P, where: str) -> P | PolicyError:
    """``base`` with the fields ``spec`` sets laid over it; ``where`` names the spec in messages.

    Works for any :class:`Policy` subclass (the operator's per-workload settings extend it).
    """
    root = read_mapping(spec, where)
    if isinstance(root, PolicyError):
        return root
    updates = read_fields(root, SECTIONS, FIELDS, where)
    if isinstance(updates, PolicyError):
        return updates
    problem = spec_rule_problem(updates, where)
    return problem or replace(base, **updates)


def merged_rule_problem(policy: Policy, where: str) -> PolicyError | None:
    """The CRD's rules between fields, on a policy merged over defaults the apiserver cannot see."""
    if policy.lookup_timeout_ms > policy.retrieve_timeout_ms:
        return PolicyError(f"{where}.connector.lookupTimeoutMs", policy.lookup_timeout_ms,
                           f"at most retrieveTimeoutMs ({policy.retrieve_timeout_ms}, with the operator's "
                           "defaults): a lookup waits within a load's time", reason=WORKLOAD_DEPENDENT)  # fmt: skip
    if policy.kv_events and policy.backend != c.BACKEND_SIDECAR:
        return PolicyError(f"{where}.kvEvents.enabled", True,
                           f"needs connector.backend {c.BACKEND_SIDECAR} (backend {policy.backend} runs no cache "
                           "server to publish them, with the operator's defaults)", reason=WORKLOAD_DEPENDENT)  # fmt: skip
    return None


def spec_rule_problem(values: Mapping[str, Any], where: str) -> PolicyError | None:
    """The rules between fields of one spec, exactly the CRD's CEL rules, on the fields it sets
    (read, by attribute)."""
    backend = values.get("backend")
    if values.get("mode") == "node" and backend not in (None, c.BACKEND_SIDECAR):
        return PolicyError(f"{where}.connector.backend", backend,
                           "mode node needs backend sidecar (the cache server runs in the node's cache pod)")  # fmt: skip
    if values.get("kv_events") is True and backend not in (None, c.BACKEND_SIDECAR):
        return PolicyError(f"{where}.connector.backend", backend,
                           "kvEvents.enabled needs backend sidecar (backend inprocess runs no cache server to publish them)")  # fmt: skip
    lookup, retrieve = values.get("lookup_timeout_ms"), values.get("retrieve_timeout_ms")
    if lookup is not None and retrieve is not None and lookup > retrieve:
        return PolicyError(f"{where}.connector.lookupTimeoutMs", lookup,
                           f"at most retrieveTimeoutMs ({retrieve}): a lookup waits within a load's time")  # fmt: skip
    return None
