"""Writes to a workload that must not land on a stale version: Server-Side Apply locked to the
resourceVersion a fragment or removal plan was computed from."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.api.kube import Kube, KubeApiError, configmap_path, list_workloads, workload_path
from kvoffload.operator.intent.settings import enabled_state, ours_annotations_digest
from kvoffload.operator.intent.workload import Workload, configmap_name, read_workload
from kvoffload.operator.plan.drift import object_carries
from kvoffload.operator.plan.fragment import RemovalPlan, RenderedInjection, render_removal
from kvoffload.operator.plan.injection_record import foreign_record
from kvoffload.policy_values import PolicyError

log = logging.getLogger("kvoffload.operator")

LOCKED_APPLY_TRIES = 3


def locked_apply(kube: Kube, body: Mapping[str, Any], workload: Workload, force: bool) -> dict[str, Any] | None:
    """Apply locked to the newest version whose spec and kvoffload annotations are those the fragment
    was computed from (``workload`` as read). None: the inputs changed or the workload is gone (the
    next event carries it). Field conflicts are raised.

    The lock is taken from a read just before each try, not from ``workload``: under load the event
    a pass works from is often a version behind (the Deployment controller writes its status two or
    three times after a CREATE), and a lock taken from it only buys a 409, a write the apiserver
    admits (webhooks included) and refuses, then this same read."""
    path = workload_path(workload.ref.kind, workload.ref.namespace, workload.ref.name)
    locked = {**body, "metadata": dict(body["metadata"])}  # only the resourceVersion changes
    ours = ours_annotations_digest(workload.annotations)
    for _attempt in range(LOCKED_APPLY_TRIES):
        current = kube.get(path)
        current_meta = (current or {}).get("metadata") or {}
        if (current is None or current_meta.get("generation") != workload.generation
                or ours_annotations_digest(current_meta.get("annotations") or {}) != ours):  # fmt: skip
            return None
        locked["metadata"]["resourceVersion"] = current_meta.get("resourceVersion")
        try:
            return kube.apply(path, locked, c.FIELD_MANAGER, force=force)
        except KubeApiError as exc:
            if exc.status != 409 or exc.field_conflicts:
                raise
    return None


@dataclass(frozen=True)
class InjectionApplied:
    """What applying a rendered injection came to: ``result`` is ``applied`` (the generation moved),
    ``unchanged``, ``skipped`` (the workload changed meanwhile; the next event carries it) or
    ``refused``; ``answer`` the object the apiserver returned."""

    result: str
    answer: Mapping[str, Any] | None = None
    conflict: KubeApiError | None = None
    """Another field manager owns fields kvoffload needs on ``conflict_on``."""
    conflict_on: str = ""
    refused: PolicyError | None = None
    """The apiserver refused the fragment for a reason the settings could not judge."""


def apply_injection(kube: Kube, workload: Workload, rendered: RenderedInjection) -> InjectionApplied:
    """Apply the generated ConfigMap (template mode) and the workload fragment, both locked to the
    resourceVersion the fragment was computed from (a stale fragment must never land: it would roll
    the pods twice); a 409 caused only by a status write refreshes the lock (``locked_apply``)."""
    ref = workload.ref
    if rendered.configmap_apply is not None:
        try:
            kube.apply(configmap_path(ref.namespace, configmap_name(ref.name)), rendered.configmap_apply,
                       c.FIELD_MANAGER)  # fmt: skip
        except KubeApiError as exc:
            if exc.status == 409 and exc.field_conflicts:
                return InjectionApplied("conflict", conflict=exc, conflict_on=f"ConfigMap {configmap_name(ref.name)}")
            raise
    body = rendered.workload_apply
    try:
        answer = locked_apply(kube, body, workload, force=False)
    except KubeApiError as exc:
        if exc.status == 422 and changed_since(kube, workload):
            return InjectionApplied("skipped")  # a 422 on a stale fragment: the next event retries
        if exc.status == 422:
            return InjectionApplied("refused", refused=PolicyError(
                f"{ref.kind} {ref.name}", "the injected fragment", f"the apiserver refused it: {exc.message}",
                reason="rejected_by_apiserver",
            ))  # fmt: skip
        if exc.status != 409:
            raise
        if not exc.field_conflicts:
            return InjectionApplied("skipped")
        if not all(f in rendered.forceable_fields for f, _ in exc.field_conflicts):
            return InjectionApplied("conflict", conflict=exc, conflict_on=f"{ref.kind} {ref.name}")
        # Only the engine's args conflict: the documented rewrite, undone on removal. Forcing
        # takes the user's args, so it is locked to the version the rewrite was computed from.
        answer = locked_apply(kube, body, workload, force=True)
    if answer is None:
        return InjectionApplied("skipped")
    # A ConfigMap an earlier version kept the admission record in is left to the workload's
    # ownerReference: admission mode holds no right to delete ConfigMaps, and nothing reads it.
    changed = (answer.get("metadata") or {}).get("generation") != workload.generation
    return InjectionApplied("applied" if changed else "unchanged", answer)


def apply_removal(kube: Kube, path: str, plan: RemovalPlan, version: str | None) -> None:
    """Apply the removal steps; the first is locked to the version the plan was made from
    (a stale plan would re-claim fields and loop on its own intermediate writes)."""
    for index, step in enumerate(plan.steps):
        body = copy.deepcopy(step.body)
        if index == 0 and version:
            body["metadata"]["resourceVersion"] = version
        kube.apply(path, body, step.field_manager, force=False)


def changed_since(kube: Kube, workload: Workload) -> bool:
    """Whether the object's spec moved on from the version a fragment was computed from."""
    current = kube.get(workload_path(workload.ref.kind, workload.ref.namespace, workload.ref.name))
    return current is not None and (current.get("metadata") or {}).get("generation") != workload.generation


def carries_injection(kube: Kube, workload: Workload, rendered: RenderedInjection) -> bool:
    """Whether the live workload and its ConfigMap (if it has one) hold every field the apply would set."""
    if not object_carries(rendered.workload_apply, workload.live):
        return False
    if rendered.configmap_apply is None:
        return True
    cm = kube.get(configmap_path(workload.ref.namespace, configmap_name(workload.ref.name)))
    return object_carries(rendered.configmap_apply, cm)


def remove_injection(kube: Kube, workload: Workload, generated_configmaps: bool) -> str:
    """Apply the removal plan of an opted-out workload and, with ``generated_configmaps`` (template
    mode: admission mode may not delete ConfigMaps), delete its generated ConfigMap.

    ``noop``: nothing of ours; ``removed``; ``skipped``: the workload kept changing or opted in
    again meanwhile (the next event carries it). Field conflicts are raised to the caller.
    """
    ref = workload.ref
    path = workload_path(ref.kind, ref.namespace, ref.name)
    current = workload
    for _attempt in range(LOCKED_APPLY_TRIES):
        plan = render_removal(current)
        if not plan.steps:
            return "noop"
        try:
            apply_removal(kube, path, plan, current.ref.resource_version)
            break
        except KubeApiError as exc:
            if exc.status != 409 or exc.field_conflicts:
                raise
        # The plan was made from a stale version (often our own removal's intermediate
        # state, delivered late): plan again from the live object, which may need nothing.
        live = kube.get(path)
        if live is None or enabled_state((live.get("metadata") or {}).get("annotations") or {}) is not False:
            return "skipped"
        current = read_workload({"kind": ref.kind, **live})
    else:
        return "skipped"
    if generated_configmaps:
        delete_generated_configmap(kube, ref.namespace, ref.name)
    return "removed"


def delete_generated_configmap(kube: Kube, namespace: str, workload_name: str) -> bool:
    """Delete the workload's generated ConfigMap if there is one kvoffload made; whether it did."""
    path = configmap_path(namespace, configmap_name(workload_name))
    cm = kube.get(path)
    if not cm or ((cm.get("metadata") or {}).get("labels") or {}).get(c.LABEL_MANAGED_BY) != c.LABEL_MANAGED_BY_VALUE:
        return False
    kube.delete(path)
    return True


def remove_every_injection(
    kube: Kube, namespaces: tuple[str, ...], generated_configmaps: bool
) -> list[tuple[str, str]]:
    """Take kvoffload out of every workload in ``namespaces`` (all when empty), as before opting in:
    what ``helm uninstall`` runs first. Returns (workload, result) for each one that held any of ours;
    one whose record kvoffload did not write (``foreign_record``) is left alone, its result says why."""
    results: list[tuple[str, str]] = []
    for obj in list(list_workloads(kube, namespaces)):
        workload = read_workload(obj)
        if not workload.manages_anything:
            continue
        foreign = foreign_record(workload)
        if foreign is not None:
            results.append((str(workload.ref), f"{LEFT_ALONE}: {foreign.message}"))
            continue
        results.append((str(workload.ref), remove_injection(kube, workload, generated_configmaps)))
    return results


LEFT_ALONE = "left alone"
"""``remove_every_injection``'s result for a workload holding a record kvoffload did not write."""
