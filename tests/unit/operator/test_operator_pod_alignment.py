"""Admission mode's catch-up (``admission.pod_alignment``) reads the API in proportion to the
workloads it aligns: a pass over a namespace of many workloads whose pods came back uninjected (a
webhook outage) resolves each pod's ReplicaSet and Deployment once, and a pod event aligns only
that pod's workload. Counted against an in-memory apiserver of GETs and lists."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

import pytest

from kvoffload import contract as c
from kvoffload.operator.admission.pod_alignment import PodAlignment
from kvoffload.operator.api.events import EventRecorder
from kvoffload.operator.api.kube import KubeApiError, namespaced_path, workload_path
from kvoffload.operator.metrics import OperatorMetrics

pytestmark = pytest.mark.operator
NAMESPACE = "fleet"


def _meta(name: str, uid: str, owner: tuple[str, str, str] | None = None, **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "uid": uid, **extra}
    if owner is not None:
        kind, owner_name, owner_uid = owner
        meta["ownerReferences"] = [{"kind": kind, "name": owner_name, "uid": owner_uid, "controller": True}]
    return meta


class CountingApiserver:
    """Deployments, their ReplicaSets and one pod each (created without the injection), served to
    ``PodAlignment``: every GET and list counted."""

    def __init__(self, workloads: int) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.pods: list[dict[str, Any]] = []
        self.reads: Counter[str] = Counter()
        for i in range(workloads):
            name = f"app-{i}"
            labels = {"app": name, c.LABEL_INJECT: "h"}
            self.objects[workload_path("Deployment", NAMESPACE, name)] = {
                "metadata": _meta(name, f"d{i}", annotations={c.ANN_ENABLED: "true"}),
                "spec": {"replicas": 1, "selector": {"matchLabels": {"app": name}},
                         "template": {"metadata": {"labels": labels}}},
            }  # fmt: skip
            self.objects[namespaced_path("/apis/apps/v1", "replicasets", NAMESPACE, f"{name}-rs")] = {
                "metadata": _meta(f"{name}-rs", f"r{i}", ("Deployment", name, f"d{i}")),
            }
            self.pods.append({
                "metadata": _meta(f"{name}-rs-x", f"p{i}", ("ReplicaSet", f"{name}-rs", f"r{i}"), labels=labels,
                                  creationTimestamp="2026-12-07T00:00:00Z"),
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            })  # fmt: skip

    def get(self, path: str) -> dict[str, Any] | None:
        self.reads[path.split("/")[-2]] += 1
        return self.objects.get(path)

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                params: Mapping[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        assert method == "GET" and path == namespaced_path("/api/v1", "pods", NAMESPACE), (method, path)
        self.reads["pod lists"] += 1
        wanted = [term.split("=", 1) for term in (params or {}).get("labelSelector", "").split(",") if term]
        return {"items": [p for p in self.pods if all(
            k in p["metadata"]["labels"] and (not v or p["metadata"]["labels"][k] == v[0]) for k, *v in wanted)]}  # fmt: skip

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        raise KubeApiError(409, {}, "POST", path)  # no eviction goes through here

    def total(self) -> int:
        return sum(self.reads.values())


def alignment(api: CountingApiserver) -> PodAlignment:
    return PodAlignment(api, EventRecorder(api), OperatorMetrics(), (NAMESPACE,))  # type: ignore[arg-type]


@pytest.mark.parametrize("workloads", [10, 40])
def test_a_pass_over_a_namespace_of_uninjected_workloads_reads_each_owner_once(workloads: int) -> None:
    api = CountingApiserver(workloads)
    alignment(api).align(NAMESPACE)
    # One list of the namespace and each ReplicaSet and Deployment once, then per workload one list
    # of its own pods and a fresh read of its two owners. Before: every workload's pass listed the
    # whole namespace again and resolved every ReplicaSet in it (10: 231 reads, 40: 3,321).
    assert api.reads["replicasets"] == 2 * workloads, api.reads
    assert api.reads["deployments"] == 2 * workloads, api.reads
    assert api.total() <= 6 * workloads, api.reads


def test_a_pod_event_aligns_only_that_pods_workload() -> None:
    api = CountingApiserver(40)
    alignment(api).pod_changed(api.pods[7])
    # Before: the namespace's whole pass (3,321 reads here) at every such pod event.
    assert api.total() <= 6, api.reads
