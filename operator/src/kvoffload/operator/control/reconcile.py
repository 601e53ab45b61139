"""One pass over a workload: read it once, decide (pure, with the readers it is handed), perform
the one effect the decision names (render and apply, or remove), report the outcome (Events,
counters, retry, the policy's status).

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
from kvoffload.operator.api.events import EventRecorder
from kvoffload.operator.api.kube import Kube, KubeApiError, configmap_path, list_workloads, workload_path
from kvoffload.operator.api.options_reader import options_reader
from kvoffload.operator.api.retry import RetryQueue
from kvoffload.operator.control.outcome import Notice, Outcome, conflicted, rejected
from kvoffload.operator.control.policies import Policies
from kvoffload.operator.control.workload_writes import (
    apply_injection,
    carries_injection,
    delete_generated_configmap,
    remove_injection,
)
from kvoffload.operator.intent.options_sources import OptionsSources
from kvoffload.operator.intent.settings import OperatorDefaults, ours_annotations_digest
from kvoffload.operator.intent.workload import SUPPORTED_KINDS, Workload, WorkloadRef, read_workload
from kvoffload.operator.metrics import OperatorMetrics
from kvoffload.operator.node.caches import NodeCaches
from kvoffload.operator.node.gpu_nodes import GpuNodeMemory
from kvoffload.operator.plan.fragment import RenderedInjection
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan
from kvoffload.operator.plan.injection_record import foreign_record
from kvoffload.operator.plan.workload_apply import intent_in_place, render_for, renders_to_itself
from kvoffload.operator.plan.workload_decision import (
    Decision,
    Inject,
    Reject,
    Remove,
    WorkloadInputs,
    decide_workload,
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

    node_memory: GpuNodeMemory = field(init=False)
    """The largest GPU node's allocatable memory, for the pre-pod fit check."""

    def __post_init__(self) -> None:
        self.policies = Policies(self.kube, self.defaults, self.metrics, self.retries, self.node_caches)
        self.node_memory = GpuNodeMemory(self.kube)

    # --- workloads -------------------------------------------------------------

    def forget(self, obj: Mapping[str, Any]) -> None:
        """The workload was deleted (its ConfigMap goes with it through the ownerReference)."""
        self._forget(read_workload(obj))

    def _forget(self, workload: Workload) -> None:
        uid = workload.ref.uid
        with self._lock:
            self._done.pop(uid, None)
            self._object_locks.pop(uid, None)
            self._checked_out.discard(uid)
        self._report(workload, Outcome("skipped", injected=False))

    def _object_lock(self, uid: str) -> threading.Lock:
        with self._lock:
            return self._object_locks.setdefault(uid, threading.Lock())

    def reconcile(self, obj: Mapping[str, Any], force: bool = False) -> str:
        """Bring one Deployment/StatefulSet to its desired state; returns the result label.

        One pass: read the object once (``read_workload``), decide (``decide_workload``, which
        plans), perform the one effect the decision names, report the outcome. A pass that fails on
        the API is queued for a retry with backoff (kopf will not call again until the object
        changes); any pass that completes clears that retry.
        """
        started = time.perf_counter()
        workload = read_workload(obj)
        if workload.ref.kind not in SUPPORTED_KINDS:
            return "skipped"
        with self._object_lock(workload.ref.uid):
            try:
                decision = decide_workload(workload, self._inputs(workload.ref.uid, force))
                outcome = self._act(workload, decision, force)
            except KubeApiError as exc:
                outcome = self._api_failure(workload.ref, exc)
            except Exception as exc:  # the operator keeps running whatever one workload does
                log.exception("reconcile %s failed (retrying)", workload.ref)
                outcome = Outcome("error", errors=["internal"],
                                  failure=f"internal error, retrying: {type(exc).__name__}: {exc}")  # fmt: skip
        self._report(workload, outcome, time.perf_counter() - started)
        return outcome.result

    def _act(self, workload: Workload, decision: Decision, force: bool) -> Outcome:
        """Perform the one effect the decision names."""
        if isinstance(decision, Reject):
            return rejected(decision.error, decision.state)
        if isinstance(decision, Remove):
            return self._remove(workload)
        if isinstance(decision, Inject):
            return self._inject(workload, decision, force)
        return Outcome("noop")

    def _api_failure(self, ref: WorkloadRef, exc: KubeApiError) -> Outcome:
        """A pass that failed on the API: retried, unless the workload is gone."""
        if exc.status in (403, 404) and self._gone(ref):
            log.info("reconcile %s: the workload is gone or being deleted (%s)", ref, exc.reason)
            return Outcome("skipped")
        log.warning("reconcile %s: %s (retrying)", ref, exc)
        return Outcome("error", errors=["api_error"], failure=f"the API call failed, retrying: {exc}")

    def _inputs(self, uid: str, force: bool) -> WorkloadInputs:
        """What the decision reads besides the workload: the readers are called only where the answer depends on them."""
        with self._lock:
            done = self._done.get(uid, frozenset())
        return WorkloadInputs(
            policy=self.policies.named, defaults=self.defaults, cluster=self.cluster,
            node_mode=self.node_caches is not None, largest_gpu_node_memory=self.node_memory.largest,
            options=options_reader(self.kube, self.options_sources), foreign=foreign_record, done=done, force=force,
        )  # fmt: skip

    def _report(self, workload: Workload, outcome: Outcome, seconds: float | None = None) -> None:
        """The pass's effects besides its writes: its Events, counters, retry, policy status."""
        ref = workload.ref
        if outcome.failure is None:
            self.retries.succeeded(_retry_key(ref))
        else:
            delay = self.retries.schedule(_retry_key(ref), lambda: self._retry_workload(workload), time.monotonic())
            outcome.notices.append(Notice("Warning", "KvoffloadRetrying",
                                          f"{outcome.failure} (next try in {delay:.0f} s)", outcome.failure))  # fmt: skip
        for notice in outcome.notices:
            if notice.type == "Warning" and notice.reason != "KvoffloadRetrying":  # a retry was logged as it failed
                log.warning("%s: %s: %s", ref, notice.reason, notice.message)
            self.events.post(ref, notice.type, notice.reason, notice.message, notice.state)
        for reason in outcome.errors:
            self.metrics.errors.labels(kind=ref.kind, reason=reason).inc()
        if outcome.injected is not None:
            if not outcome.injected:
                self.options_sources.track(ref, None)
            self.metrics.mark_injected(ref.kind, ref.uid, outcome.injected)
            self.policies.touch(workload)
        self.metrics.retry_queue.set(len(self.retries))
        if seconds is not None and outcome.result != "noop":
            self.metrics.reconciles.labels(kind=ref.kind, result=outcome.result).inc()
            self.metrics.duration.labels(kind=ref.kind).observe(seconds)

    def _gone(self, ref: WorkloadRef) -> bool:
        """Whether the workload no longer exists or is being deleted (its namespace too, maybe)."""
        try:
            current = self.kube.get(workload_path(ref.kind, ref.namespace, ref.name))
        except KubeApiError:
            return False
        return current is None or bool((current.get("metadata") or {}).get("deletionTimestamp"))

    def _retry_workload(self, workload: Workload) -> None:
        """Re-read the workload and reconcile it as it is now (gone: forget it)."""
        ref = workload.ref
        try:
            current = self.kube.get(workload_path(ref.kind, ref.namespace, ref.name))
        except KubeApiError as exc:
            log.warning("retry %s: %s", ref, exc)
            self.retries.schedule(_retry_key(ref), lambda: self._retry_workload(workload), time.monotonic())
            return
        if current is None:
            self.retries.succeeded(_retry_key(ref))
            self._forget(workload)
            return
        current.setdefault("apiVersion", "apps/v1")
        current.setdefault("kind", ref.kind)
        self.reconcile(current)

    def run_due_retries(self) -> int:
        """Run every retry whose backoff has elapsed; returns how many ran."""
        actions = self.retries.take_due(time.monotonic())
        for action in actions:
            action()
        self.metrics.retry_queue.set(len(self.retries))
        return len(actions)

    def _inject(self, workload: Workload, decision: Inject, force: bool) -> Outcome:
        """Render the plan and apply it unless the object carries it already."""
        if decision.hand_back_template:
            return self._remove(workload)  # the removal's own event brings the admission label
        rendered = render_for(decision.plan)
        with self._lock:
            first_sight = workload.ref.uid not in self._done
        in_place = self.cluster.injection == "admission" and intent_in_place(workload, rendered)
        if in_place or ((force or first_sight) and carries_injection(self.kube, workload, rendered)):
            outcome, answer = Outcome("unchanged"), None  # a resync or a restarted operator that found no drift
        else:
            outcome, answer = self._apply_injection(workload, rendered, decision.state)
        if outcome.result in ("applied", "unchanged"):
            self._remember_done(workload.ref.uid, decision.plan, rendered.config_hash, answer, decision.fingerprint)
            outcome.notices += [Notice("Warning", "KvoffloadManualStep", w, decision.state) for w in rendered.warnings]
            outcome.injected = True
        return outcome

    def _remember_done(self, uid: str, plan: InjectionPlan, config_hash: str, answer: Mapping[str, Any] | None,
                       fingerprint: tuple[object, ...]) -> None:  # fmt: skip
        """After a pass that left the workload injected with ``config_hash`` (``answer``: the object
        an apply returned): remember the inputs now done."""
        done = {fingerprint}
        if answer is not None:
            # The apply raised the generation. If the object it returned is a fixed point (the
            # renderer gives the same fragment and the object carries it), the event for that
            # generation has nothing to do either: remember both as done.
            answer_meta = answer.get("metadata") or {}
            if renders_to_itself(answer, plan, config_hash):
                done.add((answer_meta.get("generation"),
                          ours_annotations_digest(answer_meta.get("annotations") or {}), *fingerprint[2:]))  # fmt: skip
        with self._lock:
            self._done[uid] = frozenset(done)

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

    def _apply_injection(self, workload: Workload, rendered: RenderedInjection, state: str
                         ) -> tuple[Outcome, Mapping[str, Any] | None]:  # fmt: skip
        """Apply the injection (``workload_writes.apply_injection``): the outcome, and the object the
        apiserver returned when the generation moved (None otherwise)."""
        applied = apply_injection(self.kube, workload, rendered)
        if applied.conflict is not None:
            return conflicted(applied.conflict, applied.conflict_on, state), None
        if applied.refused is not None:
            return rejected(applied.refused, state), None
        if applied.result == "skipped":
            log.info("%s changed while reconciling; the next event carries the new version", workload.ref)
        if applied.result != "applied":
            return Outcome(applied.result), None
        what = (f"its pods are created through the kvoffload webhook with the cache sidecar and the connector "
                f"in container {rendered.engine_container}" if self.cluster.injection == "admission" else
                f"injected the kvoffload cache sidecar and connector into container {rendered.engine_container}")  # fmt: skip
        log.info("injected %s hash=%s", workload.ref, rendered.config_hash)
        notice = Notice("Normal", "KvoffloadInjected", f"{what} (config hash {rendered.config_hash})",
                        rendered.config_hash)  # fmt: skip
        return Outcome("applied", [notice]), applied.answer

    def _remove(self, workload: Workload) -> Outcome:
        """Opted out: take the injection out (``workload_writes.remove_injection``), then forget it."""
        ref = workload.ref
        try:
            result = remove_injection(self.kube, workload, self.cluster.writes_configmaps)
        except KubeApiError as exc:
            if exc.status == 409 and exc.field_conflicts:
                return conflicted(exc, f"{ref.kind} {ref.name}", "removal")
            raise
        if result == "noop" and self.cluster.writes_configmaps:
            self._delete_leftover_configmap(workload)
        if result != "removed":
            if result == "skipped":
                log.info("%s changed while removing; the next event carries the new version", ref)
            return Outcome(result)
        with self._lock:
            self._done.pop(ref.uid, None)
        log.info("removed injection from %s", ref)
        notice = Notice("Normal", "KvoffloadRemoved", "removed the kvoffload injection", str(workload.generation))
        return Outcome("removed", [notice], injected=False)

    def _delete_leftover_configmap(self, workload: Workload) -> None:
        """A removal stopped between its last apply and the ConfigMap's deletion (the operator was
        killed) leaves nothing of ours on the workload but the ConfigMap: the first pass of this
        process over an opted-out workload that still has a ``kvoffload.io/`` annotation deletes it
        (one GET per such workload and process; plain workloads cost nothing)."""
        if not any(k.startswith(c.ANNOTATION_PREFIX) for k in workload.annotations):
            return
        with self._lock:
            if workload.ref.uid in self._checked_out:
                return
            self._checked_out.add(workload.ref.uid)
        if delete_generated_configmap(self.kube, workload.ref.namespace, workload.ref.name):
            log.info("%s: deleted the generated ConfigMap an interrupted removal left", workload.ref)

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


def _retry_key(ref: WorkloadRef) -> tuple[str, ...]:
    """A workload's key in the retry queue (one pending retry per workload)."""
    return ("workload", ref.kind, ref.namespace, ref.name)
