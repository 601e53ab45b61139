"""The effects around the pure renderer: fetch inputs, apply, record metrics and Events.

Level-triggered and stateless towards the cluster: every call works from the object as it is
now, and nothing but the rendered fields lands on user workloads. The only memory is a cache
of inputs already reconciled (so status-only updates cost nothing) and a dedupe of Events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload import contract as c
from kvoffload.policy import PolicyError

from .admission import intent_in_place, render_for
from .drift import object_carries
from .events import EventRecorder
from .fragment import RenderedInjection
from .injection_plan import ClusterInfo, InjectionPlan
from .kube import Kube, KubeApiError, configmap_path, list_workloads, workload_path
from .managed_fields import TEMPLATE_META, owned_by
from .metrics import OperatorMetrics
from .node_caches import NodeCaches
from .node_fit import GpuNodeMemory, node_fit_problem
from .options_sources import OptionsSources
from .pod_alignment import PodAlignment
from .policies import Policies
from .retry import RetryQueue
from .settings import (
    InjectionSettings,
    OperatorDefaults,
    enabled_state,
    resolve_settings,
)
from .workload_inputs import plan_for, replan
from .workload_view import SUPPORTED_KINDS, configmap_name
from .workload_writes import (
    carries_injection,
    changed_since,
    delete_generated_configmap,
    locked_apply,
    ours_annotations_digest,
    remove_injection,
)

log = logging.getLogger("kvoffload.operator")


@dataclass
class Reconciler:
    """One per operator process; sync methods, called from kopf's worker threads."""

    kube: Kube
    defaults: OperatorDefaults
    cluster: ClusterInfo
    metrics: OperatorMetrics
    events: EventRecorder
    namespaces: tuple[str, ...] = ()
    """Watched namespaces; empty means all."""
    node_caches: NodeCaches | None = None
    """Node mode's cache pods (None: node mode is off, so workloads of ``mode: node`` are refused)."""
    _done: dict[str, frozenset[tuple[object, ...]]] = field(default_factory=dict)
    """Input fingerprints already reconciled, per workload uid."""
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _object_locks: dict[str, threading.Lock] = field(default_factory=dict)
    _checked_out: set[str] = field(default_factory=set)
    """Opted-out workloads whose leftover generated ConfigMap this process has looked for."""
    retries: RetryQueue = field(default_factory=RetryQueue)
    """Passes that failed on the API, run again by ``run_due_retries`` with backoff."""
    options_sources: OptionsSources = field(default_factory=lambda: OptionsSources())
    """Which workloads merge which of the user's options ConfigMaps (a ConfigMap edit re-renders them)."""
    policies: Policies = field(init=False)
    """The policy side: cache, node caches, status."""

    pod_alignment: PodAlignment | None = None
    """Admission mode: evicts pods created without the injection (None in template mode)."""

    node_memory: GpuNodeMemory = field(init=False)
    """The largest GPU node's allocatable memory, for the pre-pod fit check."""

    def __post_init__(self) -> None:
        self.policies = Policies(self.kube, self.defaults, self.metrics, self.retries, self.node_caches)
        self.node_memory = GpuNodeMemory(self.kube, enabled=not self.namespaces)

    # --- workloads -------------------------------------------------------------

    def forget(self, obj: Mapping[str, Any]) -> None:
        """The workload was deleted (its ConfigMap goes with it through the ownerReference)."""
        uid = str((obj.get("metadata") or {}).get("uid"))
        with self._lock:
            self._done.pop(uid, None)
            self._object_locks.pop(uid, None)
            self._checked_out.discard(uid)
        self.options_sources.track(obj, None)
        self.metrics.mark_injected(str(obj.get("kind")), uid, False)
        self.policies.touch(obj)

    def _object_lock(self, uid: str) -> threading.Lock:
        with self._lock:
            return self._object_locks.setdefault(uid, threading.Lock())

    def reconcile(self, obj: Mapping[str, Any], force: bool = False) -> str:
        """Bring one Deployment/StatefulSet to its desired state; returns the result label.

        A pass that fails on the API is queued for a retry with backoff (kopf will not call
        again until the object changes); any pass that completes clears that retry.
        """
        kind = str(obj.get("kind"))
        if kind not in SUPPORTED_KINDS:
            return "skipped"
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid"))
        retry_key = ("workload", kind, str(meta.get("namespace")), str(meta.get("name")))
        started = time.perf_counter()
        failure: str | None = None
        with self._object_lock(uid):
            try:
                result = self._reconcile(obj, force)
            except KubeApiError as exc:
                if exc.status in (403, 404) and self._gone(obj):
                    log.info("reconcile %s: the workload is gone or being deleted (%s)", _ref(obj), exc.reason)
                    result = "skipped"
                else:
                    log.warning("reconcile %s: %s (retrying)", _ref(obj), exc)
                    self.metrics.errors.labels(kind=kind, reason="api_error").inc()
                    result, failure = "error", f"the API call failed, retrying: {exc}"
            except Exception as exc:  # the operator keeps running whatever one workload does
                log.exception("reconcile %s failed (retrying)", _ref(obj))
                self.metrics.errors.labels(kind=kind, reason="internal").inc()
                result, failure = "error", f"internal error, retrying: {type(exc).__name__}: {exc}"
        if failure is None:
            self.retries.succeeded(retry_key)
        else:
            delay = self.retries.schedule(retry_key, lambda: self._retry_workload(kind, meta), time.monotonic())
            self.events.post(obj, "Warning", "KvoffloadRetrying", f"{failure} (next try in {delay:.0f} s)", failure)
        self.metrics.retry_queue.set(len(self.retries))
        if result != "noop":
            self.metrics.reconciles.labels(kind=kind, result=result).inc()
            self.metrics.duration.labels(kind=kind).observe(time.perf_counter() - started)
        return result

    def _gone(self, obj: Mapping[str, Any]) -> bool:
        """Whether the workload no longer exists or is being deleted (its namespace too, maybe)."""
        meta = obj.get("metadata") or {}
        try:
            current = self.kube.get(workload_path(str(obj.get("kind")), str(meta.get("namespace")),
                                                  str(meta.get("name"))))  # fmt: skip
        except KubeApiError:
            return False
        return current is None or bool((current.get("metadata") or {}).get("deletionTimestamp"))

    def _retry_workload(self, kind: str, meta: Mapping[str, Any]) -> None:
        """Re-read the workload and reconcile it as it is now (gone: forget it)."""
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        retry_key = ("workload", kind, namespace, name)
        try:
            current = self.kube.get(workload_path(kind, namespace, name))
        except KubeApiError as exc:
            log.warning("retry %s %s/%s: %s", kind, namespace, name, exc)
            self.retries.schedule(retry_key, lambda: self._retry_workload(kind, meta), time.monotonic())
            return
        if current is None:
            self.retries.succeeded(retry_key)
            self.forget({"kind": kind, "metadata": meta})
            return
        current.setdefault("apiVersion", "apps/v1")
        current.setdefault("kind", kind)
        self.reconcile(current)

    def run_due_retries(self) -> int:
        """Run every retry whose backoff has elapsed; returns how many ran."""
        actions = self.retries.take_due(time.monotonic())
        for action in actions:
            action()
        self.metrics.retry_queue.set(len(self.retries))
        return len(actions)

    def _reconcile(self, obj: Mapping[str, Any], force: bool) -> str:
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid"))
        if meta.get("deletionTimestamp"):
            return "noop"  # being deleted: an apply could only race the garbage collector
        annotations = meta.get("annotations") or {}
        enabled = enabled_state(annotations)
        if isinstance(enabled, PolicyError):
            return self._reject(obj, enabled, state=ours_annotations_digest(annotations))
        if not enabled:
            return self._remove(obj)
        policy = self.policies.for_workload(obj)
        fingerprint = (
            meta.get("generation"),
            ours_annotations_digest(annotations),
            None if policy is None else (policy.get("metadata") or {}).get("resourceVersion"),
            self.cluster,
        )
        with self._lock:
            if not force and fingerprint in self._done.get(uid, frozenset()):
                return "noop"
        state = f"{meta.get('generation')}/{fingerprint[1]}/{fingerprint[2]}"
        settings = resolve_settings(annotations, policy, self.defaults, str(meta.get("namespace")))
        if isinstance(settings, PolicyError):
            return self._reject(obj, settings, state)
        if settings.mode == "node" and self.node_caches is None:
            return self._reject(obj, PolicyError(
                "mode", "node", "node mode is off in this operator: it needs the pod rights the chart grants "
                "with nodeMode.enabled=true (operator flag --node-mode true); use mode sidecar or enable it",
                reason="unsupported",
            ), state)  # fmt: skip
        unfit = node_fit_problem(obj, settings, self.node_memory.largest())
        if unfit:
            return self._reject(obj, unfit, state)
        plan = self._plan(obj, settings, state)
        if isinstance(plan, str):
            return plan
        if self.cluster.injection == "admission" and _template_injected(obj):
            # Injected in the template by an operator in template mode: hand the template back to
            # the user first (one rollout); the removal's own event brings the label.
            return self._remove(obj)
        rendered = render_for(plan)
        answer: Mapping[str, Any] | None = None
        with self._lock:
            first_sight = uid not in self._done
        in_place = self.cluster.injection == "admission" and intent_in_place(obj, rendered)
        if in_place or ((force or first_sight) and carries_injection(self.kube, obj, rendered)):
            result = "unchanged"  # a resync or a restarted operator that found no drift sends nothing
        else:
            result, answer = self._apply_injection(obj, rendered, state)
        if result in ("applied", "unchanged"):
            self._remember_done(obj, rendered, plan, (result, answer), fingerprint, state)
        return result

    def _remember_done(self, obj: Mapping[str, Any], rendered: RenderedInjection, plan: InjectionPlan,
                       outcome: tuple[str, Mapping[str, Any] | None], fingerprint: tuple[object, ...],
                       state: str) -> None:  # fmt: skip
        """After a pass that left the workload injected (``outcome``: the result label and the object
        the apply returned): post its warnings, remember the inputs now done."""
        kind, uid = str(obj.get("kind")), str((obj.get("metadata") or {}).get("uid"))
        result, answer = outcome
        for warning in rendered.warnings:
            self.events.post(obj, "Warning", "KvoffloadManualStep", warning, state)
        done = {fingerprint}
        if result == "applied" and answer is not None:
            # The apply raised the generation. If the object it returned is a fixed point (the
            # renderer gives the same fragment and the object carries it), the event for that
            # generation has nothing to do either: remember both as done.
            again = replan(answer, plan)
            answer_meta = answer.get("metadata") or {}
            if (not isinstance(again, PolicyError) and again.config_hash == rendered.config_hash
                    and object_carries(again.workload_apply, answer)):  # fmt: skip
                done.add((answer_meta.get("generation"),
                          ours_annotations_digest(answer_meta.get("annotations") or {}), *fingerprint[2:]))  # fmt: skip
        with self._lock:
            self._done[uid] = frozenset(done)
        self.metrics.mark_injected(kind, uid, True)
        self.policies.touch(obj)

    def _plan(self, obj: Mapping[str, Any], settings: InjectionSettings, state: str) -> InjectionPlan | str:
        """Plan once per pass (``workload_inputs.plan_for``); a refusal is posted and its result label returned."""
        plan = plan_for(self.kube, obj, settings, self.cluster, self.options_sources)
        return self._reject(obj, plan, state) if isinstance(plan, PolicyError) else plan

    def check_options_sources(self) -> int:
        """Re-render (one rollout each when the merged file changes) the workloads whose options
        ConfigMap was edited since it was last seen; returns how many ConfigMaps were."""
        edited = self.options_sources.edited(lambda ns, name: self.kube.get(configmap_path(ns, name)))
        for namespace, name in edited:
            for kind, workload in self.options_sources.workloads(namespace, name):
                current = self.kube.get(workload_path(kind, namespace, workload))
                if current is not None:
                    self.reconcile({"apiVersion": "apps/v1", "kind": kind, **current}, force=True)
        return len(edited)

    def _apply_injection(self, obj: Mapping[str, Any], rendered: RenderedInjection, state: str
                         ) -> tuple[str, Mapping[str, Any] | None]:  # fmt: skip
        """Apply the generated ConfigMap (template mode) and the workload fragment; the result label
        and the object the apiserver returned (None when nothing was applied)."""
        kind = str(obj.get("kind"))
        meta = obj.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        if rendered.configmap_apply is not None:
            try:
                self.kube.apply(configmap_path(namespace, configmap_name(name)), rendered.configmap_apply,
                                c.FIELD_MANAGER)  # fmt: skip
            except KubeApiError as exc:
                if exc.status == 409 and exc.field_conflicts:
                    return self._conflict(obj, exc, f"ConfigMap {configmap_name(name)}", state), None
                raise
        # Both applies are locked to the resourceVersion the fragment was computed from (a stale
        # fragment must never land: it would roll the pods twice). A 409 caused only by a status
        # write refreshes the lock instead of waiting for the next event (``_locked_apply``).
        body = rendered.workload_apply
        path = workload_path(kind, namespace, name)
        try:
            unforced = locked_apply(self.kube, path, body, meta, force=False)
            if unforced is None:
                log.info("%s changed while reconciling; the next event carries the new version", _ref(obj))
                return "skipped", None
            answer = unforced
        except KubeApiError as exc:
            if exc.status == 422 and changed_since(self.kube, path, meta):
                log.info("%s changed while reconciling (422 on a stale fragment); the next event retries", _ref(obj))
                return "skipped", None
            if exc.status == 422:
                # Input the settings could not judge (e.g. a pod-level rule): say so on the workload.
                return self._reject(obj, PolicyError(
                    f"{kind} {name}", "the injected fragment", f"the apiserver refused it: {exc.message}",
                    reason="rejected_by_apiserver",
                ), state), None  # fmt: skip
            if exc.status != 409:
                raise
            conflicts = exc.field_conflicts
            if not conflicts:
                log.info("%s changed while reconciling; the next event carries the new version", _ref(obj))
                return "skipped", None
            if not all(f in rendered.forceable_fields for f, _ in conflicts):
                return self._conflict(obj, exc, f"{kind} {name}", state), None
            # Only the engine's args conflict: the documented rewrite, undone on removal. Forcing
            # takes the user's args, so it is locked to the version the rewrite was computed from.
            forced_answer = locked_apply(self.kube, path, body, meta, force=True)
            if forced_answer is None:
                log.info("%s changed while reconciling; the next event carries the new version", _ref(obj))
                return "skipped", None
            answer = forced_answer
        # Injected by an earlier version, which kept the record in a ConfigMap: the record is on the
        # workload now and nothing reads the ConfigMap any more (running pods keep their files).
        upgraded = rendered.configmap_apply is None and _record_in_configmap(obj)
        if upgraded and delete_generated_configmap(self.kube, namespace, name):
            log.info("%s: deleted the ConfigMap an earlier version kept the record in", _ref(obj))
        changed = (answer.get("metadata") or {}).get("generation") != meta.get("generation")
        if changed:
            what = (f"its pods are created through the kvoffload webhook with the cache sidecar and the connector "
                    f"in container {rendered.engine_container}" if self.cluster.injection == "admission" else
                    f"injected the kvoffload cache sidecar and connector into container {rendered.engine_container}")  # fmt: skip
            self.events.post(obj, "Normal", "KvoffloadInjected", f"{what} (config hash {rendered.config_hash})",
                             rendered.config_hash)  # fmt: skip
            log.info("injected %s hash=%s", _ref(obj), rendered.config_hash)
        return ("applied" if changed else "unchanged"), answer

    def _remove(self, obj: Mapping[str, Any]) -> str:
        """Opted out: take the injection out (``workload_writes.remove_injection``), then forget it."""
        kind = str(obj.get("kind"))
        meta = obj.get("metadata") or {}
        try:
            result = remove_injection(self.kube, obj)
        except KubeApiError as exc:
            if exc.status == 409 and exc.field_conflicts:
                return self._conflict(obj, exc, f"{kind} {meta.get('name')}", "removal")
            raise
        if result == "noop":
            self._delete_leftover_configmap(obj)
        if result != "removed":
            if result == "skipped":
                log.info("%s changed while removing; the next event carries the new version", _ref(obj))
            return result
        uid = str(meta.get("uid"))
        with self._lock:
            self._done.pop(uid, None)
        self.options_sources.track(obj, None)
        self.metrics.mark_injected(kind, uid, False)
        self.events.post(
            obj, "Normal", "KvoffloadRemoved", "removed the kvoffload injection", str(meta.get("generation"))
        )
        log.info("removed injection from %s", _ref(obj))
        self.policies.touch(obj)
        return "removed"

    def _delete_leftover_configmap(self, obj: Mapping[str, Any]) -> None:
        """A removal stopped between its last apply and the ConfigMap's deletion (the operator was
        killed) leaves nothing of ours on the workload but the ConfigMap: the first pass of this
        process over an opted-out workload that still has a ``kvoffload.io/`` annotation deletes it
        (one GET per such workload and process; plain workloads cost nothing)."""
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid"))
        if not any(k.startswith(c.ANNOTATION_PREFIX) for k in meta.get("annotations") or {}):
            return
        with self._lock:
            if uid in self._checked_out:
                return
            self._checked_out.add(uid)
        if delete_generated_configmap(self.kube, str(meta.get("namespace")), str(meta.get("name"))):
            log.info("%s: deleted the generated ConfigMap an interrupted removal left", _ref(obj))

    def _reject(self, obj: Mapping[str, Any], error: PolicyError, state: str) -> str:
        """Bad input: a Warning Event naming field, value and what is allowed; nothing applied."""
        self.metrics.errors.labels(kind=str(obj.get("kind")), reason=error.reason).inc()
        self.events.post(obj, "Warning", "KvoffloadInvalid", error.message, state)
        log.warning("not injecting %s: %s", _ref(obj), error.message)
        return "error"

    def _conflict(self, obj: Mapping[str, Any], exc: KubeApiError, what: str, state: str) -> str:
        details = "; ".join(f"{f}: {m}" for f, m in exc.field_conflicts)
        self.metrics.errors.labels(kind=str(obj.get("kind")), reason="conflict").inc()
        self.events.post(
            obj, "Warning", "KvoffloadConflict",
            f"{what}: another field manager owns fields kvoffload needs; nothing was changed ({details})", state,
        )  # fmt: skip
        log.warning("conflict on %s: %s", _ref(obj), details)
        return "conflict"

    # --- policies --------------------------------------------------------------

    def policy_changed(self, policy: Mapping[str, Any], deleted: bool = False) -> None:
        """A KVCachePolicy appeared, changed or went away: re-reconcile the workloads naming it."""
        meta = policy.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if self.policies.remember(policy, deleted):
            for workload in self.policies.workloads_naming(*key):
                self.reconcile(workload)
        if not deleted:
            self.policies.sync_node_caches(*key)
            self.policies.refresh_status(*key)

    def resync(self) -> None:
        """Reconcile every opted-in workload and every known policy's node caches regardless of
        the cache (drift in inputs we do not watch, events lost while the watch reconnected)."""
        for item in list(list_workloads(self.kube, self.namespaces)):
            if c.ANN_ENABLED in ((item.get("metadata") or {}).get("annotations") or {}):
                self.reconcile(item, force=True)
        self.policies.recheck_node_caches()


def _template_injected(obj: Mapping[str, Any]) -> bool:
    """Whether the operator owns the injection inside the pod template (template mode's mark)."""
    return owned_by(obj, (*TEMPLATE_META, "f:labels", f"f:{c.LABEL_INJECTED}"), c.FIELD_MANAGER)


def _record_in_configmap(obj: Mapping[str, Any]) -> bool:
    """Whether the operator labelled the template for admission without a record on the workload
    (what versions that kept the record in the generated ConfigMap left)."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return c.ANN_INJECTION_RECORD not in annotations and owned_by(
        obj, (*TEMPLATE_META, "f:labels", f"f:{c.LABEL_INJECT}"), c.FIELD_MANAGER
    )


def _ref(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('namespace')}/{meta.get('name')}"
