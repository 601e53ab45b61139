"""Where node mode's cache pods go, pure: the nodes running a policy's injected engine pods (and
the tolerations they need), the cache pods to create and delete to get there, whether its cache
keys are in use, and the policy's per-node status."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.node.cache_objects import policy_key, render_cache_pod

TERMINAL_PHASES = ("Succeeded", "Failed")


def _is_live(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") not in TERMINAL_PHASES


ENGINE_CONTROLLERS = ("ReplicaSet", "StatefulSet")
"""Kinds whose pods count as engines: the controllers of the Deployments and StatefulSets kvoffload injects."""


def _placed_by_injected_workload(pod: Mapping[str, Any]) -> bool:
    """A pod a workload controller made from a template (or admission) kvoffload injected: not a bare
    pod that put the policy label on itself."""
    meta = pod.get("metadata") or {}
    if (meta.get("labels") or {}).get(c.LABEL_INJECTED) != "true":
        return False
    owners = meta.get("ownerReferences") or []
    return any(o.get("controller") is True and o.get("kind") in ENGINE_CONTROLLERS for o in owners)


def engine_tolerations(policy_name: str, engine_pods: Iterable[Mapping[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """{node: the tolerations of the policy's engine pods there} for every node running at least one
    scheduled, not finished engine pod that an injected workload's controller placed."""
    nodes: dict[str, list[dict[str, Any]]] = {}
    for pod in engine_pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        spec = pod.get("spec") or {}
        node = spec.get("nodeName")
        if labels.get(c.LABEL_NODE_CACHE_POLICY) != policy_name or not node or not _is_live(pod):
            continue
        if not _placed_by_injected_workload(pod):
            continue
        known = nodes.setdefault(str(node), [])
        known.extend(dict(t) for t in spec.get("tolerations") or [] if dict(t) not in known)
    return {node: sorted(tols, key=lambda t: json.dumps(t, sort_keys=True)) for node, tols in nodes.items()}


def engine_nodes(policy_name: str, engine_pods: Iterable[Mapping[str, Any]]) -> list[str]:
    """Nodes that need a cache pod of the policy (see :func:`engine_tolerations`)."""
    return sorted(engine_tolerations(policy_name, engine_pods))


def desired_cache_pods(
    policy: Mapping[str, Any], settings: InjectionSettings, engine_pods: Iterable[Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """{node: cache pod manifest} for every node with an engine pod of ``policy``."""
    _, name = policy_key(policy)
    return {
        node: render_cache_pod(policy, settings, node, tolerations)
        for node, tolerations in sorted(engine_tolerations(name, engine_pods).items())
    }


@dataclass(frozen=True)
class CachePodPlan:
    """What to do to the cluster's cache pods: create these manifests, delete these pod names."""

    create: tuple[dict[str, Any], ...]
    delete: tuple[str, ...]


def cache_pod_node(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str((meta.get("annotations") or {}).get(c.ANN_CACHE_NODE) or (pod.get("spec") or {}).get("nodeName") or "")


def plan_cache_pods(desired: Mapping[str, Mapping[str, Any]], existing: Iterable[Mapping[str, Any]]) -> CachePodPlan:
    """Create the missing cache pods; delete those on nodes without engines, outdated or failed
    ones, and any second pod for a node. A pod still terminating blocks its name's re-creation
    (its deletion event triggers the next pass)."""
    kept: set[str] = set()
    delete: list[str] = []
    taken: set[str] = set()
    for pod in sorted(existing, key=lambda p: str((p.get("metadata") or {}).get("name"))):
        meta = pod.get("metadata") or {}
        pod_name = str(meta.get("name"))
        taken.add(pod_name)
        if meta.get("deletionTimestamp"):
            continue
        node = cache_pod_node(pod)
        want = desired.get(node)
        current = (meta.get("annotations") or {}).get(c.ANN_CONFIG_HASH)
        if (
            want is not None
            and node not in kept
            and _is_live(pod)
            and pod_name == want["metadata"]["name"]
            and current == want["metadata"]["annotations"][c.ANN_CONFIG_HASH]
        ):
            kept.add(node)
        else:
            delete.append(pod_name)
    create = tuple(
        copy.deepcopy(dict(manifest))
        for node, manifest in sorted(desired.items())
        if node not in kept and manifest["metadata"]["name"] not in taken
    )
    return CachePodPlan(create=create, delete=tuple(delete))


def _ready(pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(x.get("type") == "Ready" and x.get("status") == "True" for x in conditions)


def keys_in_use(existing: Iterable[Mapping[str, Any]]) -> bool:
    """Whether a ready cache pod of the policy stands: it mounted the policy's key Secret, so the
    operator need not ask for it again (it may not read Secrets, only create them)."""
    return any(_ready(p) and not (p.get("metadata") or {}).get("deletionTimestamp") for p in existing)


def node_cache_status(existing: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The policy status' ``nodeCaches``: each node's cache pod and whether it is ready."""
    rows = [
        {"node": cache_pod_node(p), "pod": str((p.get("metadata") or {}).get("name")), "ready": _ready(p)}
        for p in existing
        if not (p.get("metadata") or {}).get("deletionTimestamp")
    ]
    return sorted(rows, key=lambda r: (r["node"], r["pod"]))
