"""Who owns which field of a live object, read from ``metadata.managedFields`` (fieldsV1).

The workload is read through this (``read_workload``) to tell the user's own settings (owned by
another manager) from what the operator injected earlier (owned by
:data:`kvoffload.contract.FIELD_MANAGER`), so that a re-reconcile never mistakes its own output
for user input; the webhook asks single fields (``owned_by``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TEMPLATE_SPEC = ("f:spec", "f:template", "f:spec")
TEMPLATE_META = ("f:spec", "f:template", "f:metadata")


def _contains(tree: Mapping[str, Any], path: Sequence[str]) -> bool:
    node: Any = tree
    for part in path:
        if not isinstance(node, Mapping) or part not in node:
            return False
        node = node[part]
    return True


def owners(obj: Mapping[str, Any], path: Sequence[str]) -> set[str]:
    """Managers whose fieldsV1 contains ``path`` (the field itself or something beneath it)."""
    found: set[str] = set()
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        tree = entry.get("fieldsV1") or {}
        if _contains(tree, path):
            found.add(str(entry.get("manager", "")))
    return found


FieldOwners = dict[tuple[str, ...], frozenset[str]]
"""Every fieldsV1 path of an object (each field and each node above it) -> the managers holding it."""


def field_owners(obj: Mapping[str, Any]) -> FieldOwners | None:
    """Who holds which field, read once from ``managedFields``; None when the object has none (a
    manifest, not a live object: everything in it is the user's)."""
    entries = (obj.get("metadata") or {}).get("managedFields") or []
    if not entries:
        return None
    found: dict[tuple[str, ...], set[str]] = {}
    for entry in entries:
        manager = str(entry.get("manager", ""))
        stack: list[tuple[tuple[str, ...], Any]] = [((), entry.get("fieldsV1") or {})]
        while stack:
            path, node = stack.pop()
            if path:
                found.setdefault(path, set()).add(manager)
            if isinstance(node, Mapping):
                stack.extend(((*path, str(k)), v) for k, v in node.items())
    return {path: frozenset(managers) for path, managers in found.items()}


def owned_by(obj: Mapping[str, Any], path: Sequence[str], manager: str) -> bool:
    """Whether ``manager`` owns ``path``."""
    return manager in owners(obj, path)
