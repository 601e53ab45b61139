"""The workload as the user wrote it: its kind, pod template, engine container and what is theirs.

Pure reads of a live object; ``managedFields`` tell the user's fields (another manager) from what
an earlier reconcile injected (:data:`kvoffload.contract.FIELD_MANAGER`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.intent.managed_fields import (
    TEMPLATE_META,
    TEMPLATE_SPEC,
    container_path,
    key,
    owned_by,
    owned_by_others,
)
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.trtllm_options import strip_injected_args
from kvoffload.policy_values import PolicyError

SUPPORTED_KINDS = {"Deployment": "apps/v1", "StatefulSet": "apps/v1"}
GPU_RESOURCE = "nvidia.com/gpu"
OUR_CONTAINERS = (c.SIDECAR_CONTAINER, c.BUNDLE_INIT_CONTAINER)
OUR_VOLUMES = (c.VOLUME_SHM, c.VOLUME_RUN, c.VOLUME_BUNDLE, c.VOLUME_TRTLLM_OPTIONS, c.VOLUME_POLICY, c.VOLUME_L2_FS)


def configmap_name(workload_name: str) -> str:
    return workload_name + c.GENERATED_CONFIGMAP_SUFFIX


def conflict_path(list_name: str, container: str, field_name: str) -> str:
    """A field path as the apiserver spells it in an SSA conflict."""
    return f'.spec.template.spec.{list_name}[name="{container}"].{field_name}'


def workload_meta(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    return workload.get("metadata") or {}


def pod_spec_of(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    """The pod template's spec ({} when absent)."""
    return ((workload.get("spec") or {}).get("template") or {}).get("spec") or {}


def template_annotations(workload: Mapping[str, Any]) -> Mapping[str, str]:
    return (((workload.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("annotations") or {}


def _requests_gpu(container: Mapping[str, Any]) -> bool:
    resources = container.get("resources") or {}
    return any(GPU_RESOURCE in (resources.get(kind) or {}) for kind in ("limits", "requests"))


def empty_apply_body(workload: Mapping[str, Any]) -> dict[str, Any]:
    meta = workload_meta(workload)
    return {
        "apiVersion": SUPPORTED_KINDS.get(str(workload.get("kind")), "apps/v1"),
        "kind": workload.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
    }


def select_engine_container(workload: Mapping[str, Any], settings: InjectionSettings) -> str | PolicyError:
    """The TensorRT-LLM container: the annotated one, else the GPU one, else the only one."""
    containers = [x for x in pod_spec_of(workload).get("containers") or [] if x.get("name") not in OUR_CONTAINERS]
    names = [str(x.get("name")) for x in containers]
    if settings.container is not None:
        if settings.container in names:
            return settings.container
        return PolicyError(c.ANN_CONTAINER, settings.container, "one of the pod's containers: " + ", ".join(names))
    gpu = [str(x.get("name")) for x in containers if _requests_gpu(x)]
    if len(gpu) == 1:
        return gpu[0]
    if len(containers) == 1:
        return names[0]
    why = f"{len(gpu)} containers request {GPU_RESOURCE}" if gpu else f"no container requests {GPU_RESOURCE}"
    return PolicyError(
        c.ANN_CONTAINER, None,
        f"{why}; set {c.ANN_CONTAINER} to the TensorRT-LLM container, one of: " + ", ".join(names),
        reason="ambiguous_container",
    )  # fmt: skip


def shape_problem(workload: Mapping[str, Any]) -> PolicyError | None:
    kind = workload.get("kind")
    if kind not in SUPPORTED_KINDS:
        return PolicyError("kind", kind, "Deployment or StatefulSet (apps/v1)", reason="unsupported")
    if not pod_spec_of(workload).get("containers"):
        return PolicyError("spec.template.spec.containers", None, "at least one container", reason="unsupported")
    return None


@dataclass(frozen=True)
class EngineView:
    """The engine container as the user wrote it (the operator's own additions undone)."""

    container: dict[str, Any]
    original_options_path: str | None
    we_own_args: bool


def engine_view(workload: Mapping[str, Any], name: str) -> EngineView:
    container = next(x for x in pod_spec_of(workload).get("containers") or [] if x.get("name") == name)
    args_path = (*container_path("containers", name), "f:args")
    we_own_args = owned_by(workload, args_path, c.FIELD_MANAGER)
    original = None
    if owned_by(workload, (*TEMPLATE_META, "f:annotations", f"f:{c.ANN_ORIGINAL_OPTIONS_PATH}"), c.FIELD_MANAGER):
        original = template_annotations(workload).get(c.ANN_ORIGINAL_OPTIONS_PATH)
    view = copy.deepcopy(dict(container))
    if we_own_args:
        view["args"] = strip_injected_args(container.get("args") or [], original)
    view["env"] = [
        e for e in container.get("env") or []
        if owned_by_others(workload, (*container_path("containers", name), "f:env", key(name=e.get("name"))),
                           c.FIELD_MANAGER)
    ]  # fmt: skip
    view["volumeMounts"] = [
        m for m in container.get("volumeMounts") or []
        if owned_by_others(workload,
                           (*container_path("containers", name), "f:volumeMounts", key(mountPath=m.get("mountPath"))),
                           c.FIELD_MANAGER)
    ]  # fmt: skip
    return EngineView(view, original, we_own_args)


def user_volumes(workload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [
        v for v in pod_spec_of(workload).get("volumes") or []
        if owned_by_others(workload, (*TEMPLATE_SPEC, "f:volumes", key(name=v.get("name"))), c.FIELD_MANAGER)
    ]  # fmt: skip


def collision_problem(workload: Mapping[str, Any], engine: str, view: EngineView) -> PolicyError | None:
    """Names and paths we inject that the user already uses for something else."""
    spec = pod_spec_of(workload)
    for list_name in ("containers", "initContainers"):
        for x in spec.get(list_name) or []:
            if x.get("name") in OUR_CONTAINERS and owned_by_others(
                workload, container_path(list_name, str(x.get("name"))), c.FIELD_MANAGER
            ):
                return PolicyError(
                    f"spec.template.spec.{list_name}[{x.get('name')}]", x.get("name"),
                    "kvoffload reserves this container name; rename your container", reason="conflict",
                )  # fmt: skip
    for v in user_volumes(workload):
        if v.get("name") in OUR_VOLUMES:
            return PolicyError(
                "spec.template.spec.volumes", v.get("name"),
                "kvoffload reserves this volume name; rename your volume", reason="conflict",
            )  # fmt: skip
    ours = (c.RUN_MOUNT_PATH, c.BUNDLE_MOUNT_PATH, c.TRTLLM_OPTIONS_MOUNT_PATH)
    for m in view.container.get("volumeMounts") or []:
        if str(m.get("mountPath", "")).rstrip("/") in ours:
            return PolicyError(
                f"container {engine} volumeMounts", m.get("mountPath"),
                "kvoffload mounts its own volume there; move your mount", reason="conflict",
            )  # fmt: skip
    return None
