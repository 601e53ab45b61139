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
from kvoffload.operator.admission.pod_alignment import PodAlignment
from kvoffload.operator.admission.records import intent_in_place, render_for
from kvoffload.operator.admission.workload_inputs import plan_for, replan
from kvoffload.operator.api.events import EventRecorder
from kvoffload.operator.api.kube import Kube, KubeApiError, configmap_path, list_workloads, workload_path
from kvoffload.operator.api.retry import RetryQueue
from kvoffload.operator.control.policies import Policies
from kvoffload.operator.control.workload_writes import (
    apply_injection,
    carries_injection,
    delete_generated_configmap,
    remove_injection,
)
from kvoffload.operator.intent.options_sources import OptionsSources
from kvoffload.operator.intent.settings import OperatorDefaults, ours_annotations_digest
from kvoffload.operator.intent.workload_view import SUPPORTED_KINDS
from kvoffload.operator.metrics import OperatorMetrics
from kvoffload.operator.node.caches import NodeCaches
from kvoffload.operator.node.gpu_nodes import GpuNodeMemory
from kvoffload.operator.plan.drift import object_carries
from kvoffload.operator.plan.fragment import RenderedInjection
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan
from kvoffload.operator.plan.workload_decision import (
    Inject,
    Reject,
    Remove,
    WorkloadInputs,
    decide_workload,
)
from kvoffload.policy_values import PolicyError

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
        """Fetch the decision's inputs, decide (``workload_decision.decide_workload``), act on it."""
        inputs = self._inputs(obj, force)
        decision = decide_workload(obj, inputs)
        if isinstance(decision, Reject):
            return self._reject(obj, decision.error, decision.state)
        if isinstance(decision, Remove):
            return self._remove(obj)
        if isinstance(decision, Inject):
            return self._inject(obj, decision, force)
        return "noop"

    def _inputs(self, obj: Mapping[str, Any], force: bool) -> WorkloadInputs:
        """The decision's inputs; the policy and the nodes are read only if the decision asks for them."""
        with self._lock:
            done = self._done.get(str((obj.get("metadata") or {}).get("uid")), frozenset())
        return WorkloadInputs(
            policy=lambda: self.policies.for_workload(obj),
            defaults=self.defaults,
            cluster=self.cluster,
            node_mode=self.node_caches is not None,
            largest_gpu_node_memory=self.node_memory.largest,
            done=done,
            force=force,
        )

    def _inject(self, obj: Mapping[str, Any], decision: Inject, force: bool) -> str:
        """Plan (the options ConfigMap is read here), render, apply unless the object carries it already."""
        plan = plan_for(self.kube, obj, decision.settings, self.cluster, self.options_sources)
        if isinstance(plan, PolicyError):
            return self._reject(obj, plan, decision.state)
        if decision.hand_back_template:
            return self._remove(obj)  # the removal's own event brings the admission label
        rendered = render_for(plan)
        answer: Mapping[str, Any] | None = None
        with self._lock:
            first_sight = str((obj.get("metadata") or {}).get("uid")) not in self._done
        in_place = self.cluster.injection == "admission" and intent_in_place(obj, rendered)
        if in_place or ((force or first_sight) and carries_injection(self.kube, obj, rendered)):
            result = "unchanged"  # a resync or a restarted operator that found no drift sends nothing
        else:
            result, answer = self._apply_injection(obj, rendered, decision.state)
        if result in ("applied", "unchanged"):
            self._remember_done(obj, rendered, plan, (result, answer), decision.fingerprint, decision.state)
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
        """Apply the injection (``workload_writes.apply_injection``) and report what it came to: the
        result label and the object the apiserver returned (None when nothing was applied)."""
        outcome = apply_injection(self.kube, obj, rendered)
        if outcome.conflict is not None:
            return self._conflict(obj, outcome.conflict, outcome.conflict_on, state), None
        if outcome.refused is not None:
            return self._reject(obj, outcome.refused, state), None
        if outcome.result == "skipped":
            log.info("%s changed while reconciling; the next event carries the new version", _ref(obj))
        if outcome.result == "applied":
            what = (f"its pods are created through the kvoffload webhook with the cache sidecar and the connector "
                    f"in container {rendered.engine_container}" if self.cluster.injection == "admission" else
                    f"injected the kvoffload cache sidecar and connector into container {rendered.engine_container}")  # fmt: skip
            self.events.post(obj, "Normal", "KvoffloadInjected", f"{what} (config hash {rendered.config_hash})",
                             rendered.config_hash)  # fmt: skip
            log.info("injected %s hash=%s", _ref(obj), rendered.config_hash)
        return outcome.result, outcome.answer

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


def _ref(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('namespace')}/{meta.get('name')}"
