"""An injection plan -> the Server-Side Apply bodies the operator owns; and the removal of them.

``render`` is pure: the same plan always gives byte-identical bodies, so re-applying them is a
no-op and never bumps ``metadata.generation``. What the operator owns is exactly what these bodies
contain; removal applies a body without those fields and the apiserver drops them
(``render_removal``). The decisions are :mod:`.injection_plan`'s; this module only lays them out.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.trtllm_options import AlreadyOurs, MergeFromConfigMap, connector_options, options_mount
from kvoffload.operator.intent.workload import Workload, WorkloadRef, configmap_name, conflict_path, read_workload
from kvoffload.operator.plan.containers import (
    BUNDLE_VOLUME_SIZE,
    CACHE_KEYS_MOUNT,
    ENGINE_KEY_FILES,
    OPTIONS_VOLUME_SIZE,
    RUN_VOLUME_SIZE,
    bundle_container,
    cache_keys_volume,
    cache_server_container,
    options_init_container,
    shm_size_limit,
)
from kvoffload.operator.plan.injection_plan import (
    ClusterInfo,
    InjectionPlan,
    RecordedOptions,
    plan_workload,
)
from kvoffload.operator.plan.node_wiring import NodeCacheWiring
from kvoffload.policy_values import PolicyError
from kvoffload.quantity import format_bytes


@dataclass(frozen=True)
class RenderedInjection:
    """What one reconcile applies for an opted-in workload."""

    workload_apply: dict[str, Any]
    configmap_apply: dict[str, Any] | None
    """The generated ConfigMap holding ``files`` (template mode); None where the pods carry the
    files themselves (admission mode: pod annotations read through a downward API volume)."""
    files: dict[str, str]
    """The files the pods mount: the engine's options file (template mode; in admission mode the
    pod's options init container writes it) and the policy file."""
    config_hash: str
    engine_container: str
    forceable_fields: tuple[str, ...]
    """SSA conflict paths the operator may take over: only the engine container's args, which it
    rewrites on purpose (and restores on removal)."""
    warnings: tuple[str, ...]


@dataclass(frozen=True)
class ApplyStep:
    """One Server-Side Apply of ``body`` as ``field_manager``."""

    field_manager: str
    body: dict[str, Any]


@dataclass(frozen=True)
class RemovalPlan:
    """What to apply, in order, to take the injection out; empty when nothing is ours."""

    steps: tuple[ApplyStep, ...]


def _engine_fragment(plan: InjectionPlan) -> dict[str, Any]:
    """The engine container's part: the connector's env, our mounts, the options flag."""
    settings = plan.settings
    mounts: list[dict[str, Any]] = []
    if plan.user_shm_volume is None:
        mounts.append({"name": c.VOLUME_SHM, "mountPath": c.SHM_MOUNT_PATH})
    mounts.append({"name": c.VOLUME_RUN, "mountPath": c.RUN_MOUNT_PATH})
    if settings.connector_source == "init-container":
        mounts.append({"name": c.VOLUME_BUNDLE, "mountPath": c.BUNDLE_MOUNT_PATH, "readOnly": True})
    mounts.append({"name": c.VOLUME_TRTLLM_OPTIONS, "mountPath": c.TRTLLM_OPTIONS_MOUNT_PATH, "readOnly": True})
    if plan.node_cache is not None:
        mounts.append(dict(CACHE_KEYS_MOUNT))
    fragment: dict[str, Any] = {"name": plan.engine.name, "env": plan.engine_env, "volumeMounts": mounts}
    if not plan.uses_sidecar:
        fragment["ports"] = [
            {"name": c.ENGINE_METRICS_PORT_NAME, "containerPort": c.ENGINE_METRICS_PORT, "protocol": "TCP"}
        ]
    if plan.engine_args is not None:
        fragment["args"] = plan.engine_args
    return fragment


def _file_volume(name: str, file: str, cm_name: str | None) -> dict[str, Any]:
    """A volume holding one of the pod's files: a key of the generated ConfigMap, or (``cm_name``
    None) the pod's own annotation ``FILE_ANNOTATIONS[file]`` through the downward API."""
    if cm_name is not None:
        return {"name": name, "configMap": {"name": cm_name, "items": [{"key": file, "path": file}]}}
    field = f"metadata.annotations['{c.FILE_ANNOTATIONS[file]}']"
    return {"name": name, "downwardAPI": {"items": [{"path": file, "fieldRef": {"fieldPath": field}}]}}


def _options_init(plan: InjectionPlan) -> dict[str, Any]:
    """Admission mode's init container writing the engine's options file in the pod, from the user's
    ConfigMap as the engine mounts it (where the options come from one) and our options."""
    user_file = None
    options = plan.engine.options
    if isinstance(options, MergeFromConfigMap):
        mount = options_mount(options.path, plan.engine.spec, plan.workload.volumes)
        if mount is not None:  # always: the plan found the file through this mount
            user_file = (mount, options.path, plan.user_options_digest)
    return options_init_container(plan.settings, plan.engine.spec, connector_options(), user_file)


def _volumes(plan: InjectionPlan, cm_name: str | None) -> list[dict[str, Any]]:
    settings = plan.settings
    volumes: list[dict[str, Any]] = []
    if plan.node_cache is not None:
        volumes.append(
            {"name": c.VOLUME_SHM, "hostPath": {"path": plan.node_cache.shm_host_path, "type": "DirectoryOrCreate"}}
        )
        volumes.append(cache_keys_volume(plan.node_cache.keys_secret, ENGINE_KEY_FILES))
    elif plan.user_shm_volume is None:
        shm = {"medium": "Memory", "sizeLimit": format_bytes(shm_size_limit(settings))}
        volumes.append({"name": c.VOLUME_SHM, "emptyDir": shm})
    volumes.append({"name": c.VOLUME_RUN, "emptyDir": {"sizeLimit": RUN_VOLUME_SIZE}})
    if settings.connector_source == "init-container":
        volumes.append({"name": c.VOLUME_BUNDLE, "emptyDir": {"sizeLimit": BUNDLE_VOLUME_SIZE}})
    if cm_name is None:  # admission mode: the options init container writes the file
        volumes.append({"name": c.VOLUME_TRTLLM_OPTIONS, "emptyDir": {"sizeLimit": OPTIONS_VOLUME_SIZE}})
    else:
        volumes.append(_file_volume(c.VOLUME_TRTLLM_OPTIONS, c.TRTLLM_OPTIONS_FILE, cm_name))
    if plan.uses_sidecar:
        volumes.append(_file_volume(c.VOLUME_POLICY, c.POLICY_FILE, cm_name))
        if settings.fs_tier:
            volumes.append(
                {"name": c.VOLUME_L2_FS, "emptyDir": {"sizeLimit": format_bytes(settings.fs_tier.size_bytes)}}
            )
    return volumes


def _pod_spec_fragment(plan: InjectionPlan, cm_name: str | None) -> dict[str, Any]:
    settings, native = plan.settings, plan.cluster.native_sidecars
    init_containers: list[dict[str, Any]] = []
    containers: list[dict[str, Any]] = [_engine_fragment(plan)]
    if settings.connector_source == "init-container":
        init_containers.append(bundle_container(settings))
    if cm_name is None:  # after the bundle copy: it may run from the bundle
        init_containers.append(_options_init(plan))
    if plan.uses_sidecar:
        sidecar = cache_server_container(settings, plan.user_shm_volume or c.VOLUME_SHM, native)
        (init_containers if native else containers).append(sidecar)
    pod_spec: dict[str, Any] = {}
    if init_containers:
        pod_spec["initContainers"] = init_containers
    pod_spec["containers"] = containers
    pod_spec["volumes"] = _volumes(plan, cm_name)
    if plan.uses_sidecar:  # CUDA IPC needs distinct PIDs for engine and cache server: one namespace per pod
        pod_spec["shareProcessNamespace"] = True
    if plan.runtime_class_name:
        pod_spec["runtimeClassName"] = plan.runtime_class_name
    return pod_spec


def configmap_body(ref: WorkloadRef, cm_name: str, data: dict[str, str], digest: str) -> dict[str, Any]:
    owner: dict[str, Any] = {"apiVersion": ref.api_version, "kind": ref.kind, "name": ref.name}
    if ref.uid:
        owner["uid"] = ref.uid
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": cm_name,
            "namespace": ref.namespace,
            "labels": {c.LABEL_MANAGED_BY: c.LABEL_MANAGED_BY_VALUE},
            "annotations": {c.ANN_CONFIG_HASH: digest},
            "ownerReferences": [owner],
        },
        "data": data,
    }


def render(plan: InjectionPlan, files_on_pod: bool = False) -> RenderedInjection:
    """The SSA bodies (workload fragment and generated ConfigMap) of a plan; with ``files_on_pod``
    (the webhook's pods) the policy file is a pod annotation instead, the options file is written by
    the pod's init container (no options text in the answer), and there is no ConfigMap."""
    workload, uses_sidecar = plan.workload, plan.uses_sidecar
    cm_name = None if files_on_pod else configmap_name(workload.ref.name)
    pod_spec = _pod_spec_fragment(plan, cm_name)
    configmap_data = {c.POLICY_FILE: json.dumps(plan.settings.policy_document(), sort_keys=True, indent=2) + "\n"}
    if not files_on_pod:
        if plan.options_text is None:  # pragma: no cover - only the webhook's pods plan without the text
            raise ValueError("template mode renders the options file: plan it with the user's file")
        configmap_data = {c.TRTLLM_OPTIONS_FILE: plan.options_text, **configmap_data}
    warnings = list(plan.warnings)
    port = (
        (c.SIDECAR_HTTP_PORT, c.SIDECAR_PORT_NAME)
        if uses_sidecar
        else (c.ENGINE_METRICS_PORT, c.ENGINE_METRICS_PORT_NAME)
    )
    annotations, scrape_warning = _scrape_annotations(workload, *port)
    if scrape_warning:
        warnings.append(scrape_warning)
    if isinstance(plan.engine.options, MergeFromConfigMap):
        annotations[c.ANN_ORIGINAL_OPTIONS_PATH] = plan.engine.options.path
    annotations[c.ANN_INJECTED_VERSION] = plan.cluster.operator_version
    if files_on_pod:
        annotations.update({c.FILE_ANNOTATIONS[file]: text for file, text in configmap_data.items()})
    labels = {c.LABEL_INJECTED: "true", **(plan.node_cache.pod_labels if plan.node_cache else {})}
    digest = config_hash({"metadata": {"annotations": annotations, "labels": labels}, "spec": pod_spec}, configmap_data)
    annotations[c.ANN_CONFIG_HASH] = digest
    body = workload.ref.apply_body()
    body["spec"] = {"template": {"metadata": {"annotations": dict(sorted(annotations.items())), "labels": labels},
                                 "spec": pod_spec}}  # fmt: skip
    forceable: tuple[str, ...] = ()
    if plan.engine_args is not None and not isinstance(plan.engine.options, AlreadyOurs):
        forceable = (conflict_path("containers", plan.engine.name, "args"),)
    configmap = None if cm_name is None else configmap_body(workload.ref, cm_name, configmap_data, digest)
    return RenderedInjection(
        workload_apply=body, configmap_apply=configmap, files=configmap_data, config_hash=digest,
        engine_container=plan.engine.name, forceable_fields=forceable, warnings=tuple(warnings),
    )  # fmt: skip


def render_injection_fragment(
    workload: Mapping[str, Any],
    settings: InjectionSettings,
    cluster: ClusterInfo,
    user_options_yaml: str | None = None,
    node_cache: NodeCacheWiring | None = None,
) -> RenderedInjection | PolicyError:
    """Read, plan (``plan_workload``) and render for template mode in one call (tests, tools, node mode)."""
    plan = plan_workload(read_workload(workload), settings, cluster, RecordedOptions(user_options_yaml), node_cache)
    return plan if isinstance(plan, PolicyError) else render(plan)


def _scrape_annotations(workload: Workload, port: int, port_name: str) -> tuple[dict[str, str], str | None]:
    """prometheus.io/* pointing at the pod's /metrics on ``port``, unless the user set them otherwise."""
    wanted = dict(zip(c.PROMETHEUS_SCRAPE_ANNOTATIONS, ("true", str(port), c.PATH_METRICS), strict=True))
    current = workload.pod.annotations
    for name, value in wanted.items():
        if name in current and current[name] != value and name in workload.pod.users_annotations:
            return {}, (
                f"pod template annotation {name}={current[name]!r} is the user's; kvoffload leaves the scrape "
                f"annotations alone, scrape port {port_name} ({port}) yourself"
            )
    return wanted, None


def config_hash(template_fragment: Mapping[str, Any], configmap_data: Mapping[str, str]) -> str:
    """A short stable hash of everything injected: it changes exactly when the pods must roll."""
    canonical = json.dumps({"template": template_fragment, "configmap": configmap_data}, sort_keys=True,
                           separators=(",", ":"))  # fmt: skip
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def render_removal(workload: Workload) -> RemovalPlan:
    """How to take the injection out so the template is the user's again.

    Normally one empty apply: the apiserver drops every field the operator owned. When the
    operator rewrote the engine's args it owns them alone, so an empty apply would delete them:
    first apply the user's args back, let a hand-off manager co-own that value, then release.
    """
    if not workload.manages_anything:
        return RemovalPlan(steps=())
    empty = workload.ref.apply_body()
    restored = [{"name": x.name, "args": list(x.spec.get("args") or [])} for x in workload.containers if x.we_own_args]
    if not restored:
        return RemovalPlan(steps=(ApplyStep(c.FIELD_MANAGER, empty),))
    with_args = {**copy.deepcopy(empty), "spec": {"template": {"spec": {"containers": restored}}}}
    return RemovalPlan(
        steps=(
            ApplyStep(c.FIELD_MANAGER, with_args),
            ApplyStep(c.FIELD_MANAGER_HANDOFF, copy.deepcopy(with_args)),
            ApplyStep(c.FIELD_MANAGER, empty),
        )
    )
