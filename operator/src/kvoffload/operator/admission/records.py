"""Injection at pod admission, pure: the record a workload's pods are injected from, what the
operator writes for it (one apply of the workload: the record as an annotation and one template
label naming its hash), and the pod the webhook admits (the user's pod with the injection merged
in, its files as pod annotations, as a JSON patch).

The workload's template stays the user's: a GitOps tool that applies its manifest, by any apply,
finds nothing to fight over. The record holds what the operator decided (settings, the user's
options file, node wiring); the pod-level parts that depend on the template (args, env, mounts)
are rendered from the pod itself at admission, so a template change rolls once, through the
webhook, with the right injection.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.intent.managed_fields import owned_by
from kvoffload.operator.intent.settings import InjectionSettings, enabled_state
from kvoffload.operator.intent.workload import RECORD_PATH, SUPPORTED_KINDS, Workload, read_workload
from kvoffload.operator.plan.drift import object_carries
from kvoffload.operator.plan.fragment import RenderedInjection, render
from kvoffload.operator.plan.injection_plan import (
    ClusterInfo,
    InjectionPlan,
    choose_engine,
    plan_injection,
)
from kvoffload.operator.plan.node_wiring import NodeCacheWiring
from kvoffload.policy_values import PolicyError


@dataclass(frozen=True)
class InjectionRecord:
    """What the operator decided for one workload: enough to inject any of its pods."""

    settings: InjectionSettings
    user_options_yaml: str | None
    node_cache: NodeCacheWiring | None
    operator_version: str
    native_sidecars: bool

    def to_json(self) -> str:
        wiring = None
        if self.node_cache is not None:
            wiring = {"server_url": self.node_cache.server_url, "shm_host_path": self.node_cache.shm_host_path,
                      "pod_labels": dict(self.node_cache.pod_labels)}  # fmt: skip
        document = {"settings": self.settings.as_record(), "user_options_yaml": self.user_options_yaml,
                    "node_cache": wiring, "operator_version": self.operator_version,
                    "native_sidecars": self.native_sidecars}  # fmt: skip
        return json.dumps(document, sort_keys=True, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> InjectionRecord | str:
        """The record, or why the text is not one (a one-line reason)."""
        try:
            doc = json.loads(text)
            wiring = doc.get("node_cache")
            return cls(
                settings=InjectionSettings.from_record(doc["settings"]),
                user_options_yaml=doc.get("user_options_yaml"),
                node_cache=NodeCacheWiring(**wiring) if wiring else None,
                operator_version=str(doc["operator_version"]),
                native_sidecars=bool(doc["native_sidecars"]),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            return f"the injection record is not readable: {type(exc).__name__}: {exc}"

    @property
    def cluster(self) -> ClusterInfo:
        return ClusterInfo(native_sidecars=self.native_sidecars, operator_version=self.operator_version)


SELECTOR_PATH = ("f:spec", "f:selector")
"""A field no write of kvoffload's ever sets: held by its field manager, a whole manifest was applied
under kvoffload's name."""


def foreign_record(workload: Workload) -> PolicyError | None:
    """Why what kvoffload's field manager holds on ``workload`` is not what kvoffload wrote: an
    injection record that does not read as one, or the workload's selector (a manifest applied under
    kvoffload's name). None when nothing says so. Such a workload is left alone, with one Warning: a
    removal would delete the forger's fields (the apiserver refuses a Deployment without its selector,
    again at every retry) and an apply would fail the same way."""
    text = workload.annotations.get(c.ANN_INJECTION_RECORD)
    if text is not None and workload.owns_record:
        parsed = InjectionRecord.from_json(text)
        if isinstance(parsed, str):
            return _left_alone(text, parsed)
    if owned_by(workload.live, SELECTOR_PATH, c.FIELD_MANAGER):
        return _left_alone(text, f"field manager {c.FIELD_MANAGER} holds spec.selector, which kvoffload never "
                                 "writes: the workload was applied under kvoffload's name")  # fmt: skip
    return None


def _left_alone(text: str | None, why: str) -> PolicyError:
    shown = text if text is None or len(text) <= 60 else text[:60] + "..."
    return PolicyError(
        f"metadata.annotations[{c.ANN_INJECTION_RECORD}]", shown,
        f"kvoffload did not write this ({why}); kvoffload leaves the workload alone until the annotation is "
        f"removed and the workload is applied under a field manager of its own, not {c.FIELD_MANAGER}",
        reason="foreign_record",
    )  # fmt: skip


def record_of(plan: InjectionPlan) -> InjectionRecord:
    return InjectionRecord(
        settings=plan.settings, user_options_yaml=plan.user_options_yaml, node_cache=plan.node_cache,
        operator_version=plan.cluster.operator_version, native_sidecars=plan.cluster.native_sidecars,
    )  # fmt: skip


def render_admission(plan: InjectionPlan) -> RenderedInjection:
    """What the operator applies in admission mode, one write: the record as an annotation of the
    workload and the template label naming the hash of the record and the files it gives the pods."""
    in_template = render(plan, files_on_pod=True)  # its warnings, and the files the pods get
    record = record_of(plan).to_json()
    digest = record_digest(in_template.files, record)
    body = plan.workload.ref.apply_body()
    body["metadata"]["annotations"] = {c.ANN_INJECTION_RECORD: record}
    body["spec"] = {"template": {"metadata": {"labels": {c.LABEL_INJECT: digest}}}}
    return RenderedInjection(
        workload_apply=body, configmap_apply=None, files=in_template.files, config_hash=digest,
        engine_container=in_template.engine_container, forceable_fields=ADMISSION_FORCEABLE,
        warnings=in_template.warnings,
    )  # fmt: skip


ADMISSION_FORCEABLE = (f".metadata.annotations.{c.ANN_INJECTION_RECORD}",
                       f".spec.template.metadata.labels.{c.LABEL_INJECT}")  # fmt: skip
"""kvoffload's own keys, taken back when another manager holds them. A write through the webhook
keeps them kvoffload's (``workload_updates``); one admitted while the webhook was not reached (say
``kubectl rollout undo`` writing an older record and label back as ``kubectl-rollout``) is answered
by the operator re-applying its current record (one more rollout) instead of leaving pods the
webhook refuses."""


def intent_in_place(workload: Workload, rendered: RenderedInjection) -> bool:
    """Whether the workload already carries the record and label an apply would write, both held
    by kvoffload's field manager: the apply would change nothing, so it is not sent."""
    return workload.holds_admission_keys and object_carries(rendered.workload_apply, workload.live)


def record_digest(files: Mapping[str, str], record_json: str) -> str:
    """The hash naming a record and the files it gives the pods (``LABEL_INJECT``'s value)."""
    return hashlib.sha256(json.dumps({**files, _RECORD_KEY: record_json}, sort_keys=True).encode()).hexdigest()[:16]


_RECORD_KEY = "injection.json"
"""The record's key beside the files in the hash (the key the ConfigMap of earlier versions used:
an upgrade rolls no pods for the move alone)."""


def render_for(plan: InjectionPlan) -> RenderedInjection:
    """The apply bodies for the operator's injection mode."""
    return render_admission(plan) if plan.cluster.injection == "admission" else render(plan)


# --- the webhook's side ------------------------------------------------------------


def record_from_workload(workload: Mapping[str, Any] | None, kind: str, name: str) -> InjectionRecord | str:
    """The record the operator wrote on a workload, or why there is none to use."""
    if workload is None:
        return f"{kind} {name} is not there"
    if enabled_state((workload.get("metadata") or {}).get("annotations")) is not True:
        return f'{kind} {name} is not opted in ({c.ANN_ENABLED} is not "true")'
    text = ((workload.get("metadata") or {}).get("annotations") or {}).get(c.ANN_INJECTION_RECORD)
    if text is None:
        return f"the operator has not injected {kind} {name} yet (no {c.ANN_INJECTION_RECORD} annotation)"
    if not owned_by(workload, RECORD_PATH, c.FIELD_MANAGER):
        return f"{kind} {name}: its {c.ANN_INJECTION_RECORD} annotation was not written by kvoffload"
    return InjectionRecord.from_json(text)


def workload_of_pod(pod: Mapping[str, Any], kind: str, name: str, namespace: str) -> dict[str, Any]:
    """The pod as the template of its workload (no managedFields: every field is the user's)."""
    meta = pod.get("metadata") or {}
    template_meta = {k: copy.deepcopy(meta[k]) for k in ("labels", "annotations") if meta.get(k)}
    return {
        "apiVersion": SUPPORTED_KINDS[kind], "kind": kind, "metadata": {"name": name, "namespace": namespace},
        "spec": {"template": {"metadata": template_meta, "spec": copy.deepcopy(pod.get("spec") or {})}},
    }  # fmt: skip


def injected_pod(pod: Mapping[str, Any], kind: str, name: str, namespace: str, record: InjectionRecord
                 ) -> dict[str, Any] | PolicyError:  # fmt: skip
    """The pod with the injection the record describes, rendered from the pod itself."""
    workload = read_workload(workload_of_pod(pod, kind, name, namespace))
    engine = choose_engine(workload, record.settings)
    if isinstance(engine, PolicyError):
        return engine
    plan = plan_injection(workload, record.settings, record.cluster, engine, record.user_options_yaml,
                          record.node_cache)  # fmt: skip
    if isinstance(plan, PolicyError):
        return plan
    rendered = render(plan, files_on_pod=True)
    template = rendered.workload_apply["spec"]["template"]
    result = copy.deepcopy(dict(pod))
    meta = result.setdefault("metadata", {})
    for part in ("labels", "annotations"):
        merged = {**(meta.get(part) or {}), **(template.get("metadata") or {}).get(part, {})}
        if merged:
            meta[part] = merged
    meta.setdefault("annotations", {})[c.ANN_INJECTED_FROM] = record_digest(rendered.files, record.to_json())
    result["spec"] = merge_pod_spec(result.get("spec") or {}, template["spec"])
    return result


_LIST_KEYS: Mapping[str, tuple[str, ...]] = {
    "containers": ("name",), "initContainers": ("name",), "volumes": ("name",), "env": ("name",),
    "volumeMounts": ("mountPath",), "ports": ("containerPort", "protocol"),
}  # fmt: skip
"""Lists merged item by item, on the keys Server-Side Apply merges them by; other values are replaced."""


def _identity(item: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[Any, ...]:
    """An item's merge key (a port's protocol defaults to TCP, as the apiserver defaults it)."""
    return tuple(item.get(k, "TCP" if k == "protocol" else None) for k in keys)


def _merge_list(current: Sequence[Any], additions: Sequence[Any], keys: tuple[str, ...], depth: int) -> list[Any]:
    merged = [copy.deepcopy(x) for x in current]
    for item in additions:
        ident = _identity(item, keys)
        at = next((i for i, x in enumerate(merged) if _identity(x, keys) == ident), None)
        if at is None:
            merged.append(copy.deepcopy(item))
        else:
            merged[at] = _merge_map(merged[at], item, depth + 1)
    return merged


def _merge_map(current: Mapping[str, Any], fragment: Mapping[str, Any], depth: int = 0) -> dict[str, Any]:
    merged = copy.deepcopy(dict(current))
    for key, value in fragment.items():
        if key in _LIST_KEYS and isinstance(value, list) and depth < 2:
            merged[key] = _merge_list(merged.get(key) or [], value, _LIST_KEYS[key], depth)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def merge_pod_spec(spec: Mapping[str, Any], fragment: Mapping[str, Any]) -> dict[str, Any]:
    """``fragment`` merged into a pod spec the way Server-Side Apply merges it into a template."""
    return _merge_map(spec, fragment)


def json_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[dict[str, Any]]:
    """RFC 6902 operations turning ``old`` into ``new`` (labels, annotations, top-level spec fields)."""
    ops: list[dict[str, Any]] = []
    old_meta, new_meta = old.get("metadata") or {}, new.get("metadata") or {}
    for part in ("labels", "annotations"):
        if new_meta.get(part) != old_meta.get(part):
            ops.append({"op": "add", "path": f"/metadata/{part}", "value": new_meta.get(part) or {}})
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    for key in sorted(new_spec):
        if new_spec[key] != old_spec.get(key):
            ops.append({"op": "add", "path": f"/spec/{key}", "value": new_spec[key]})
    return ops


@dataclass(frozen=True)
class Admission:
    """The webhook's answer for one pod."""

    patch: list[dict[str, Any]]
    warnings: tuple[str, ...]
    result: str
    """``injected``, ``ignored`` (not an opted-in workload's pod, or already injected), ``not_injected``."""


def admission_response(uid: str, admission: Admission) -> dict[str, Any]:
    """The AdmissionReview the apiserver gets back: always allowed (a pod without the injection is
    the user's own pod, which starts; the operator brings it in line later)."""
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if admission.patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(admission.patch).encode()).decode()
    if admission.warnings:
        response["warnings"] = list(admission.warnings)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response}


def admit(pod: Mapping[str, Any], namespace: str, record: InjectionRecord | str | None,
          owner: tuple[str, str] | str) -> Admission:  # fmt: skip
    """What to do with one pod at creation, given its owner (or why it has none the API confirms)
    and that owner's record (or why none)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if c.LABEL_INJECT not in labels or labels.get(c.LABEL_INJECTED) == "true":
        return Admission([], (), "ignored")
    if isinstance(owner, str):
        return Admission([], (f"kvoffload: not injected: {owner}",), "ignored")
    kind, name = owner
    if not isinstance(record, InjectionRecord):
        return Admission([], (f"kvoffload: {kind} {name}: not injected: {record}",), "not_injected")
    new = injected_pod(pod, kind, name, namespace, record)
    if isinstance(new, PolicyError):
        return Admission([], (f"kvoffload: {kind} {name}: not injected: {new.message}",), "not_injected")
    return Admission(json_patch(pod, new), (), "injected")
