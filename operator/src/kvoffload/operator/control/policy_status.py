"""A KVCachePolicy's status, decided: its Ready condition, attached workloads and node caches. Pure."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.intent.settings import OperatorDefaults, resolve_settings
from kvoffload.policy_values import PolicyError

READY = "Ready"


def desired_policy_status(policy: Mapping[str, Any], defaults: OperatorDefaults, workloads: list[dict[str, Any]],
                          node_caches: list[dict[str, Any]] | None = None, *, now: str) -> dict[str, Any]:  # fmt: skip
    """The status a KVCachePolicy should show at time ``now`` (RFC 3339): a Ready condition, its
    attached workloads and (node mode) each node's cache pod with its readiness."""
    meta = policy.get("metadata") or {}
    check = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: str(meta.get("name"))}, policy, defaults)
    ok = not isinstance(check, PolicyError)
    condition = {
        "type": READY,
        "status": "True" if ok else "False",
        "reason": "Valid" if ok else "Invalid",
        "message": f"{len(workloads)} workload(s) use this policy" if ok else check.message,  # type: ignore[union-attr]
        "observedGeneration": meta.get("generation"),
        "lastTransitionTime": now,
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


def same_status(current: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Equal but for the conditions' transition times."""

    def strip(status: Mapping[str, Any]) -> Any:
        out = copy.deepcopy(dict(status))
        for cond in out.get("conditions") or []:
            cond.pop("lastTransitionTime", None)
        return out

    return bool(strip(current) == strip(desired))


def keep_transition_times(current: Mapping[str, Any], desired: dict[str, Any]) -> None:
    """A condition whose status did not change keeps the time it last changed."""
    old = {cond.get("type"): cond for cond in current.get("conditions") or []}
    for cond in desired.get("conditions") or []:
        previous = old.get(cond["type"])
        if previous and previous.get("status") == cond["status"] and previous.get("lastTransitionTime"):
            cond["lastTransitionTime"] = previous["lastTransitionTime"]
