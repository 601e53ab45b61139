"""Which workload a pod belongs to, resolved through the API: the pod's controller reference, and
for a ReplicaSet that ReplicaSet's own controller reference, each checked by uid. A name is never
cut to guess an owner: a user's ReplicaSet ``llama-evil`` or a bare pod whose reference says
``llama-zzzzz`` is not Deployment ``llama``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.operator.api.kube import Kube, namespaced_path, workload_path


@dataclass(frozen=True)
class ControllerRef:
    kind: str
    name: str
    uid: str


@dataclass(frozen=True)
class Owner:
    """The Deployment or StatefulSet a pod belongs to, as it is now."""

    kind: str
    name: str
    workload: dict[str, Any]


def controller_ref(obj: Mapping[str, Any]) -> ControllerRef | None:
    """The object's controller ownerReference, if it has one."""
    ref = next((o for o in (obj.get("metadata") or {}).get("ownerReferences") or [] if o.get("controller")), None)
    if ref is None:
        return None
    return ControllerRef(str(ref.get("kind")), str(ref.get("name")), str(ref.get("uid")))


def _matches(obj: Mapping[str, Any] | None, ref: ControllerRef) -> bool:
    return obj is not None and str((obj.get("metadata") or {}).get("uid")) == ref.uid


def resolve_owner(kube: Kube, pod: Mapping[str, Any], namespace: str) -> Owner | str:
    """The pod's Deployment (through its ReplicaSet) or StatefulSet, or why it has none: each link
    is read from the API and must carry the uid the reference names."""
    ref = controller_ref(pod)
    if ref is None:
        return "the pod has no controller"
    if ref.kind == "StatefulSet":
        workload = kube.get(workload_path("StatefulSet", namespace, ref.name))
        return Owner("StatefulSet", ref.name, workload) if workload and _matches(workload, ref) else (
            f"StatefulSet {ref.name} named by the pod is not there")  # fmt: skip
    if ref.kind != "ReplicaSet":
        return f"its controller is a {ref.kind}, not a Deployment's ReplicaSet or a StatefulSet"
    replica_set = kube.get(namespaced_path("/apis/apps/v1", "replicasets", namespace, ref.name))
    if replica_set is None or not _matches(replica_set, ref):
        return f"ReplicaSet {ref.name} named by the pod is not there"
    parent = controller_ref(replica_set)
    if parent is None or parent.kind != "Deployment":
        return f"ReplicaSet {ref.name} is not controlled by a Deployment"
    workload = kube.get(workload_path("Deployment", namespace, parent.name))
    if workload is None or not _matches(workload, parent):
        return f"Deployment {parent.name} named by ReplicaSet {ref.name} is not there"
    return Owner("Deployment", parent.name, workload)
