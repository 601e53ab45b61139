"""Injection at pod admission, pure, the webhook's side: the record a workload's pods are injected
from (as the operator wrote it, ``plan.injection_record``), and the pod the webhook admits (the user's
pod with the injection merged in, its policy file as a pod annotation, as a JSON patch). The user's
options file is never in the answer: the record keeps its digest, and the pod's init container merges
the file from the user's ConfigMap.
"""

from __future__ import annotations

import base64
import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.intent.managed_fields import owned_by
from kvoffload.operator.intent.settings import enabled_state
from kvoffload.operator.intent.workload import RECORD_PATH, SUPPORTED_KINDS, read_workload
from kvoffload.operator.plan.fragment import render
from kvoffload.operator.plan.injection_plan import CheckedOptions, plan_workload
from kvoffload.operator.plan.injection_record import InjectionRecord, record_digest
from kvoffload.policy_values import PolicyError


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
    plan = plan_workload(workload, record.settings, record.cluster, CheckedOptions(record.user_options_digest),
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
