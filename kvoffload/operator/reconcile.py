"""The effects around the pure renderer: fetch inputs, apply, record metrics and Events.

Level-triggered and stateless towards the cluster: every call works from the object as it is
now, and nothing but the rendered fields lands on user workloads. The only memory is a cache
of inputs already reconciled (so status-only updates cost nothing) and a dedupe of Events.
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
import logging
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload import contract as c
from kvoffload.policy import PolicyError

from .drift import object_carries
from .fragment import RemovalPlan, RenderedInjection, render, render_removal
from .injection_plan import ClusterInfo, InjectionPlan, choose_engine, plan_injection
from .kube import Kube, KubeApiError, configmap_path, events_path, policy_path, workload_path
from .metrics import OperatorMetrics
from .node_caches import NodeCaches
from .node_mode import node_cache_wiring
from .retry import RetryQueue
from .settings import (
    InjectionSettings,
    OperatorDefaults,
    enabled_state,
    policy_name,
    resolve_settings,
)
from .workload_view import SUPPORTED_KINDS, configmap_name

log = logging.getLogger("kvoffload.operator")
EVENT_MESSAGE_LIMIT = 1000
LOCKED_APPLY_TRIES = 3
READY = "Ready"


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _ours_annotations(annotations: Mapping[str, str]) -> str:
    relevant = {k: v for k, v in annotations.items() if k.startswith(c.ANNOTATION_PREFIX)}
    return hashlib.sha256(json.dumps(relevant, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class EventRecorder:
    """Posts core/v1 Events about workloads, each distinct (object, state, message) once."""

    kube: Kube
    _seen: dict[tuple[str, ...], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def post(self, obj: Mapping[str, Any], type_: str, reason: str, message: str, state: str = "") -> None:
        meta = obj.get("metadata") or {}
        dedupe = (str(meta.get("uid")), state, reason, message)
        with self._lock:
            if dedupe in self._seen:
                return
            if len(self._seen) > 10000:
                self._seen.clear()
            self._seen[dedupe] = time.monotonic()
        now = _now()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"),
                "kind": obj.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:EVENT_MESSAGE_LIMIT],
            "source": {"component": c.FIELD_MANAGER},
            "reportingComponent": c.FIELD_MANAGER,
            "reportingInstance": socket.gethostname(),
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.kube.create(events_path(str(meta.get("namespace"))), event)
        except KubeApiError as exc:
            log.warning("event not posted: %s", exc)


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
    policies: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    _done: dict[str, frozenset[tuple[object, ...]]] = field(default_factory=dict)
    """Input fingerprints already reconciled, per workload uid."""
    _dirty_policies: set[tuple[str, str]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _object_locks: dict[str, threading.Lock] = field(default_factory=dict)
    retries: RetryQueue = field(default_factory=RetryQueue)
    """Passes that failed on the API, run again by ``run_due_retries`` with backoff."""

    # --- workloads -------------------------------------------------------------

    def forget(self, obj: Mapping[str, Any]) -> None:
        """The workload was deleted (its ConfigMap goes with it through the ownerReference)."""
        uid = str((obj.get("metadata") or {}).get("uid"))
        with self._lock:
            self._done.pop(uid, None)
            self._object_locks.pop(uid, None)
        self.metrics.mark_injected(str(obj.get("kind")), uid, False)
        self._touch_policy(obj)

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
        kind = str(obj.get("kind"))
        meta = obj.get("metadata") or {}
        uid = str(meta.get("uid"))
        if meta.get("deletionTimestamp"):
            return "noop"  # being deleted: an apply could only race the garbage collector
        annotations = meta.get("annotations") or {}
        enabled = enabled_state(annotations)
        if isinstance(enabled, PolicyError):
            return self._reject(obj, enabled, state=_ours_annotations(annotations))
        if not enabled:
            return self._remove(obj)
        policy = self._policy_for(obj)
        fingerprint = (
            meta.get("generation"),
            _ours_annotations(annotations),
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
        plan = self._plan(obj, settings, state)
        if isinstance(plan, str):
            return plan
        rendered = render(plan)
        answer: Mapping[str, Any] | None = None
        with self._lock:
            first_sight = uid not in self._done
        if (force or first_sight) and self._already_carries(obj, rendered):
            result = "unchanged"  # a resync or a restarted operator that found no drift sends nothing
        else:
            result, answer = self._apply_injection(obj, rendered, state)
        if result in ("applied", "unchanged"):
            for warning in rendered.warnings:
                self.events.post(obj, "Warning", "KvoffloadManualStep", warning, state)
            done = {fingerprint}
            if result == "applied" and answer is not None:
                # The apply raised the generation. If the object it returned is a fixed point (the
                # renderer gives the same fragment and the object carries it), the event for that
                # generation has nothing to do either: remember both as done.
                again = self._replan(answer, plan)
                answer_meta = answer.get("metadata") or {}
                if (not isinstance(again, PolicyError) and again.config_hash == rendered.config_hash
                        and object_carries(again.workload_apply, answer)):  # fmt: skip
                    done.add((answer_meta.get("generation"),
                              _ours_annotations(answer_meta.get("annotations") or {}), *fingerprint[2:]))  # fmt: skip
            with self._lock:
                self._done[uid] = frozenset(done)
            self.metrics.mark_injected(kind, uid, True)
            self._touch_policy(obj)
        return result

    def _plan(self, obj: Mapping[str, Any], settings: InjectionSettings, state: str) -> InjectionPlan | str:
        """Choose the engine, fetch the user's options file if it lives in a ConfigMap, plan: once
        per pass. A refusal is posted and its result label returned."""
        engine = choose_engine(obj, settings)
        if isinstance(engine, PolicyError):
            return self._reject(obj, engine, state)
        user_options: str | None = None
        source = engine.user_options_source
        if source is not None:
            cm = self.kube.get(configmap_path(str((obj.get("metadata") or {}).get("namespace")), source.configmap))
            user_options = ((cm or {}).get("data") or {}).get(source.key)
            if user_options is None:
                what = "does not exist" if cm is None else f"has no key {source.key!r}"
                return self._reject(obj, PolicyError(
                    f"ConfigMap {source.configmap}", source.key,
                    f"the TensorRT-LLM options file {source.path} comes from it but it {what}",
                    reason="options_missing",
                ), state)  # fmt: skip
        wiring = node_cache_wiring(obj, settings) if settings.mode == "node" else None
        if isinstance(wiring, PolicyError):
            return self._reject(obj, wiring, state)
        plan = plan_injection(obj, settings, self.cluster, engine, user_options, wiring)
        return self._reject(obj, plan, state) if isinstance(plan, PolicyError) else plan

    def _replan(self, answer: Mapping[str, Any], plan: InjectionPlan) -> RenderedInjection | PolicyError:
        """The fragment for the object an apply returned, with the same settings and options file."""
        engine = choose_engine(answer, plan.settings)
        if isinstance(engine, PolicyError):
            return engine
        again = plan_injection(answer, plan.settings, self.cluster, engine, plan.user_options_yaml, plan.node_cache)
        return again if isinstance(again, PolicyError) else render(again)

    def _apply_injection(self, obj: Mapping[str, Any], rendered: RenderedInjection, state: str
                         ) -> tuple[str, Mapping[str, Any] | None]:  # fmt: skip
        """Apply the ConfigMap and the workload fragment; the result label and the object the
        apiserver returned (None when nothing was applied)."""
        kind = str(obj.get("kind"))
        meta = obj.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        try:
            self.kube.apply(configmap_path(namespace, configmap_name(name)), rendered.configmap_apply, c.FIELD_MANAGER)
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
            unforced = self._locked_apply(path, body, meta, force=False)
            if unforced is None:
                log.info("%s changed while reconciling; the next event carries the new version", _ref(obj))
                return "skipped", None
            answer = unforced
        except KubeApiError as exc:
            if exc.status == 422 and self._changed_since(path, meta):
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
            forced_answer = self._locked_apply(path, body, meta, force=True)
            if forced_answer is None:
                log.info("%s changed while reconciling; the next event carries the new version", _ref(obj))
                return "skipped", None
            answer = forced_answer
        changed = (answer.get("metadata") or {}).get("generation") != meta.get("generation")
        if changed:
            self.events.post(
                obj, "Normal", "KvoffloadInjected",
                f"injected the kvoffload cache sidecar and connector into container {rendered.engine_container} "
                f"(config hash {rendered.config_hash})", rendered.config_hash,
            )  # fmt: skip
            log.info("injected %s hash=%s", _ref(obj), rendered.config_hash)
        return ("applied" if changed else "unchanged"), answer

    def _locked_apply(self, path: str, body: Mapping[str, Any], meta: Mapping[str, Any], force: bool
                      ) -> dict[str, Any] | None:  # fmt: skip
        """Apply locked to a version whose spec and kvoffload annotations are those the fragment was
        computed from; status writes in between only refresh the lock (a few tries). None: the
        inputs changed (the next event carries them). Field conflicts are raised to the caller."""
        locked = copy.deepcopy(dict(body))
        version = meta.get("resourceVersion")
        ours = _ours_annotations(meta.get("annotations") or {})
        for _attempt in range(LOCKED_APPLY_TRIES):
            locked["metadata"]["resourceVersion"] = version
            try:
                return self.kube.apply(path, locked, c.FIELD_MANAGER, force=force)
            except KubeApiError as exc:
                if exc.status != 409 or exc.field_conflicts:
                    raise
            current = self.kube.get(path)
            current_meta = (current or {}).get("metadata") or {}
            if (current is None or current_meta.get("generation") != meta.get("generation")
                    or _ours_annotations(current_meta.get("annotations") or {}) != ours):  # fmt: skip
                return None
            version = current_meta.get("resourceVersion")
        return None

    def _already_carries(self, obj: Mapping[str, Any], rendered: RenderedInjection) -> bool:
        """Whether the live workload and its ConfigMap hold every field the apply would set."""
        if not object_carries(rendered.workload_apply, obj):
            return False
        meta = obj.get("metadata") or {}
        cm = self.kube.get(configmap_path(str(meta.get("namespace")), configmap_name(str(meta.get("name")))))
        return object_carries(rendered.configmap_apply, cm)

    def _changed_since(self, path: str, meta: Mapping[str, Any]) -> bool:
        """Whether the object's spec moved on from the version a fragment was computed from."""
        current = self.kube.get(path)
        return current is not None and (current.get("metadata") or {}).get("generation") != meta.get("generation")

    def _remove(self, obj: Mapping[str, Any]) -> str:
        kind = str(obj.get("kind"))
        meta = obj.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        path = workload_path(kind, namespace, name)
        current: Mapping[str, Any] = obj
        for _attempt in range(LOCKED_APPLY_TRIES):
            plan = render_removal(current)
            if not plan.steps:
                return "noop"
            try:
                self._apply_removal(path, plan, (current.get("metadata") or {}).get("resourceVersion"))
                break
            except KubeApiError as exc:
                if exc.status != 409:
                    raise
                if exc.field_conflicts:
                    return self._conflict(obj, exc, f"{kind} {name}", "removal")
            # The plan was made from a stale version (often our own removal's intermediate
            # state, delivered late): plan again from the live object, which may need nothing.
            live = self.kube.get(path)
            if live is None or enabled_state((live.get("metadata") or {}).get("annotations") or {}) is not False:
                log.info("%s changed while removing; the next event carries the new version", _ref(obj))
                return "skipped"
            current = {"kind": kind, **live}
        else:
            log.info("%s kept changing while removing; the next event retries", _ref(obj))
            return "skipped"
        cm = self.kube.get(configmap_path(namespace, configmap_name(name)))
        if cm and ((cm.get("metadata") or {}).get("labels") or {}).get(c.LABEL_MANAGED_BY) == c.LABEL_MANAGED_BY_VALUE:
            self.kube.delete(configmap_path(namespace, configmap_name(name)))
        uid = str(meta.get("uid"))
        with self._lock:
            self._done.pop(uid, None)
        self.metrics.mark_injected(kind, uid, False)
        self.events.post(
            obj, "Normal", "KvoffloadRemoved", "removed the kvoffload injection", str(meta.get("generation"))
        )
        log.info("removed injection from %s", _ref(obj))
        self._touch_policy(obj)
        return "removed"

    def _apply_removal(self, path: str, plan: RemovalPlan, version: str | None) -> None:
        """Apply the removal steps; the first is locked to the version the plan was made from
        (a stale plan would re-claim fields and loop on its own intermediate writes)."""
        for index, step in enumerate(plan.steps):
            body = copy.deepcopy(step.body)
            if index == 0 and version:
                body["metadata"]["resourceVersion"] = version
            self.kube.apply(path, body, step.field_manager, force=False)

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

    def _policy_for(self, obj: Mapping[str, Any]) -> dict[str, Any] | None:
        meta = obj.get("metadata") or {}
        name = policy_name(meta.get("annotations") or {})
        if not isinstance(name, str):
            return None
        namespace = str(meta.get("namespace"))
        with self._lock:
            cached = self.policies.get((namespace, name))
        if cached is not None:
            return cached
        try:
            found = self.kube.get(policy_path(namespace, name))
        except KubeApiError as exc:
            if exc.status in (403, 404):  # CRD absent or not readable: same as a missing policy
                return None
            raise
        if found is not None:
            with self._lock:
                self.policies[(namespace, name)] = found
        return found

    def policy_changed(self, policy: Mapping[str, Any], deleted: bool = False) -> None:
        """A KVCachePolicy appeared, changed or went away: re-reconcile the workloads naming it."""
        meta = policy.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        with self._lock:
            previous = self.policies.get(key)
            if deleted:
                self.policies.pop(key, None)
            else:
                self.policies[key] = copy.deepcopy(dict(policy))
        same_spec = (
            previous is not None
            and not deleted
            and (previous.get("metadata") or {}).get("generation") == meta.get("generation")
        )
        if not same_spec:
            for workload in self._workloads_naming(*key):
                self.reconcile(workload)
        if not deleted:
            self.sync_node_caches(*key)
            self.refresh_policy_status(*key)

    def sync_node_caches(self, namespace: str, name: str) -> None:
        """Node mode: one cache pod on each node running the policy's engine pods, no other."""
        if self.node_caches is None:
            return
        retry_key = ("node-caches", namespace, name)
        try:
            self.node_caches.sync(namespace, name)
        except KubeApiError as exc:
            log.warning("node caches %s/%s: %s (retrying)", namespace, name, exc)
            self.metrics.errors.labels(kind=c.POLICY_KIND, reason="api_error").inc()
            self.retries.schedule(retry_key, lambda: self.sync_node_caches(namespace, name), time.monotonic())
        else:
            self.retries.succeeded(retry_key)
        self.metrics.retry_queue.set(len(self.retries))
        with self._lock:
            self._dirty_policies.add((namespace, name))

    def recheck_node_caches(self) -> None:
        """Node mode: one level-triggered pass per known policy (two LISTs each; no write unless
        a cache pod is missing or stranded), whatever events were missed."""
        if self.node_caches is None:
            return
        with self._lock:
            known = sorted(self.policies)
        for namespace, name in known:
            self.sync_node_caches(namespace, name)

    def _workloads_naming(self, namespace: str, name: str) -> Iterable[dict[str, Any]]:
        for kind in SUPPORTED_KINDS:
            listing = self.kube.request("GET", workload_path(kind, namespace))
            for item in listing.get("items") or []:
                item.setdefault("apiVersion", "apps/v1")
                item.setdefault("kind", kind)
                if ((item.get("metadata") or {}).get("annotations") or {}).get(c.ANN_POLICY) == name:
                    yield item

    def _touch_policy(self, obj: Mapping[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        name = policy_name(meta.get("annotations") or {})
        if isinstance(name, str):
            with self._lock:
                self._dirty_policies.add((str(meta.get("namespace")), name))

    def flush_policy_status(self) -> None:
        """Refresh the status of policies whose workloads changed (called periodically)."""
        with self._lock:
            dirty, self._dirty_policies = self._dirty_policies, set()
        for key in sorted(dirty):
            try:
                self.refresh_policy_status(*key)
            except KubeApiError as exc:
                if exc.status == 404:  # the policy or its namespace is gone
                    continue
                log.warning("policy status %s/%s: %s (retrying)", *key, exc)
                with self._lock:
                    self._dirty_policies.add(key)

    def refresh_policy_status(self, namespace: str, name: str) -> None:
        policy = self.kube.get(policy_path(namespace, name))
        if policy is None:
            return
        workloads = []
        for item in self._workloads_naming(namespace, name):
            item_meta = item.get("metadata") or {}
            if enabled_state(item_meta.get("annotations") or {}) is not True:
                continue
            template_ann = (((item.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("annotations")
            workloads.append({
                "kind": item["kind"], "name": item_meta.get("name"),
                "configHash": (template_ann or {}).get(c.ANN_CONFIG_HASH, ""),
            })  # fmt: skip
        workloads.sort(key=lambda w: (w["kind"], w["name"]))
        node_caches = None
        if self.node_caches is not None:
            node_caches = self.node_caches.status(namespace, name)
        status = desired_policy_status(policy, self.defaults, workloads, node_caches)
        current = policy.get("status") or {}
        if _same_status(current, status):
            return
        _keep_transition_times(current, status)
        self.kube.merge_patch(policy_path(namespace, name) + "/status", {"status": status}, c.FIELD_MANAGER)

    def resync(self) -> None:
        """Reconcile every opted-in workload and every known policy's node caches regardless of
        the cache (drift in inputs we do not watch, events lost while the watch reconnected)."""
        for kind in SUPPORTED_KINDS:
            items: list[dict[str, Any]] = []
            for namespace in self.namespaces or ("",):
                items += self.kube.request("GET", workload_path(kind, namespace)).get("items") or []
            for item in items:
                item.setdefault("apiVersion", "apps/v1")
                item.setdefault("kind", kind)
                annotations = (item.get("metadata") or {}).get("annotations") or {}
                if c.ANN_ENABLED in annotations:
                    self.reconcile(item, force=True)
        self.recheck_node_caches()


def desired_policy_status(policy: Mapping[str, Any], defaults: OperatorDefaults, workloads: list[dict[str, Any]],
                          node_caches: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """The status a KVCachePolicy should show: a Ready condition, its attached workloads and
    (node mode) each node's cache pod with its readiness."""
    meta = policy.get("metadata") or {}
    check = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: str(meta.get("name"))}, policy, defaults)
    ok = not isinstance(check, PolicyError)
    condition = {
        "type": READY,
        "status": "True" if ok else "False",
        "reason": "Valid" if ok else "Invalid",
        "message": f"{len(workloads)} workload(s) use this policy" if ok else check.message,  # type: ignore[union-attr]
        "observedGeneration": meta.get("generation"),
        "lastTransitionTime": _now(),
    }
    status: dict[str, Any] = {
        "observedGeneration": meta.get("generation"),
        "conditions": [condition],
        "workloads": workloads,
        "workloadCount": len(workloads),
    }
    if node_caches is not None:
        status["nodeCaches"] = node_caches
    return status


def _same_status(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    def strip(status: Mapping[str, Any]) -> Any:
        out = copy.deepcopy(dict(status))
        for cond in out.get("conditions") or []:
            cond.pop("lastTransitionTime", None)
        return out

    return bool(strip(current) == strip(desired))


def _keep_transition_times(current: Mapping[str, Any], desired: dict[str, Any]) -> None:
    old = {cond.get("type"): cond for cond in current.get("conditions") or []}
    for cond in desired.get("conditions") or []:
        previous = old.get(cond["type"])
        if previous and previous.get("status") == cond["status"] and previous.get("lastTransitionTime"):
            cond["lastTransitionTime"] = previous["lastTransitionTime"]


def _ref(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{obj.get('kind')}/{meta.get('namespace')}/{meta.get('name')}"
