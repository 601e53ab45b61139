"""kopf glue: watch events in, ``Reconciler`` (or, admission mode, the pod alignment in ``memo``)
calls out; the periodic work is ``background``'s. Nothing else.

Only ``@kopf.on.event`` handlers: they are stateless, so kopf stores no progress, diff-base or
finalizer on user workloads. Every event (including the initial listing after a restart)
reconciles the object as it is now, which is what makes a killed operator converge.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import kopf

from kvoffload import contract as c
from kvoffload.operator.control.background import start_background
from kvoffload.operator.control.reconcile import Reconciler


def _plain(body: Mapping[str, Any]) -> dict[str, Any]:
    return copy.deepcopy({k: body[k] for k in body})


def _reconciler(memo: Any) -> Reconciler:
    return memo.reconciler


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    # We post our own Events; kopf must not turn log lines into Events on user objects.
    settings.posting.enabled = False
    # Our resources are fixed: no need to list or watch CRDs and namespaces to discover them
    # (which also keeps the RBAC rules free of apiextensions access).
    settings.scanning.disabled = True
    # Never used by on.event handlers, but if a handler type ever needs storage it must not
    # land under kopf's default keys on user workloads.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="operator.kvoffload.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="operator.kvoffload.io")
    settings.execution.max_workers = memo.max_workers
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60

    alignment = memo.pod_alignment
    memo.stop_background = start_background(
        _reconciler(memo), memo.resync_seconds, alignment.align if alignment is not None else None
    )


@kopf.on.cleanup()
def stop_background(memo: Any, **_: Any) -> None:
    stop = getattr(memo, "stop_background", None)
    if stop is not None:
        stop.set()


@kopf.on.event("apps", "v1", "deployments")
def deployment_event(body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:
    _workload_event(body, type, memo, "Deployment")


@kopf.on.event("apps", "v1", "statefulsets")
def statefulset_event(body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:
    _workload_event(body, type, memo, "StatefulSet")


def _workload_event(body: kopf.Body, event_type: str | None, memo: Any, kind: str) -> None:
    obj = _plain(body)
    obj.setdefault("apiVersion", "apps/v1")
    obj.setdefault("kind", kind)
    if event_type == "DELETED":
        _reconciler(memo).forget(obj)
        return
    _reconciler(memo).reconcile(obj)


@kopf.on.event(c.API_GROUP, c.API_VERSION, c.POLICY_PLURAL)
def policy_event(body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:
    _reconciler(memo).policy_changed(_plain(body), deleted=type == "DELETED")


def engine_pod_event(body: kopf.Body, memo: Any, **_: Any) -> None:
    """A node-mode engine pod was scheduled, changed or left: recompute its policy's cache pods."""
    meta = body.get("metadata") or {}
    _reconciler(memo).policies.sync_node_caches(
        str(meta.get("namespace")), str(meta["labels"][c.LABEL_NODE_CACHE_POLICY])
    )


def cache_pod_event(body: kopf.Body, memo: Any, **_: Any) -> None:
    """A cache pod changed or went away: replace it, delete it, or update the policy status."""
    meta = body.get("metadata") or {}
    _reconciler(memo).policies.sync_node_caches(str(meta.get("namespace")), str(meta["labels"][c.LABEL_CACHE_POLICY]))


def register_node_mode_handlers() -> None:
    """Watch engine and cache pods (node mode only: without it the operator has no pod rights)."""
    kopf.on.event("", "v1", "pods", labels={c.LABEL_NODE_CACHE_POLICY: kopf.PRESENT})(engine_pod_event)
    kopf.on.event("", "v1", "pods", labels={c.LABEL_CACHE_POLICY: kopf.PRESENT})(cache_pod_event)


def injection_pod_event(body: kopf.Body, type: str | None, memo: Any, **_: Any) -> None:
    """A pod of an admission-mode workload changed: evict it (or a sibling) if created uninjected."""
    alignment = memo.pod_alignment
    if alignment is not None:
        alignment.pod_changed(body)


def register_admission_handlers() -> None:
    """Watch the pods whose template asks for the injection (admission mode only)."""
    kopf.on.event("", "v1", "pods", labels={c.LABEL_INJECT: kopf.PRESENT})(injection_pod_event)
