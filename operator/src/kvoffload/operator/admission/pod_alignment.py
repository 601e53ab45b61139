"""Admission mode's catch-up: pods of an opted-in workload that were created without the injection
(the webhook was down or could not be reached, so its ``failurePolicy: Ignore`` admitted them as the
user wrote them) are evicted, one at a time per workload, so their controller creates them again
through the webhook. Evictions honour PodDisruptionBudgets; refused and repeated ones back off.

Only a pod the webhook would inject now is evicted: its owner, resolved through the API, is opted
in and carries a record kvoffload wrote, and that record renders for the pod. A workload that is
refused, not opted in, or whose record another manager wrote (``kubectl rollout undo``) is left
running as written; evicting it would only bring the same pod back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.admission.records import injected_pod, record_from_workload
from kvoffload.operator.api.events import EventRecorder, now_timestamp
from kvoffload.operator.api.kube import Kube, KubeApiError, namespaced_path
from kvoffload.operator.api.pod_owners import ControllerRef, Owner, controller_ref, resolve_owner
from kvoffload.operator.intent.workload import WorkloadRef
from kvoffload.operator.metrics import OperatorMetrics
from kvoffload.operator.plan.injection_record import InjectionRecord
from kvoffload.policy_values import PolicyError

log = logging.getLogger("kvoffload.operator")
BACKOFF_START_S = 15.0
BACKOFF_MAX_S = 600.0


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(x.get("type") == "Ready" and x.get("status") == "True" for x in conditions)


def uninjected(pod: Mapping[str, Any]) -> bool:
    """A live pod whose template asks for the injection and that does not carry it."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    return c.LABEL_INJECT in labels and labels.get(c.LABEL_INJECTED) != "true" and not meta.get("deletionTimestamp")


def start_failure(pod: Mapping[str, Any]) -> str | None:
    """What keeps a kvoffload container of the pod from starting, as the kubelet reports it
    (``CreateContainerConfigError``: a Secret or key the injected env names is missing), if anything."""
    status = pod.get("status") or {}
    for entry in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (entry.get("state") or {}).get("waiting") or {}
        if (
            str(entry.get("name", "")).startswith("kvoffload-")
            and waiting.get("reason") == "CreateContainerConfigError"
        ):
            return f"container {entry.get('name')}: {waiting.get('message') or waiting.get('reason')}"
    return None


def why_left_as_written(pod: Mapping[str, Any], owner: Owner, namespace: str) -> str | None:
    """Why an uninjected pod of ``owner`` must not be evicted (None: the webhook would inject its
    replacement, so evict it)."""
    record = record_from_workload(owner.workload, owner.kind, owner.name)
    if not isinstance(record, InjectionRecord):
        return record
    template_labels = ((owner.workload.get("spec") or {}).get("template") or {}).get("metadata", {}).get("labels", {})
    if ((pod.get("metadata") or {}).get("labels") or {}).get(c.LABEL_INJECT) != template_labels.get(c.LABEL_INJECT):
        return "a pod of an older template: the rollout under way replaces it"
    injected = injected_pod(pod, owner.kind, owner.name, namespace, record)
    return injected.message if isinstance(injected, PolicyError) else None


def _created(pod: Mapping[str, Any]) -> tuple[str, str]:
    meta = pod.get("metadata") or {}
    return str(meta.get("creationTimestamp")), str(meta.get("name"))


def next_eviction(owner: Owner, pods: Sequence[Mapping[str, Any]], namespace: str) -> Mapping[str, Any] | None:
    """The one pod of ``owner`` to evict now, if any: the oldest uninjected one the webhook would
    inject, and only while every other pod the workload wants is there and ready (an eviction
    makes at most one pod of it unavailable)."""
    behind = sorted((p for p in pods if uninjected(p)), key=_created)
    if not behind:
        return None
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    wanted = (owner.workload.get("spec") or {}).get("replicas", 1)
    if len(live) < len(pods) or sum(1 for p in live if _ready(p)) < max(int(wanted or 0), len(live)):
        return None  # a pod is terminating, starting or missing: wait until it is back
    for pod in behind:
        if why_left_as_written(pod, owner, namespace) is None:
            return pod
    return None


WorkloadKey = tuple[str, str, str]
"""(namespace, kind, name) of a Deployment or StatefulSet."""


@dataclass
class OwnersSeen:
    """Each pod controller's workload, resolved through the API once per alignment pass (a pass
    over a namespace of many workloads reads each ReplicaSet and workload once, not once per
    workload it aligns)."""

    kube: Kube
    _resolved: dict[tuple[str, ControllerRef], Owner | str] = field(default_factory=dict)

    def owner(self, pod: Mapping[str, Any], namespace: str) -> Owner | str:
        ref = controller_ref(pod)
        if ref is None:
            return "the pod has no controller"
        key = (namespace, ref)
        if key not in self._resolved:
            self._resolved[key] = resolve_owner(self.kube, pod, namespace)
        return self._resolved[key]


def by_workload(
    pods: Sequence[dict[str, Any]], owners: OwnersSeen
) -> dict[WorkloadKey, tuple[Owner, list[dict[str, Any]]]]:
    """The pods grouped by the workload each belongs to; pods of anything else are left out, so
    never evicted."""
    groups: dict[WorkloadKey, tuple[Owner, list[dict[str, Any]]]] = {}
    for pod in pods:
        namespace = str(pod["metadata"].get("namespace"))
        owner = owners.owner(pod, namespace)
        if not isinstance(owner, str):
            groups.setdefault((namespace, owner.kind, owner.name), (owner, []))[1].append(pod)
    return groups


def match_labels_selector(workload: Mapping[str, Any]) -> str:
    """The workload's ``spec.selector.matchLabels`` as a label selector (its pods and maybe others';
    empty when it has none): the pods a pass over it lists."""
    labels = ((workload.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if isinstance(v, str))


@dataclass
class PodAlignment:
    """Evicts pods created without the injection (see the module docstring)."""

    kube: Kube
    events: EventRecorder
    metrics: OperatorMetrics
    namespaces: Sequence[str] = ()
    _next: dict[WorkloadKey, float] = field(default_factory=dict)
    _evicted_at: dict[WorkloadKey, str] = field(default_factory=dict)
    """When each workload last had a pod evicted (a pod created since without the injection: the webhook still fails)."""
    _delay: dict[WorkloadKey, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workload_locks: dict[WorkloadKey, threading.Lock] = field(default_factory=dict)
    """One pass at a time per workload: kopf's worker threads and the background thread all align."""

    def _pods(self, namespace: str | None, selector: str = "") -> list[dict[str, Any]]:
        """The live pods that carry ``LABEL_INJECT`` (and match ``selector``, a label selector) in
        ``namespace`` (None: every watched one)."""
        params = {"labelSelector": ",".join(filter(None, (c.LABEL_INJECT, selector)))}
        spaces = [namespace] if namespace else list(self.namespaces) or [""]
        items: list[dict[str, Any]] = []
        for ns in spaces:
            path = namespaced_path("/api/v1", "pods", ns) if ns else "/api/v1/pods"
            items.extend(self.kube.request("GET", path, params=params).get("items") or [])
        return items

    def report_start_failure(self, pod: Mapping[str, Any]) -> bool:
        """A Warning on the pod's workload when a kvoffload container cannot start; True if posted."""
        failure = start_failure(pod)
        if failure is None:
            return False
        meta = pod.get("metadata") or {}
        owner = resolve_owner(self.kube, pod, str(meta.get("namespace")))
        if isinstance(owner, str):
            return False
        self.events.post(
            WorkloadRef(owner.kind, str(meta.get("namespace")), owner.name), "Warning", "KvoffloadInvalid",
            f"pod {meta.get('name')} cannot start {failure}; a KVCachePolicy's l2.redis.passwordSecretRef must name "
            "a Secret and key that exist in the workload's namespace (the operator cannot check before the pod: "
            "it has no right to read Secrets)", failure,
        )  # fmt: skip
        return True

    def pod_changed(self, pod: Mapping[str, Any]) -> None:
        """A pod of an admission-mode workload changed: report a kvoffload container that cannot start,
        and evict the pod (or a sibling) if it was created uninjected or its namespace is behind."""
        namespace = str((pod.get("metadata") or {}).get("namespace"))
        self.report_start_failure(pod)
        if not (uninjected(pod) or self.behind_in(namespace)):
            return
        owners = OwnersSeen(self.kube)  # read now: the pass below reads this workload's owners from it
        owner = owners.owner(pod, namespace)
        if not isinstance(owner, str):  # else not a workload's pod: never evicted
            self._align_if_free((namespace, owner.kind, owner.name), owner, owners)

    def behind_in(self, namespace: str) -> bool:
        """Whether a workload in ``namespace`` had a pod evicted and may have more to go (a pod event
        there may let the next eviction go)."""
        with self._lock:
            return any(key[0] == namespace for key in self._evicted_at)

    def _workload_locks_for(self, key: WorkloadKey) -> threading.Lock:
        with self._lock:
            return self._workload_locks.setdefault(key, threading.Lock())

    def align(self, namespace: str | None = None) -> int:
        """Evict what :func:`next_eviction` picks per workload in ``namespace`` (None: every watched
        one); returns how many.

        A workload whose replacement pod came back without the injection too (the webhook is still
        not reached), or whose eviction a PodDisruptionBudget refused, waits 15 s, then twice as
        long each time, up to 10 min.
        """
        pods = self._pods(namespace)
        if not any(uninjected(p) for p in pods):
            self._caught_up(set(), namespace)
            return 0
        owners = OwnersSeen(self.kube)
        groups = by_workload(pods, owners)
        self._caught_up({k for k, (_o, members) in groups.items() if any(uninjected(p) for p in members)}, namespace)
        evicted = 0
        for key, (owner, members) in sorted(groups.items()):
            if any(uninjected(p) for p in members):
                # Its owners read again, fresh, just before deciding (this pass's may be seconds old).
                evicted += self._align_if_free(key, owner, OwnersSeen(self.kube))
        return evicted

    def _align_if_free(self, key: WorkloadKey, owner: Owner, owners: OwnersSeen) -> int:
        """``_align_workload`` under the workload's lock; 0 when another thread is aligning it now."""
        lock = self._workload_locks_for(key)
        if not lock.acquire(blocking=False):
            return 0
        try:
            return self._align_workload(key, owner, owners)
        finally:
            lock.release()

    def _caught_up(self, behind: set[WorkloadKey], namespace: str | None) -> None:
        with self._lock:
            for key in {*self._evicted_at, *self._delay}:
                if key not in behind and (namespace is None or key[0] == namespace):
                    for table in (self._evicted_at, self._delay, self._next):
                        table.pop(key, None)

    def _align_workload(self, key: WorkloadKey, owner: Owner, owners: OwnersSeen) -> int:
        """One workload's pass under its lock, from a fresh read of its pods (those ``owner``'s
        selector matches whose controller ``owners``, just read, resolves to it): an eviction another
        pass just made shows as a terminating pod, so no second one follows it."""
        namespace = key[0]
        pods = self._pods(namespace, match_labels_selector(owner.workload))
        group = by_workload(pods, owners).get(key)
        if group is None:
            return 0
        owner, pods = group
        pod = next_eviction(owner, pods, namespace)
        if pod is None:
            return 0
        now = time.monotonic()
        with self._lock:
            since = self._evicted_at.get(key)
            again = since is not None and any(uninjected(p) and _created(p)[0] >= since for p in pods)
            if (again or key in self._delay) and now < self._next.get(key, 0.0):
                return 0
            if again:
                self._back_off(key, now)
            self._evicted_at[key] = now_timestamp()
        return 1 if self._evict(key, pod) else 0

    def _back_off(self, key: WorkloadKey, now: float) -> float:
        """The next try for ``key`` waits 15 s, then twice as long each time, up to 10 min (lock held)."""
        self._delay[key] = min(self._delay.get(key, BACKOFF_START_S / 2) * 2, BACKOFF_MAX_S)
        self._next[key] = now + self._delay[key]
        return self._delay[key]

    def _evict(self, key: WorkloadKey, pod: Mapping[str, Any]) -> bool:
        namespace, kind, name = key
        pod_name = str((pod.get("metadata") or {}).get("name"))
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod_name, "namespace": namespace}}
        try:
            self.kube.create(namespaced_path("/api/v1", "pods", namespace, pod_name) + "/eviction", body)
        except KubeApiError as exc:
            if exc.status in (404, 409):
                return False  # gone already
            if exc.status == 429:
                self._refused(key, pod_name, exc)
                return False
            raise
        self.metrics.evictions.inc()
        log.info("evicted pod %s/%s of %s %s: created without the injection", namespace, pod_name, kind, name)
        self.events.post(
            WorkloadRef(kind, namespace, name), "Warning", "KvoffloadNotInjected",
            f"pod {pod_name} was created without the kvoffload injection (the webhook was not reached); "
            "evicted so that it is created again through the webhook", pod_name,
        )  # fmt: skip
        return True

    def _refused(self, key: WorkloadKey, pod_name: str, exc: KubeApiError) -> None:
        """A PodDisruptionBudget refused the eviction: counted, said once per pod, tried again later."""
        namespace, kind, name = key
        with self._lock:
            self._evicted_at.pop(key, None)
            delay = self._back_off(key, time.monotonic())
        self.metrics.eviction_refusals.inc()
        log.info("pod %s/%s: eviction refused by a PodDisruptionBudget; next try in %.0f s", namespace, pod_name, delay)
        self.events.post(
            WorkloadRef(kind, namespace, name), "Warning", "KvoffloadEvictionRefused",
            f"pod {pod_name} was created without the kvoffload injection, and its eviction (to create it again "
            f"through the webhook) was refused: {exc.message}; the operator tries again with backoff (15 s "
            "doubling to 10 min). A PodDisruptionBudget that allows no disruption keeps the pod uninjected",
            pod_name,
        )  # fmt: skip
