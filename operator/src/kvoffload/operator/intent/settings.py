"""Raw workload annotations + KVCachePolicy spec + operator defaults -> validated settings.

Everything that reaches the fragment renderer has been parsed here once; the rest of the
operator never sees a raw annotation string. Problems come back as a :class:`~kvoffload.policy.PolicyError`
value naming the field, the bad value and what is allowed, never as an exception.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from kvoffload import contract as c
from kvoffload import policy as pol
from kvoffload import policy_values as polv
from kvoffload.policy import Policy, parse_policy
from kvoffload.policy_values import FsTier, PolicyError, RedisTier
from kvoffload.quantity import format_bytes

ENABLED_VALUES = ("true", "false")


@dataclass(frozen=True)
class OperatorDefaults:
    """What applies when neither a policy nor an annotation says otherwise (Helm values, flags)."""

    sidecar_image: str = Policy.sidecar_image
    bundle_image: str = Policy.bundle_image
    l1_bytes: int = Policy.l1_bytes
    shm_bytes: int = Policy.shm_bytes
    eviction_policy: str = Policy.eviction_policy
    chunk_size: int = Policy.chunk_size
    max_workers: int = Policy.max_workers
    gpu_access: str = Policy.gpu_access
    runtime_class_name: str | None = None
    sidecar_memory_overhead_bytes: int = 2 * 2**30
    sidecar_cpu_request: str = "1"
    lookup_timeout_ms: int = Policy.lookup_timeout_ms
    retrieve_timeout_ms: int = Policy.retrieve_timeout_ms
    store_timeout_ms: int = Policy.store_timeout_ms
    image_pull_policy: str = Policy.image_pull_policy
    spec: Mapping[str, Any] = field(default_factory=dict)
    """A KVCachePolicy-shaped ``spec`` (the Helm ``defaults`` value) laid over the fields above."""

    def as_spec(self) -> dict[str, Any]:
        """The flags as a KVCachePolicy ``spec``, so they pass the same validator as a policy."""
        connector = {"lookupTimeoutMs": self.lookup_timeout_ms, "retrieveTimeoutMs": self.retrieve_timeout_ms,
                     "storeTimeoutMs": self.store_timeout_ms, "bundleImage": self.bundle_image}  # fmt: skip
        sidecar: dict[str, Any] = {"image": self.sidecar_image, "imagePullPolicy": self.image_pull_policy,
                                   "gpuAccess": self.gpu_access, "runtimeClassName": self.runtime_class_name or ""}  # fmt: skip
        cache = {"l1Size": format_bytes(self.l1_bytes), "evictionPolicy": self.eviction_policy,
                 "chunkSize": self.chunk_size, "maxWorkers": self.max_workers}  # fmt: skip
        return {"shmSize": format_bytes(self.shm_bytes), "cache": cache, "sidecar": sidecar, "connector": connector}


FIELDS_LEFT_OUT_AT_DEFAULT = ("kv_events", "kv_events_topic", "kv_events_format")
"""Fields added after injection records were first written: a record leaves them out at their
defaults (``from_record`` fills them in), so the record of a workload that does not use them, and
the pod-template label hashing it in admission mode, stay what an earlier operator wrote: an
upgrade rolls no pod for them."""


@dataclass(frozen=True)
class InjectionSettings(Policy):
    """Everything the renderer needs for one workload, validated: the effective policy and the workload's own."""

    policy_name: str | None = None
    container: str | None = None
    sidecar_memory_overhead_bytes: int = OperatorDefaults.sidecar_memory_overhead_bytes
    sidecar_cpu_request: str = OperatorDefaults.sidecar_cpu_request

    def policy_document(self) -> dict[str, Any]:
        """The effective policy ``spec`` (camelCase, as in the CRD) the sidecar reads as policy.json."""
        return self.document()

    def as_record(self) -> dict[str, Any]:
        """Every field as JSON-ready data (the injection record the webhook renders pods from)."""
        record = asdict(self)
        for name in FIELDS_LEFT_OUT_AT_DEFAULT:
            if record[name] == getattr(Policy, name):
                del record[name]
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> InjectionSettings:
        """The settings :meth:`as_record` wrote; fields it does not name keep their defaults."""
        values = {f.name: record[f.name] for f in fields(cls) if f.name in record}
        if values.get("fs_tier"):
            values["fs_tier"] = FsTier(**values["fs_tier"])
        if values.get("redis_tier"):
            values["redis_tier"] = RedisTier(**values["redis_tier"])
        return cls(**values)


def enabled_state(annotations: Mapping[str, str] | None) -> bool | PolicyError:
    """Whether ``kvoffload.io/enabled`` opts the workload in; absent means no."""
    raw = (annotations or {}).get(c.ANN_ENABLED)
    if raw is None:
        return False
    if raw not in ENABLED_VALUES:  # exactly: "TRUE" or " true " would be a silent reading of a typo
        return PolicyError(c.ANN_ENABLED, raw, 'allowed: "true" or "false"')
    return raw == "true"


_ANNOTATION_READERS: tuple[tuple[str, str, Any], ...] = (
    (c.ANN_CPU_CACHE_SIZE, "l1_bytes", polv.read_quantity(minimum=c.MIN_L1_SIZE)),
    (c.ANN_SHM_SIZE, "shm_bytes", polv.read_quantity()),
    (c.ANN_BACKEND, "backend", polv.read_choice(polv.BACKENDS)),
    (c.ANN_MODE, "mode", polv.read_choice(polv.MODES)),
    (c.ANN_CONNECTOR_SOURCE, "connector_source", polv.read_choice(polv.CONNECTOR_SOURCES)),
)
"""Annotations that override one policy field each, read by the policy's own field readers."""


def _apply_annotations(base: InjectionSettings, annotations: Mapping[str, str]) -> InjectionSettings | PolicyError:
    updates: dict[str, Any] = {}
    for key, attr, read in _ANNOTATION_READERS:
        if key in annotations:
            value = read(annotations[key], key)
            if isinstance(value, PolicyError):
                return value
            updates[attr] = value
    if c.ANN_CONTAINER in annotations:
        name = annotations[c.ANN_CONTAINER]
        if not isinstance(name, str) or not polv.DNS_LABEL.fullmatch(name):
            return PolicyError(c.ANN_CONTAINER, name, "the name of one container of the pod (a DNS-1123 label)")
        updates["container"] = name
    return replace(base, **updates)


def base_settings(defaults: OperatorDefaults) -> InjectionSettings | PolicyError:
    """The operator's defaults as settings, before any policy or annotation.

    The flags are a spec laid over :class:`Policy`'s defaults, then the Helm ``defaults`` spec
    over them: both through the policy's one validator, so a bad flag is refused at start.
    """
    start = InjectionSettings(sidecar_memory_overhead_bytes=defaults.sidecar_memory_overhead_bytes,
                              sidecar_cpu_request=defaults.sidecar_cpu_request)  # fmt: skip
    flags = parse_policy(defaults.as_spec(), start, "operator flags")
    if isinstance(flags, PolicyError) or not defaults.spec:
        return flags
    return parse_policy(defaults.spec, flags, "operator defaults")


def policy_name(annotations: Mapping[str, str] | None) -> str | None | PolicyError:
    """The KVCachePolicy a workload selects with ``kvoffload.io/policy``, if any."""
    raw = (annotations or {}).get(c.ANN_POLICY)
    if raw is None:
        return None
    if not isinstance(raw, str) or not polv.DNS_LABEL.fullmatch(raw.replace(".", "-")) or len(raw) > 253:
        return PolicyError(c.ANN_POLICY, raw, "the name of a KVCachePolicy in the workload's namespace")
    return raw


def _with_policy(
    settings: InjectionSettings, name: str, policy: Mapping[str, Any] | None, namespace: str
) -> InjectionSettings | PolicyError:
    if policy is None:
        where = f" in namespace {namespace}" if namespace else ""
        return PolicyError(
            c.ANN_POLICY, name, f"no KVCachePolicy of that name exists{where}; create it or remove the annotation",
            reason="policy_missing",
        )  # fmt: skip
    where = f"KVCachePolicy {name}.spec"
    overlaid = parse_policy(policy.get("spec") or {}, settings, where)
    if isinstance(overlaid, PolicyError):
        return overlaid
    return pol.merged_rule_problem(overlaid, where) or replace(overlaid, policy_name=name)


def _node_mode_problem(settings: InjectionSettings, annotations: Mapping[str, str]) -> PolicyError | None:
    name = settings.policy_name
    source = c.ANN_MODE if c.ANN_MODE in annotations else f"KVCachePolicy {name}.spec.mode"
    if settings.mode != "node":
        return None
    # The shared cache pods are owned by (and configured from) one KVCachePolicy.
    if name is None:
        return PolicyError(source, "node", f"mode node needs {c.ANN_POLICY} naming a KVCachePolicy: its "
                           "cache pods are shared by every workload of that policy")  # fmt: skip
    if settings.backend != c.BACKEND_SIDECAR:
        where = c.ANN_BACKEND if c.ANN_BACKEND in annotations else f"KVCachePolicy {name}.spec.connector.backend"
        return PolicyError(where, settings.backend,
                           "mode node needs backend sidecar (the cache server runs in the node's cache pod)")  # fmt: skip
    return None


def resolve_settings(
    annotations: Mapping[str, str] | None,
    policy: Mapping[str, Any] | None,
    defaults: OperatorDefaults,
    namespace: str = "",
) -> InjectionSettings | PolicyError:
    """Validated settings for an opted-in workload: defaults < policy ``spec`` < annotations.

    ``policy`` is the KVCachePolicy object the workload's ``kvoffload.io/policy`` names, or
    None when it names none or the policy does not exist (then that is the error).
    """
    annotations = annotations or {}
    name = policy_name(annotations)
    if isinstance(name, PolicyError):
        return name
    settings = base_settings(defaults)
    if name is not None and not isinstance(settings, PolicyError):
        settings = _with_policy(settings, name, policy, namespace)
    if isinstance(settings, PolicyError):
        return settings
    annotated = _apply_annotations(settings, annotations)
    if isinstance(annotated, PolicyError):
        return annotated
    return _node_mode_problem(annotated, annotations) or annotated


def ours_annotations_digest(annotations: Mapping[str, str]) -> str:
    """A digest of the ``kvoffload.io/*`` annotations: a workload's opt-in inputs besides its spec."""
    relevant = {k: v for k, v in annotations.items() if k.startswith(c.ANNOTATION_PREFIX)}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]
