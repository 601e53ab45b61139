"""KVCachePolicies as the operator sees them: a cache fed by policy events, the workloads naming
each, its node-mode cache pods, and its status (desired by :mod:`.policy_status`, written here)."""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.api.events import now_timestamp
from kvoffload.operator.api.kube import Kube, KubeApiError, list_workloads, policy_path
from kvoffload.operator.api.retry import RetryQueue
from kvoffload.operator.control.policy_status import desired_policy_status, keep_transition_times, same_status
from kvoffload.operator.intent.settings import OperatorDefaults, enabled_state, policy_name
from kvoffload.operator.intent.workload import Workload
from kvoffload.operator.metrics import OperatorMetrics
from kvoffload.operator.node.caches import NodeCaches

log = logging.getLogger("kvoffload.operator")


@dataclass
class Policies:
    """The policy side of reconciling; shares the reconciler's API client, metrics and retry queue."""

    kube: Kube
    defaults: OperatorDefaults
    metrics: OperatorMetrics
    retries: RetryQueue
    node_caches: NodeCaches | None = None
    cache: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    _dirty: set[tuple[str, str]] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def remember(self, policy: Mapping[str, Any], deleted: bool) -> bool:
        """Cache a policy event; whether its spec changed (a new generation, or it came or went)."""
        meta = policy.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        with self._lock:
            previous = self.cache.get(key)
            if deleted:
                self.cache.pop(key, None)
            else:
                self.cache[key] = copy.deepcopy(dict(policy))
        return (
            previous is None or deleted or (previous.get("metadata") or {}).get("generation") != meta.get("generation")
        )

    def named(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The KVCachePolicy ``namespace/name`` (cached from policy events), or None."""
        with self._lock:
            cached = self.cache.get((namespace, name))
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
                self.cache[(namespace, name)] = found
        return found

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
            self._dirty.add((namespace, name))

    def recheck_node_caches(self) -> None:
        """Node mode: one level-triggered pass per known policy (two LISTs each; no write unless
        a cache pod is missing or stranded), whatever events were missed."""
        if self.node_caches is None:
            return
        with self._lock:
            known = sorted(self.cache)
        for namespace, name in known:
            self.sync_node_caches(namespace, name)

    def workloads_naming(self, namespace: str, name: str) -> Iterable[dict[str, Any]]:
        """The Deployments and StatefulSets whose ``kvoffload.io/policy`` names this policy."""
        for item in list_workloads(self.kube, (namespace,)):
            if ((item.get("metadata") or {}).get("annotations") or {}).get(c.ANN_POLICY) == name:
                yield item

    def touch(self, workload: Workload) -> None:
        """The workload changed: the status of the policy it names is refreshed at the next flush."""
        name = policy_name(workload.annotations)
        if isinstance(name, str):
            with self._lock:
                self._dirty.add((workload.ref.namespace, name))

    def flush_status(self) -> None:
        """Refresh the status of policies whose workloads changed (called periodically)."""
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        for key in sorted(dirty):
            try:
                self.refresh_status(*key)
            except KubeApiError as exc:
                if exc.status == 404:  # the policy or its namespace is gone
                    continue
                log.warning("policy status %s/%s: %s (retrying)", *key, exc)
                with self._lock:
                    self._dirty.add(key)

    def refresh_status(self, namespace: str, name: str) -> None:
        """Write the policy's status if it differs from the desired one."""
        policy = self.kube.get(policy_path(namespace, name))
        if policy is None:
            return
        workloads = []
        for item in self.workloads_naming(namespace, name):
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
        status = desired_policy_status(policy, self.defaults, workloads, node_caches, now=now_timestamp())
        current = policy.get("status") or {}
        if same_status(current, status):
            return
        keep_transition_times(current, status)
        self.kube.merge_patch(policy_path(namespace, name) + "/status", {"status": status}, c.FIELD_MANAGER)
