"""Admission mode's catch-up: pods of an opted-in workload that were created without the injection
(the webhook was down or could not be reached, so its ``failurePolicy: Ignore`` admitted them as the
user wrote them) are evicted, one at a time per workload, so their controller creates them again
through the webhook. Evictions honour PodDisruptionBudgets; repeated ones back off.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload import contract as c

from .admission import pod_owner
from .events import EventRecorder, now_timestamp
from .kube import Kube, KubeApiError, namespaced_path
from .metrics import OperatorMetrics

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


def workload_key(pod: Mapping[str, Any]) -> tuple[str, str, str] | None:
    """(namespace, kind, name) of the pod's Deployment or StatefulSet, if it has one."""
    owner = pod_owner(pod)
    return None if owner is None else (str((pod.get("metadata") or {}).get("namespace")), *owner)


def _workload_ref(namespace: object, kind: str, name: str) -> dict[str, Any]:
    """Enough of a workload for an Event about it."""
    return {"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name, "namespace": namespace}}


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


def evictions(pods: Iterable[Mapping[str, Any]]) -> list[tuple[tuple[str, str, str], Mapping[str, Any]]]:
    """((namespace, kind, name) of the workload, pod) to evict now: per workload the oldest pod
    without the injection, and none while another of its pods is starting or terminating."""
    groups: dict[tuple[str, str, str], list[Mapping[str, Any]]] = {}
    for pod in pods:
        key = workload_key(pod)
        if key is not None:
            groups.setdefault(key, []).append(pod)
    chosen = []
    for key, group in sorted(groups.items()):
        behind = sorted((p for p in group if uninjected(p)),
                        key=lambda p: (str((p.get("metadata") or {}).get("creationTimestamp")),
                                       str((p.get("metadata") or {}).get("name"))))  # fmt: skip
        busy = any((p.get("metadata") or {}).get("deletionTimestamp") or (not uninjected(p) and not _ready(p))
                   for p in group)  # fmt: skip
        if behind and not busy:
            chosen.append((key, behind[0]))
    return chosen


@dataclass
class PodAlignment:
    """Evicts pods created without the injection (see the module docstring)."""

    kube: Kube
    events: EventRecorder
    metrics: OperatorMetrics
    namespaces: Sequence[str] = ()
    _next: dict[tuple[str, str, str], float] = field(default_factory=dict)
    _evicted_at: dict[tuple[str, str, str], str] = field(default_factory=dict)
    """When each workload last had a pod evicted (a pod created since without the injection: the webhook still fails)."""
    _delay: dict[tuple[str, str, str], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _pods(self, namespace: str | None) -> list[dict[str, Any]]:
        params = {"labelSelector": c.LABEL_INJECT}
        spaces = [namespace] if namespace else list(self.namespaces) or [""]
        items: list[dict[str, Any]] = []
        for ns in spaces:
            path = namespaced_path("/api/v1", "pods", ns) if ns else "/api/v1/pods"
            items.extend(self.kube.request("GET", path, params=params).get("items") or [])
        return items

    def report_start_failure(self, pod: Mapping[str, Any]) -> bool:
        """A Warning on the pod's workload when a kvoffload container cannot start; True if posted."""
        failure, key = start_failure(pod), workload_key(pod)
        if failure is None or key is None:
            return False
        meta = pod.get("metadata") or {}
        self.events.post(
            _workload_ref(*key), "Warning", "KvoffloadInvalid",
            f"pod {meta.get('name')} cannot start {failure}; a KVCachePolicy's l2.redis.passwordSecretRef must name "
            "a Secret and key that exist in the workload's namespace (the operator cannot check before the pod: "
            "it has no right to read Secrets)", failure,
        )  # fmt: skip
        return True

    def behind_in(self, namespace: str) -> bool:
        """Whether a workload in ``namespace`` had a pod evicted and may have more to go (a pod event
        there may let the next eviction go)."""
        with self._lock:
            return any(key[0] == namespace for key in self._evicted_at)

    def align(self, namespace: str | None = None) -> int:
        """Evict what :func:`evictions` picks in ``namespace`` (None: every watched one); returns how many.

        A workload whose replacement pod came back without the injection too (the webhook is still
        not reached) waits 15 s, then twice as long each time, up to 10 min.
        """
        pods = self._pods(namespace)
        behind = {workload_key(p) for p in pods if uninjected(p)} - {None}
        now = time.monotonic()
        with self._lock:
            for key in list(self._evicted_at):
                if key not in behind and (namespace is None or key[0] == namespace):
                    for table in (self._evicted_at, self._delay, self._next):  # caught up
                        table.pop(key, None)
        evicted = 0
        for key, pod in evictions(pods):
            with self._lock:
                since = self._evicted_at.get(key)
                again = since is not None and any(
                    uninjected(p)
                    and workload_key(p) == key
                    and str(p["metadata"].get("creationTimestamp", "")) >= since
                    for p in pods
                )
                if again:
                    if now < self._next.get(key, 0.0):
                        continue
                    self._delay[key] = min(self._delay.get(key, BACKOFF_START_S / 2) * 2, BACKOFF_MAX_S)
                    self._next[key] = now + self._delay[key]
                self._evicted_at[key] = now_timestamp()
            if self._evict(key, pod):
                evicted += 1
        return evicted

    def _evict(self, key: tuple[str, str, str], pod: Mapping[str, Any]) -> bool:
        namespace, kind, name = key
        pod_name = str((pod.get("metadata") or {}).get("name"))
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod_name, "namespace": namespace}}
        try:
            self.kube.create(namespaced_path("/api/v1", "pods", namespace, pod_name) + "/eviction", body)
        except KubeApiError as exc:
            if exc.status in (404, 409):
                return False  # gone already
            if exc.status == 429:
                log.info("pod %s/%s: eviction refused by a PodDisruptionBudget; trying later", namespace, pod_name)
                return False
            raise
        self.metrics.evictions.inc()
        log.info("evicted pod %s/%s of %s %s: created without the injection", namespace, pod_name, kind, name)
        self.events.post(
            _workload_ref(namespace, kind, name), "Warning", "KvoffloadNotInjected",
            f"pod {pod_name} was created without the kvoffload injection (the webhook was not reached); "
            "evicted so that it is created again through the webhook", pod_name,
        )  # fmt: skip
        return True
