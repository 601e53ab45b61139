"""The AdmissionReview the webhook answers, checked strictly at the edge, pure: a pod CREATE (or a
Deployment or StatefulSet CREATE or UPDATE, on the workloads path) in ``admission.k8s.io/v1`` with a
uid to echo, or a one-line reason to refuse the body with."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

REVIEW_API_VERSION = "admission.k8s.io/v1"
MAX_UID_CHARS = 256
"""The apiserver's request uids are UUIDs; the response echoes the uid, so it is bounded."""
_SHOWN_CHARS = 60


@dataclass(frozen=True)
class PodReview:
    """One pod CREATE to answer: the uid the response echoes, the namespace, the pod."""

    uid: str
    namespace: str
    pod: Mapping[str, Any]


@dataclass(frozen=True)
class WorkloadReview:
    """One Deployment or StatefulSet CREATE or UPDATE to answer."""

    uid: str
    namespace: str
    kind: str
    workload: Mapping[str, Any]
    old: Mapping[str, Any] | None = None
    """The object before an UPDATE (None: a CREATE)."""
    field_manager: str = ""
    """The request's ``fieldManager`` option (empty when the client named none)."""


POD_KINDS = frozenset({("", "Pod")})
WORKLOAD_KINDS = frozenset({("apps", "Deployment"), ("apps", "StatefulSet")})


def parse_pod_review(body: bytes) -> PodReview | str:
    """The review in ``body``, or why it is not a pod CREATE this webhook answers."""
    request = _request(body)
    if isinstance(request, str):
        return request
    created = _create(request, POD_KINDS)
    return created if isinstance(created, str) else PodReview(created[0], created[1], created[3])


def parse_workload_review(body: bytes) -> WorkloadReview | str:
    """The review in ``body``, or why it is not a Deployment or StatefulSet CREATE or UPDATE."""
    request = _request(body)
    if isinstance(request, str):
        return request
    operation = request.get("operation")
    if operation != "UPDATE":
        created = _create(request, WORKLOAD_KINDS)
        return created if isinstance(created, str) else WorkloadReview(*created)
    updated = _create({**request, "operation": "CREATE"}, WORKLOAD_KINDS)  # the same checks on the new object
    if isinstance(updated, str):
        return updated
    old, options = request.get("oldObject"), request.get("options")
    if not isinstance(old, dict) or not isinstance(old.get("metadata", {}), dict):
        return f"request.oldObject is {type(old).__name__}, not an object with metadata"
    if (misshapen := misshapen_field(old, WORKLOAD_SHAPE, "request.oldObject")) is not None:
        return misshapen
    manager = options.get("fieldManager", "") if isinstance(options, dict) else ""
    if not isinstance(manager, str):
        return f"request.options.fieldManager {_shown(manager)}: a string is required"
    return WorkloadReview(*updated, old=old, field_manager=manager)


def _request(body: bytes) -> dict[str, Any] | str:
    try:
        review = json.loads(body)
    except RecursionError:
        return "the body nests too deeply to be an AdmissionReview"
    except ValueError as exc:  # UnicodeDecodeError included
        return f"the body is not JSON: {exc}"
    if not isinstance(review, dict):
        return f"the body is a JSON {type(review).__name__}, not an AdmissionReview object"
    if review.get("apiVersion") != REVIEW_API_VERSION or review.get("kind") != "AdmissionReview":
        return (f"apiVersion {_shown(review.get('apiVersion'))} kind {_shown(review.get('kind'))}: "
                f"allowed apiVersion {REVIEW_API_VERSION!r} kind 'AdmissionReview'")  # fmt: skip
    request = review.get("request")
    if not isinstance(request, dict):
        return f"request is {type(request).__name__}, not an object"
    return request


def _create(request: Mapping[str, Any], kinds: frozenset[tuple[str, str]]
            ) -> tuple[str, str, str, Mapping[str, Any]] | str:  # fmt: skip
    """(uid, namespace, kind, object) of a CREATE of one of ``kinds`` ((group, kind) pairs)."""
    uid, namespace, pod = request.get("uid"), request.get("namespace"), request.get("object")
    kind = request.get("kind")
    group, kind_name = (kind.get("group", ""), kind.get("kind")) if isinstance(kind, dict) else (None, kind)
    if not isinstance(uid, str) or not 0 < len(uid) <= MAX_UID_CHARS:
        return f"request.uid {_shown(uid)}: a string of 1 to {MAX_UID_CHARS} characters is required"
    if not isinstance(group, str) or not isinstance(kind_name, str) or (group, kind_name) not in kinds:
        allowed = ", ".join(f"{k} ({g or 'core'})" for g, k in sorted(kinds))
        return f"request.kind group {_shown(group)} kind {_shown(kind_name)}: only {allowed} reviewed here"
    if request.get("operation") != "CREATE":
        return f"request.operation {_shown(request.get('operation'))}: only CREATE is reviewed"
    if not isinstance(namespace, str) or not namespace:
        return f"request.namespace {_shown(namespace)}: a non-empty string is required"
    if not isinstance(pod, dict):
        return f"request.object is {type(pod).__name__}, not an object"
    meta = pod.get("metadata", {})
    if not isinstance(meta, dict):
        return f"request.object.metadata is {type(meta).__name__}, not an object"
    if meta.get("namespace") not in (None, "", namespace):
        return (f"request.object.metadata.namespace {_shown(meta.get('namespace'))} is not "
                f"request.namespace {_shown(namespace)}")  # fmt: skip
    misshapen = misshapen_field(pod, POD_SHAPE if kinds == POD_KINDS else WORKLOAD_SHAPE, "request.object")
    if misshapen is not None:
        return misshapen
    return uid, namespace, str(kind_name), pod


Shape: TypeAlias = type | list["Shape"] | dict[str, "Shape"]
"""What a field must be: a JSON type (``str``, ``bool``, ``dict``), a list of one shape, or an
object whose listed fields have their shapes (``EVERY_KEY``: every value has that shape)."""
EVERY_KEY = "*"
_STRING_MAP: Shape = {EVERY_KEY: str}
_METADATA: Shape = {
    "name": str, "generateName": str, "namespace": str, "uid": str, "labels": _STRING_MAP,
    "annotations": _STRING_MAP,
    "ownerReferences": [{"apiVersion": str, "kind": str, "name": str, "uid": str, "controller": bool}],
    "managedFields": [{"manager": str, "operation": str, "subresource": str, "fieldsType": str, "fieldsV1": dict}],
}  # fmt: skip
_CONTAINER: Shape = {
    "name": str, "image": str, "args": [str], "command": [str], "env": [{"name": str}], "envFrom": [dict],
    "volumeMounts": [{"name": str, "mountPath": str}], "ports": [dict], "resources": dict,
}  # fmt: skip
_POD_SPEC: Shape = {"containers": [_CONTAINER], "initContainers": [_CONTAINER], "volumes": [{"name": str}]}
POD_SHAPE: Shape = {"metadata": _METADATA, "spec": _POD_SPEC}
"""The fields of a pod the webhook's reviewers read, and what each must be."""
WORKLOAD_SHAPE: Shape = {
    "metadata": _METADATA, "spec": {"template": {"metadata": _METADATA, "spec": _POD_SPEC}, "selector": dict},
}  # fmt: skip
"""The fields of a Deployment or StatefulSet the reviewers and the planner read."""
_JSON_NAMES = {str: "a string", bool: "a boolean", dict: "an object", list: "a list"}


def misshapen_field(value: object, shape: Shape, where: str) -> str | None:
    """Why ``value`` (at ``where``) does not have ``shape``, naming the first field that does not;
    None when it does. An absent or null object field is left to the readers' defaults; an item of
    a list or a value of a map must be there."""
    if isinstance(shape, type):
        return None if isinstance(value, shape) else f"{where} is {_shown(value)}: {_JSON_NAMES[shape]} is required"
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f"{where} is {_shown(value)}: a list is required"
        for i, item in enumerate(value):
            if (reason := misshapen_field(item, shape[0], f"{where}[{i}]")) is not None:
                return reason
        return None
    if not isinstance(value, dict):
        return f"{where} is {_shown(value)}: an object is required"
    if EVERY_KEY in shape:
        fields = [(f"{where}[{_shown(key)}]", item, shape[EVERY_KEY]) for key, item in value.items()]
    else:
        fields = [(f"{where}.{key}", value[key], inner) for key, inner in shape.items() if value.get(key) is not None]
    for field_where, item, inner in fields:
        if (reason := misshapen_field(item, inner, field_where)) is not None:
            return reason
    return None


def _shown(value: object) -> str:
    """``value`` for a one-line reason, cut short (the reason goes back to whoever sent it); an
    object or a list by its type only (its repr could be as large, or as deep, as the body)."""
    if value is not None and not isinstance(value, (str, int, float)):
        return f"<a JSON {type(value).__name__}>"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."
