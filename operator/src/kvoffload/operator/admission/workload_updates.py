"""A Deployment or StatefulSet UPDATE at admission, pure: kvoffload's two fields (the injection
record and the template label naming its hash) stay kvoffload's, with the values the operator's
plan gives for the workload as it is being written.

Two ordinary writes needed the operator to write again after them, which rolled the pods twice:

* ``kubectl rollout undo`` puts an older template and the older ReplicaSet's annotations back, so
  an older record and label, as field manager ``kubectl-rollout``. Its pods were refused by the
  webhook (a record kvoffload did not write) and ran plain until the operator took its fields back
  by force: a second template change, a second rollout.
* a template change that alters the plan (an engine's args that start naming the user's options
  ConfigMap): the webhook injected the new pods from the old record, then the operator wrote the
  new one: a second rollout.

Here the write itself carries the plan's record and label, held by kvoffload's field manager (the
apiserver records field ownership before mutating admission, so the webhook hands the two fields
back in ``managedFields`` too): one template change, one rollout, every pod injected from the
record the operator then finds in place. When no plan can be made here (node mode, a refused
setting, a read that failed), the fields keep the values kvoffload wrote, and the operator decides.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.admission.records import Admission
from kvoffload.operator.intent.managed_fields import TEMPLATE_META, owned_by
from kvoffload.operator.intent.settings import enabled_state, ours_annotations_digest
from kvoffload.operator.plan.injection_plan import InjectionPlan
from kvoffload.operator.plan.workload_apply import render_admission

RECORD_PATH = ("f:metadata", "f:annotations", f"f:{c.ANN_INJECTION_RECORD}")
LABEL_PATH = (*TEMPLATE_META, "f:labels", f"f:{c.LABEL_INJECT}")
OPERATOR_MANAGERS = frozenset({c.FIELD_MANAGER, c.FIELD_MANAGER_HANDOFF})
"""Writes the webhook never changes: the operator's own applies and removals (the uninstall hook's
too)."""


def record_value(workload: Mapping[str, Any]) -> str | None:
    return ((workload.get("metadata") or {}).get("annotations") or {}).get(c.ANN_INJECTION_RECORD)


def label_value(workload: Mapping[str, Any]) -> str | None:
    template_meta = ((workload.get("spec") or {}).get("template") or {}).get("metadata") or {}
    return (template_meta.get("labels") or {}).get(c.LABEL_INJECT)


def _plan_inputs_changed(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether the write changed anything a plan is made from (the template, kvoffload's annotations)."""
    old_meta, new_meta = old.get("metadata") or {}, new.get("metadata") or {}
    return (((old.get("spec") or {}).get("template") != (new.get("spec") or {}).get("template"))
            or ours_annotations_digest(old_meta.get("annotations") or {})
            != ours_annotations_digest(new_meta.get("annotations") or {}))  # fmt: skip


def kvoffload_injects(workload: Mapping[str, Any]) -> bool:
    """Whether ``workload`` carries an injection record held by kvoffload's field manager."""
    return owned_by(workload, RECORD_PATH, c.FIELD_MANAGER) and record_value(workload) is not None


def review_update(old: Mapping[str, Any], new: Mapping[str, Any], field_manager: str,
                  plan: Callable[[Mapping[str, Any]], InjectionPlan | str]) -> Admission:  # fmt: skip
    """The answer for an UPDATE of a workload kvoffload injects (``old``: the workload as the
    operator read it from the API, never the caller's ``oldObject``): ``ignored`` unless the record or
    label the write leaves differ from the plan's (or are no longer kvoffload's); then a JSON patch
    setting both and handing them back to kvoffload's field manager. ``plan`` is called only when
    the write changed a plan input or kvoffload's fields."""
    name = f"{new.get('kind', 'workload')} {(new.get('metadata') or {}).get('name')}"
    if field_manager in OPERATOR_MANAGERS:
        return Admission([], (), "ignored")
    if not kvoffload_injects(old):
        return Admission([], (), "ignored")  # not injected (yet, or any more): the operator's to decide
    if enabled_state((new.get("metadata") or {}).get("annotations")) is not True:
        return Admission([], (), "ignored")  # opted out: the operator takes the injection out
    ours_intact = (record_value(new) == record_value(old) and label_value(new) == label_value(old)
                   and owned_by(new, RECORD_PATH, c.FIELD_MANAGER) and owned_by(new, LABEL_PATH, c.FIELD_MANAGER))  # fmt: skip
    if ours_intact and not _plan_inputs_changed(old, new):
        return Admission([], (), "ignored")
    planned = plan(new)
    label: str | None
    if isinstance(planned, InjectionPlan):
        rendered = render_admission(planned)
        record = str(rendered.workload_apply["metadata"]["annotations"][c.ANN_INJECTION_RECORD])
        label = rendered.config_hash
    else:
        record, label = str(record_value(old)), label_value(old)
    if ours_intact and record_value(new) == record and label_value(new) == label:
        return Admission([], (), "ignored")
    warnings: tuple[str, ...] = ()
    if record_value(new) != record_value(old) or label_value(new) != label_value(old):
        warnings = (f"kvoffload: {name}: kept kvoffload's {c.ANN_INJECTION_RECORD} annotation and "
                    f"{c.LABEL_INJECT} label as the current settings give them (a rollout undo or an edit "
                    "does not change them; change the KVCachePolicy or the workload's kvoffload.io/ "
                    "annotations instead)",)  # fmt: skip
    patch = [*_annotation_patch(new, record), *template_label_patch(new, label),
             {"op": "replace" if "managedFields" in (new.get("metadata") or {}) else "add",
              "path": "/metadata/managedFields", "value": owned_back(new, old, with_label=label is not None)}]  # fmt: skip
    return Admission(patch, warnings, "injected")


def _pointer(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _annotation_patch(workload: Mapping[str, Any], record: str) -> list[dict[str, Any]]:
    if not isinstance((workload.get("metadata") or {}).get("annotations"), Mapping):
        return [{"op": "add", "path": "/metadata/annotations", "value": {c.ANN_INJECTION_RECORD: record}}]
    return [{"op": "add", "path": f"/metadata/annotations/{_pointer(c.ANN_INJECTION_RECORD)}", "value": record}]


def template_label_patch(workload: Mapping[str, Any], label: str | None) -> list[dict[str, Any]]:
    """JSON patch setting the template's ``LABEL_INJECT`` to ``label`` (nothing when None)."""
    if label is None:
        return []
    template_meta = ((workload.get("spec") or {}).get("template") or {}).get("metadata")
    if not isinstance(template_meta, Mapping):
        return [{"op": "add", "path": "/spec/template/metadata", "value": {"labels": {c.LABEL_INJECT: label}}}]
    if not isinstance(template_meta.get("labels"), Mapping):
        return [{"op": "add", "path": "/spec/template/metadata/labels", "value": {c.LABEL_INJECT: label}}]
    return [{"op": "add", "path": f"/spec/template/metadata/labels/{_pointer(c.LABEL_INJECT)}", "value": label}]


def _without(tree: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    """``tree`` (fieldsV1) without ``path``; parents left empty go too."""
    result = copy.deepcopy(dict(tree))
    if not path or path[0] not in result:
        return result
    if len(path) == 1:
        del result[path[0]]
        return result
    child = result[path[0]]
    if isinstance(child, Mapping):
        pruned = _without(child, path[1:])
        if pruned or not child:
            result[path[0]] = pruned
        else:
            del result[path[0]]
    return result


def _with(tree: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    result = copy.deepcopy(dict(tree))
    node = result
    for part in path:
        node = node.setdefault(part, {})
    return result


def owned_back(new: Mapping[str, Any], old: Mapping[str, Any], with_label: bool = True) -> list[dict[str, Any]]:
    """``new``'s managedFields with the record (and the template label) held by kvoffload's apply
    entry alone, as they were before the write took them."""
    paths = (RECORD_PATH, LABEL_PATH) if with_label else (RECORD_PATH,)
    entries: list[dict[str, Any]] = []
    ours: dict[str, Any] | None = None
    for entry in (new.get("metadata") or {}).get("managedFields") or []:
        entry = copy.deepcopy(dict(entry))
        if entry.get("manager") == c.FIELD_MANAGER and entry.get("operation") == "Apply" and ours is None:
            ours = entry
            continue
        fields: Mapping[str, Any] = entry.get("fieldsV1") or {}
        for path in paths:
            fields = _without(fields, path)
        if fields:
            entries.append({**entry, "fieldsV1": fields})
    if ours is None:  # the write took every field kvoffload held: its entry as it was before
        previous = next((e for e in (old.get("metadata") or {}).get("managedFields") or []
                         if e.get("manager") == c.FIELD_MANAGER and e.get("operation") == "Apply"), None)  # fmt: skip
        ours = copy.deepcopy(dict(previous)) if previous else {
            "manager": c.FIELD_MANAGER, "operation": "Apply", "apiVersion": str(new.get("apiVersion", "apps/v1")),
            "fieldsType": "FieldsV1", "fieldsV1": {}}  # fmt: skip
    fields = ours.get("fieldsV1") or {}
    for path in paths:
        fields = _with(fields, path)
    entries.append({**ours, "fieldsV1": fields})
    return entries
