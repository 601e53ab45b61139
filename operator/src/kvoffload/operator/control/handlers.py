"""kopf glue: watch events in, ``Reconciler`` calls out; nothing else.

Only ``@kopf.on.event`` handlers: they are stateless, so kopf stores no progress, diff-base or
finalizer on user workloads. Every event (including the initial listing after a restart)
reconciles the object as it is now, which is what makes a killed operator converge.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Mapping
from typing import Any

import kopf

from kvoffload import contract as c
from kvoffload.operator.admission.pod_alignment import uninjected
from kvoffload.operator.control.reconcile import Reconciler

log = logging.getLogger("kvoffload.operator")
POLICY_STATUS_INTERVAL_S = 2.0
NODE_CACHE_RECHECK_S = 30.0


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

    stop = threading.Event()
    memo.stop_background = stop

    def background() -> None:
        elapsed = 0.0
        since_node_check = 0.0
        while not stop.wait(POLICY_STATUS_INTERVAL_S):
            try:
                _reconciler(memo).run_due_retries()
            except Exception:
                log.exception("retries failed")
            _reconciler(memo).policies.flush_status()
            try:
                _reconciler(memo).check_options_sources()
            except Exception:
                log.exception("options ConfigMap check failed")
            since_node_check += POLICY_STATUS_INTERVAL_S
            if since_node_check >= NODE_CACHE_RECHECK_S:  # a missed pod event must not strand a cache pod
                since_node_check = 0.0
                try:
                    _reconciler(memo).policies.recheck_node_caches()
                except Exception:
                    log.exception("node cache recheck failed")
                alignment = _reconciler(memo).pod_alignment
                if alignment is not None:  # backed-off evictions are due, or a pod event was missed
                    try:
                        alignment.align()
                    except Exception:
                        log.exception("aligning pods created without the injection failed")
            elapsed += POLICY_STATUS_INTERVAL_S
            if memo.resync_seconds and elapsed >= memo.resync_seconds:
                elapsed = 0.0
                try:
                    _reconciler(memo).resync()
                except Exception:
                    log.exception("resync failed")

    threading.Thread(target=background, name="kvoffload-background", daemon=True).start()


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
    alignment = _reconciler(memo).pod_alignment
    if alignment is None:
        return
    namespace = str((body.get("metadata") or {}).get("namespace"))
    alignment.report_start_failure(body)
    if uninjected(body) or alignment.behind_in(namespace):
        alignment.align(namespace)


def register_admission_handlers() -> None:
    """Watch the pods whose template asks for the injection (admission mode only)."""
    kopf.on.event("", "v1", "pods", labels={c.LABEL_INJECT: kopf.PRESENT})(injection_pod_event)
