"""The AdmissionReview the webhook answers, checked strictly at the edge, pure: a pod CREATE (or a
Deployment or StatefulSet CREATE or UPDATE, on the workloads path) in ``admission.k8s.io/v1`` with a
uid to echo, or a one-line reason to refuse the body with."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

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
    return uid, namespace, str(kind_name), pod


def _shown(value: object) -> str:
    """``value`` for a one-line reason, cut short (the reason goes back to whoever sent it); an
    object or a list by its type only (its repr could be as large, or as deep, as the body)."""
    if value is not None and not isinstance(value, (str, int, float)):
        return f"<a JSON {type(value).__name__}>"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."
