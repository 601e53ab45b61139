"""Who owns which field of a live object, read from ``metadata.managedFields`` (fieldsV1).

The renderer uses this to tell the user's own settings (owned by another manager) from what
the operator injected earlier (owned by :data:`kvoffload.contract.FIELD_MANAGER`), so that a
re-reconcile never mistakes its own output for user input.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload import contract as c

TEMPLATE_SPEC = ("f:spec", "f:template", "f:spec")
TEMPLATE_META = ("f:spec", "f:template", "f:metadata")


def key(**fields: object) -> str:
    """The fieldsV1 key of one associative-list item, e.g. ``k:{"name":"trtllm"}``."""
    return "k:" + json.dumps(fields, separators=(",", ":"), sort_keys=True)


def container_path(list_name: str, name: str) -> tuple[str, ...]:
    """Path of one container (``containers`` or ``initContainers``) of a workload's pod template."""
    return (*TEMPLATE_SPEC, f"f:{list_name}", key(name=name))


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


def has_managed_fields(obj: Mapping[str, Any]) -> bool:
    """Whether the apiserver recorded field ownership at all (always true on a live object)."""
    return bool((obj.get("metadata") or {}).get("managedFields"))


def owned_by_others(obj: Mapping[str, Any], path: Sequence[str], manager: str) -> bool:
    """Whether someone other than ``manager`` owns ``path``.

    Without managedFields (a manifest, not a live object) everything present is the user's.
    """
    if not has_managed_fields(obj):
        return True
    return bool(owners(obj, path) - {manager})


def owned_by(obj: Mapping[str, Any], path: Sequence[str], manager: str) -> bool:
    """Whether ``manager`` owns ``path``."""
    return manager in owners(obj, path)


def manages_anything(obj: Mapping[str, Any], manager: str) -> bool:
    """Whether ``manager`` has any managedFields entry on the object."""
    return any(
        entry.get("manager") == manager and entry.get("fieldsV1")
        for entry in (obj.get("metadata") or {}).get("managedFields") or []
    )


def template_injected(obj: Mapping[str, Any]) -> bool:
    """Whether the operator owns the injection inside the pod template (template mode's mark)."""
    return owned_by(obj, (*TEMPLATE_META, "f:labels", f"f:{c.LABEL_INJECTED}"), c.FIELD_MANAGER)
