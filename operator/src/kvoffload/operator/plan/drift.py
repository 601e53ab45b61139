"""Whether a live object already carries everything an apply body sets.

The periodic resync re-checks every opted-in workload for drift in inputs the operator does not
watch (someone edited or deleted an injected field, the generated ConfigMap went away). Sending
the apply every time would be correct but costs two API writes per workload per resync; this
pure check lets a resync send nothing when nothing drifted. Only a full match skips the apply,
so a mismatch the check cannot judge (a value the apiserver normalised) costs one write, never a
missed drift. What the operator stopped rendering is caught through the config-hash annotation,
which every apply body carries and which changes with any rendered field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

LIST_MAP_KEYS = ("name", "mountPath", "containerPort", "devicePath")
"""Fields that identify an item of the pod spec's associative lists (containers, env, volumes,
volumeMounts, ports, volumeDevices); lists of other items must match item by item."""

APPLY_ONLY_KEYS = ("apiVersion", "kind")


def carries(desired: Any, live: Any) -> bool:
    """True when ``live`` holds every field of ``desired`` with the same value (extra fields allowed)."""
    if isinstance(desired, Mapping):
        return isinstance(live, Mapping) and all(k in live and carries(v, live[k]) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(live, list):
            return False
        if desired and all(isinstance(item, Mapping) for item in desired):
            return all(_carries_item(item, live) for item in desired)
        return desired == live  # scalars (args, command, capabilities): an atomic list
    return bool(desired == live)


def _carries_item(item: Mapping[str, Any], live_items: Sequence[Any]) -> bool:
    candidates = [x for x in live_items if isinstance(x, Mapping)]
    for key in LIST_MAP_KEYS:
        if key in item:
            candidates = [x for x in candidates if x.get(key) == item[key]]
            break
    return any(carries(item, x) for x in candidates)


def object_carries(apply_body: Mapping[str, Any], live: Mapping[str, Any] | None) -> bool:
    """``carries`` for a whole apply body against the live object (None: it does not exist)."""
    if live is None:
        return False
    body = {k: v for k, v in apply_body.items() if k not in APPLY_ONLY_KEYS}
    return carries(body, live)
