"""Workload + settings + cluster facts -> the Server-Side Apply bodies the operator owns.

``render_injection_fragment`` is pure: the same inputs always give byte-identical bodies, so
re-applying them is a no-op and never bumps ``metadata.generation``. What the operator owns is
exactly what these bodies contain; removal applies a body without those fields and the
apiserver drops them (``render_removal``).

The live object's ``managedFields`` tell user settings (owned by another manager) from what an
earlier reconcile injected (owned by :data:`kvoffload.contract.FIELD_MANAGER`).
"""

from __future__ import annotations

import copy
import hashlib
import json
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload import __version__
from kvoffload import contract as c
from kvoffload.policy import WORKLOAD_DEPENDENT, PolicyError
from kvoffload.quantity import format_bytes

from .managed_fields import (
    TEMPLATE_META,
    TEMPLATE_SPEC,
    container_path,
    key,
    manages_anything,
    owned_by,
    owned_by_others,
)
from .settings import InjectionSettings
from .trtllm_options import (
    AlreadyOurs,
    ManualStep,
    MergeFromConfigMap,
    OptionsPlan,
    chunk_size_problem,
    desired_args,
    merged_options_yaml,
    plan_options,
    strip_injected_args,
)

SUPPORTED_KINDS = {"Deployment": "apps/v1", "StatefulSet": "apps/v1"}
GPU_RESOURCE = "nvidia.com/gpu"
OUR_CONTAINERS = (c.SIDECAR_CONTAINER, c.BUNDLE_INIT_CONTAINER)
OUR_VOLUMES = (c.VOLUME_SHM, c.VOLUME_RUN, c.VOLUME_BUNDLE, c.VOLUME_TRTLLM_OPTIONS, c.VOLUME_POLICY, c.VOLUME_L2_FS)
RUN_VOLUME_SIZE = "512Mi"
BUNDLE_VOLUME_SIZE = "1Gi"
SIDECAR_UID = 65532
STARTUP_PROBE_BUDGET_S = 600
"""Pinning a large L1 can take minutes; the startup probe allows this long before a restart."""
REQUIRED_ENGINE_ENV = (c.ENV_SERVER_URL, c.ENV_PYTHONHASHSEED, c.ENV_PROMETHEUS_MULTIPROC_DIR, c.ENV_PYTHONPATH)
"""Engine env the connector cannot work without; a different user value is an error. The user
may override any other injected variable, and then the user's value stays."""
RESTRICTED_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "runAsUser": SIDECAR_UID,
    "runAsGroup": SIDECAR_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
}


@dataclass(frozen=True)
class ClusterInfo:
    """Facts about the cluster that change what is injected."""

    native_sidecars: bool
    """The apiserver is >= 1.29: the cache server runs as an init container with restartPolicy Always."""
    operator_version: str = __version__


@dataclass(frozen=True)
class NodeCacheWiring:
    """Node mode: the engine uses its node's shared cache pod instead of a sidecar."""

    server_url: str
    """The cache pods' node-local Service (``internalTrafficPolicy: Local``)."""
    shm_host_path: str
    """The node directory mounted at /dev/shm in the engine and in the node's cache pod."""
    pod_labels: Mapping[str, str]
    """Labels on the engine pods by which the operator finds the nodes needing a cache pod."""


@dataclass(frozen=True)
class RenderedInjection:
    """What one reconcile applies for an opted-in workload."""

    workload_apply: dict[str, Any]
    configmap_apply: dict[str, Any]
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


def configmap_name(workload_name: str) -> str:
    return workload_name + c.GENERATED_CONFIGMAP_SUFFIX


def conflict_path(list_name: str, container: str, field_name: str) -> str:
    """A field path as the apiserver spells it in an SSA conflict."""
    return f'.spec.template.spec.{list_name}[name="{container}"].{field_name}'


def _meta(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    return workload.get("metadata") or {}


def _pod_spec(workload: Mapping[str, Any]) -> Mapping[str, Any]:
    return ((workload.get("spec") or {}).get("template") or {}).get("spec") or {}


def _template_annotations(workload: Mapping[str, Any]) -> Mapping[str, str]:
    return (((workload.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("annotations") or {}


def _requests_gpu(container: Mapping[str, Any]) -> bool:
    resources = container.get("resources") or {}
    return any(GPU_RESOURCE in (resources.get(kind) or {}) for kind in ("limits", "requests"))


def _empty_body(workload: Mapping[str, Any]) -> dict[str, Any]:
    meta = _meta(workload)
    return {
        "apiVersion": SUPPORTED_KINDS.get(str(workload.get("kind")), "apps/v1"),
        "kind": workload.get("kind"),
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace")},
    }


def select_engine_container(workload: Mapping[str, Any], settings: InjectionSettings) -> str | PolicyError:
    """The TensorRT-LLM container: the annotated one, else the GPU one, else the only one."""
    containers = [x for x in _pod_spec(workload).get("containers") or [] if x.get("name") not in OUR_CONTAINERS]
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


def _check_shape(workload: Mapping[str, Any]) -> PolicyError | None:
    kind = workload.get("kind")
    if kind not in SUPPORTED_KINDS:
        return PolicyError("kind", kind, "Deployment or StatefulSet (apps/v1)", reason="unsupported")
    if not _pod_spec(workload).get("containers"):
        return PolicyError("spec.template.spec.containers", None, "at least one container", reason="unsupported")
    return None


@dataclass(frozen=True)
class _EngineView:
    """The engine container as the user wrote it (the operator's own additions undone)."""

    container: dict[str, Any]
    original_options_path: str | None
    we_own_args: bool


def _engine_view(workload: Mapping[str, Any], name: str) -> _EngineView:
    container = next(x for x in _pod_spec(workload).get("containers") or [] if x.get("name") == name)
    args_path = (*container_path("containers", name), "f:args")
    we_own_args = owned_by(workload, args_path, c.FIELD_MANAGER)
    original = None
    if owned_by(workload, (*TEMPLATE_META, "f:annotations", f"f:{c.ANN_ORIGINAL_OPTIONS_PATH}"), c.FIELD_MANAGER):
        original = _template_annotations(workload).get(c.ANN_ORIGINAL_OPTIONS_PATH)
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
    return _EngineView(view, original, we_own_args)


def _user_volumes(workload: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [
        v for v in _pod_spec(workload).get("volumes") or []
        if owned_by_others(workload, (*TEMPLATE_SPEC, "f:volumes", key(name=v.get("name"))), c.FIELD_MANAGER)
    ]  # fmt: skip


def options_source(workload: Mapping[str, Any], settings: InjectionSettings) -> MergeFromConfigMap | None:
    """The user's ConfigMap holding their TensorRT-LLM options, when the handler must fetch it."""
    if _check_shape(workload):
        return None
    name = select_engine_container(workload, settings)
    if isinstance(name, PolicyError):
        return None
    view = _engine_view(workload, name)
    plan = plan_options(view.container, _user_volumes(workload), view.original_options_path)
    return plan if isinstance(plan, MergeFromConfigMap) else None


def _env(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


def _engine_env(settings: InjectionSettings, server_url: str, serve_metrics: bool) -> list[dict[str, Any]]:
    """The connector's settings; ``serve_metrics``: no sidecar in the pod, the connector serves /metrics."""
    env = []
    if settings.backend == c.BACKEND_SIDECAR:
        env.append(_env(c.ENV_SERVER_URL, server_url))
    env += [
        _env(c.ENV_BACKEND, settings.backend),
        _env(c.ENV_PYTHONHASHSEED, "0"),
        _env(c.ENV_PROMETHEUS_MULTIPROC_DIR, c.METRICS_DIR),
        _env(c.ENV_METRICS_ENABLED, "true"),
        _env(c.ENV_CHUNK_SIZE, str(settings.chunk_size)),
        _env(c.ENV_LOOKUP_TIMEOUT_MS, str(settings.lookup_timeout_ms)),
        _env(c.ENV_RETRIEVE_TIMEOUT_MS, str(settings.retrieve_timeout_ms)),
        _env(c.ENV_STORE_TIMEOUT_MS, str(settings.store_timeout_ms)),
        _env(c.ENV_SAVE_DECODE_TOKENS, "true" if settings.save_decode_tokens else "false"),
        # lmcache runs inside the engine too (always its client; the whole cache with backend
        # inprocess) and sends usage telemetry unless told not to: nothing leaves the pod by default.
        _env(c.ENV_LMCACHE_TRACK_USAGE, "false"),
    ]
    if settings.backend == c.BACKEND_INPROCESS:  # the engine hosts the cache: the policy's L1 is its
        env.append(_env(c.ENV_L1_SIZE, format_bytes(settings.l1_bytes)))
    if serve_metrics:
        env.append(_env(c.ENV_METRICS_PORT, str(c.ENGINE_METRICS_PORT)))
    if settings.connector_source == "init-container":
        env.append(_env(c.ENV_PYTHONPATH, c.BUNDLE_PYTHONPATH))
    return env


def _merge_engine_env(ours: list[dict[str, Any]], user_env: Sequence[Mapping[str, Any]], container: str
                      ) -> tuple[list[dict[str, Any]], PolicyError | None]:  # fmt: skip
    """Our env entries next to the user's: equal values are shared, a user override wins for
    tunables, and a different value of a required variable is an error."""
    users = {str(e.get("name")): e for e in user_env}
    result = []
    for entry in ours:
        name = entry["name"]
        if name not in users:
            result.append(entry)
            continue
        user_value = users[name].get("value")
        if "valueFrom" not in users[name] and user_value == entry["value"]:
            result.append(entry)  # same value: co-owned, survives our removal untouched
            continue
        if name == c.ENV_PYTHONPATH and isinstance(user_value, str):
            if user_value.split(":")[0] == c.BUNDLE_PYTHONPATH:
                result.append({"name": name, "value": user_value})
                continue
            return result, PolicyError(
                f"container {container} env {name}", user_value,
                f"kvoffload needs {c.BUNDLE_PYTHONPATH} first on it: set {name}={c.BUNDLE_PYTHONPATH}:{user_value} "
                f"yourself, or put the connector in your image and set {c.ANN_CONNECTOR_SOURCE}: image",
                reason="conflict",
            )  # fmt: skip
        if name in REQUIRED_ENGINE_ENV:
            return result, PolicyError(
                f"container {container} env {name}", user_value if "valueFrom" not in users[name] else "valueFrom",
                f"kvoffload needs {name}={entry['value']}; remove your setting", reason="conflict",
            )  # fmt: skip
        # A tunable the user set on purpose: leave it to them.
    return result, None


def _sidecar_resources(settings: InjectionSettings) -> dict[str, Any]:
    if settings.sidecar_resources:
        return copy.deepcopy(dict(settings.sidecar_resources))
    memory = format_bytes(settings.l1_bytes + settings.sidecar_memory_overhead_bytes)
    return {
        "requests": {"cpu": settings.sidecar_cpu_request, "memory": memory},
        "limits": {"memory": memory},
    }


def _http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": c.SIDECAR_PORT_NAME, "scheme": "HTTP"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def shm_size_limit(settings: InjectionSettings) -> int:
    """Bytes for the pod's /dev/shm: the engine's own share plus LMCache's L1.

    LMCache's server (the sidecar, or with backend inprocess the one inside the engine) keeps L1
    in a POSIX shared-memory segment that the connector maps to copy KV blocks in and out
    (LMCache's engine-driven transfer); LMCache only uses shared memory when /dev/shm can hold all
    of L1, and otherwise falls back to a pickle path ~100x slower, where no load can be secured.
    """
    return settings.shm_bytes + settings.l1_bytes


def _sidecar_container(settings: InjectionSettings, shm_volume: str, native: bool) -> dict[str, Any]:
    env = [
        _env(c.ENV_POLICY_FILE, posixpath.join(c.POLICY_MOUNT_PATH, c.POLICY_FILE)),
        {"name": c.ENV_INSTANCE_ID, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
        _env(c.ENV_L1_SIZE, format_bytes(settings.l1_bytes)),
        _env(c.ENV_REQUEST_PORT, str(c.REQUEST_PORT)),
        _env(c.ENV_LMCACHE_HTTP_PORT, str(c.LMCACHE_HTTP_PORT)),
        _env(c.ENV_SIDECAR_HTTP_PORT, str(c.SIDECAR_HTTP_PORT)),
        _env(c.ENV_PROMETHEUS_MULTIPROC_DIR, c.METRICS_DIR),
        _env(c.ENV_LMCACHE_TRACK_USAGE, "false"),
    ]
    if settings.redis_tier and settings.redis_tier.password_secret_name:
        env.append({
            "name": c.ENV_L2_REDIS_PASSWORD,
            "valueFrom": {"secretKeyRef": {
                "name": settings.redis_tier.password_secret_name, "key": settings.redis_tier.password_secret_key,
            }},
        })  # fmt: skip
    if settings.gpu_access == "nvidia-runtime":
        # Sees the engine's GPU through the NVIDIA runtime without requesting one (CUDA IPC needs it).
        env += [_env(c.ENV_NVIDIA_VISIBLE_DEVICES, "all"), _env(c.ENV_NVIDIA_DRIVER_CAPABILITIES, "compute,utility")]
    mounts = [
        {"name": shm_volume, "mountPath": c.SHM_MOUNT_PATH},
        {"name": c.VOLUME_RUN, "mountPath": c.RUN_MOUNT_PATH},
        {"name": c.VOLUME_POLICY, "mountPath": c.POLICY_MOUNT_PATH, "readOnly": True},
    ]
    if settings.fs_tier:
        mounts.append({"name": c.VOLUME_L2_FS, "mountPath": settings.fs_tier.path})
    sidecar: dict[str, Any] = {
        "name": c.SIDECAR_CONTAINER,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["kvoffload-sidecar"],
        "env": env,
        "ports": [
            {"name": c.SIDECAR_PORT_NAME, "containerPort": c.SIDECAR_HTTP_PORT, "protocol": "TCP"},
            {"name": c.REQUEST_PORT_NAME, "containerPort": c.REQUEST_PORT, "protocol": "TCP"},
        ],
        "startupProbe": _http_probe(c.PATH_STARTUP, 2, STARTUP_PROBE_BUDGET_S // 2),
        "readinessProbe": _http_probe(c.PATH_READY, 5, 3),
        "livenessProbe": _http_probe(c.PATH_LIVE, 10, 6),
        "resources": _sidecar_resources(settings),
        "securityContext": copy.deepcopy(RESTRICTED_SECURITY_CONTEXT),
        "volumeMounts": mounts,
    }
    if native:
        sidecar["restartPolicy"] = "Always"
    return sidecar


def _bundle_container(settings: InjectionSettings) -> dict[str, Any]:
    return {
        "name": c.BUNDLE_INIT_CONTAINER,
        "image": settings.bundle_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(c.BUNDLE_COPY_COMMAND),
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": copy.deepcopy(RESTRICTED_SECURITY_CONTEXT),
        "volumeMounts": [{"name": c.VOLUME_BUNDLE, "mountPath": c.BUNDLE_MOUNT_PATH}],
    }


def _check_collisions(workload: Mapping[str, Any], engine: str, view: _EngineView) -> PolicyError | None:
    """Names and paths we inject that the user already uses for something else."""
    spec = _pod_spec(workload)
    for list_name in ("containers", "initContainers"):
        for x in spec.get(list_name) or []:
            if x.get("name") in OUR_CONTAINERS and owned_by_others(
                workload, container_path(list_name, str(x.get("name"))), c.FIELD_MANAGER
            ):
                return PolicyError(
                    f"spec.template.spec.{list_name}[{x.get('name')}]", x.get("name"),
                    "kvoffload reserves this container name; rename your container", reason="conflict",
                )  # fmt: skip
    for v in _user_volumes(workload):
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


def _scrape_annotations(workload: Mapping[str, Any], port: int, port_name: str) -> tuple[dict[str, str], str | None]:
    """prometheus.io/* pointing at the pod's /metrics on ``port``, unless the user set them otherwise."""
    wanted = dict(zip(c.PROMETHEUS_SCRAPE_ANNOTATIONS, ("true", str(port), c.PATH_METRICS), strict=True))
    current = _template_annotations(workload)
    for name, value in wanted.items():
        path = (*TEMPLATE_META, "f:annotations", f"f:{name}")
        if name in current and current[name] != value and owned_by_others(workload, path, c.FIELD_MANAGER):
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


def render_injection_fragment(
    workload: Mapping[str, Any],
    settings: InjectionSettings,
    cluster: ClusterInfo,
    user_options_yaml: str | None = None,
    node_cache: NodeCacheWiring | None = None,
) -> RenderedInjection | PolicyError:
    """The SSA bodies (workload fragment and generated ConfigMap) for an opted-in workload.

    ``user_options_yaml`` is the user's TensorRT-LLM options file when :func:`options_source`
    said it lives in a ConfigMap (the handler fetched it). ``node_cache`` (node mode, see
    ``node_mode.render_node_mode_fragment``) wires the engine to its node's cache pod: no sidecar.
    """
    shape = _check_shape(workload)
    if shape:
        return shape
    engine = select_engine_container(workload, settings)
    if isinstance(engine, PolicyError):
        return engine
    view = _engine_view(workload, engine)
    collision = _check_collisions(workload, engine, view)
    if collision:
        return collision
    meta = _meta(workload)
    name, namespace = str(meta.get("name")), str(meta.get("namespace"))
    spec = _pod_spec(workload)
    warnings: list[str] = []

    # TensorRT-LLM options: the command-line flag and the file in the generated ConfigMap.
    plan: OptionsPlan = plan_options(view.container, _user_volumes(workload), view.original_options_path)
    args = desired_args(view.container.get("args") or [], plan)
    if isinstance(plan, ManualStep):
        warnings.append(plan.message)
    if args is None and view.we_own_args:
        args = list(view.container.get("args") or [])  # keep the user's value while we still own the field
    options_text, options_error = merged_options_yaml(
        user_options_yaml if isinstance(plan, MergeFromConfigMap) else None
    )
    if options_error:
        assert isinstance(plan, MergeFromConfigMap)
        return PolicyError(
            f"ConfigMap {plan.configmap} key {plan.key}", "<file>", options_error, reason="invalid_options"
        )
    # Where the engine's options are known (ours, or merged from the user's ConfigMap), a chunk size
    # its blocks do not divide is refused here, not by the connector when the engine starts.
    chunk_problem = None if isinstance(plan, ManualStep) else chunk_size_problem(options_text, settings.chunk_size)
    if chunk_problem:
        return PolicyError("cache.chunkSize", settings.chunk_size, chunk_problem, reason=WORKLOAD_DEPENDENT)

    # Engine container: env, mounts, args.
    url = node_cache.server_url if node_cache else c.server_url(c.REQUEST_PORT)
    uses_sidecar = settings.backend == c.BACKEND_SIDECAR and node_cache is None
    engine_env, env_error = _merge_engine_env(
        _engine_env(settings, url, serve_metrics=not uses_sidecar), view.container.get("env") or [], engine
    )
    if env_error:
        return env_error
    user_shm = next(
        (
            m
            for m in view.container.get("volumeMounts") or []
            if str(m.get("mountPath", "")).rstrip("/") == c.SHM_MOUNT_PATH
        ),
        None,
    )
    if user_shm is not None and node_cache is not None:
        return PolicyError(
            f"container {engine} volumeMounts", c.SHM_MOUNT_PATH,
            "mode node mounts the node's shared /dev/shm there (the cache pod's L1 lives in it); remove your mount",
            reason="conflict",
        )  # fmt: skip
    shm_volume = str(user_shm["name"]) if user_shm else c.VOLUME_SHM
    engine_mounts: list[dict[str, Any]] = []
    if user_shm is None:
        engine_mounts.append({"name": c.VOLUME_SHM, "mountPath": c.SHM_MOUNT_PATH})
    engine_mounts.append({"name": c.VOLUME_RUN, "mountPath": c.RUN_MOUNT_PATH})
    if settings.connector_source == "init-container":
        engine_mounts.append({"name": c.VOLUME_BUNDLE, "mountPath": c.BUNDLE_MOUNT_PATH, "readOnly": True})
    engine_mounts.append({"name": c.VOLUME_TRTLLM_OPTIONS, "mountPath": c.TRTLLM_OPTIONS_MOUNT_PATH, "readOnly": True})
    engine_fragment: dict[str, Any] = {"name": engine, "env": engine_env, "volumeMounts": engine_mounts}
    if not uses_sidecar:
        engine_fragment["ports"] = [
            {"name": c.ENGINE_METRICS_PORT_NAME, "containerPort": c.ENGINE_METRICS_PORT, "protocol": "TCP"}
        ]
    if args is not None:
        engine_fragment["args"] = args

    # Pod-level: volumes, containers, PID namespace, runtime class.
    cm_name = configmap_name(name)
    volumes: list[dict[str, Any]] = []
    if node_cache is not None:
        volumes.append(
            {"name": c.VOLUME_SHM, "hostPath": {"path": node_cache.shm_host_path, "type": "DirectoryOrCreate"}}
        )
    elif user_shm is None:
        volumes.append(
            {
                "name": c.VOLUME_SHM,
                "emptyDir": {"medium": "Memory", "sizeLimit": format_bytes(shm_size_limit(settings))},
            }
        )
    volumes.append({"name": c.VOLUME_RUN, "emptyDir": {"sizeLimit": RUN_VOLUME_SIZE}})
    if settings.connector_source == "init-container":
        volumes.append({"name": c.VOLUME_BUNDLE, "emptyDir": {"sizeLimit": BUNDLE_VOLUME_SIZE}})
    volumes.append({
        "name": c.VOLUME_TRTLLM_OPTIONS,
        "configMap": {"name": cm_name, "items": [{"key": c.TRTLLM_OPTIONS_FILE, "path": c.TRTLLM_OPTIONS_FILE}]},
    })  # fmt: skip
    if uses_sidecar:
        volumes.append({
            "name": c.VOLUME_POLICY,
            "configMap": {"name": cm_name, "items": [{"key": c.POLICY_FILE, "path": c.POLICY_FILE}]},
        })  # fmt: skip
        if settings.fs_tier:
            volumes.append(
                {"name": c.VOLUME_L2_FS, "emptyDir": {"sizeLimit": format_bytes(settings.fs_tier.size_bytes)}}
            )

    init_containers: list[dict[str, Any]] = []
    containers: list[dict[str, Any]] = [engine_fragment]
    if settings.connector_source == "init-container":
        init_containers.append(_bundle_container(settings))
    if uses_sidecar:
        sidecar = _sidecar_container(settings, shm_volume, cluster.native_sidecars)
        (init_containers if cluster.native_sidecars else containers).append(sidecar)

    pod_spec: dict[str, Any] = {}
    if init_containers:
        pod_spec["initContainers"] = init_containers
    pod_spec["containers"] = containers
    pod_spec["volumes"] = volumes
    if uses_sidecar:
        # CUDA IPC needs the engine's and the cache server's PIDs to differ; one PID namespace
        # per pod guarantees that (two namespaces could both hand out the same PID).
        share = spec.get("shareProcessNamespace")
        if share is False and owned_by_others(workload, (*TEMPLATE_SPEC, "f:shareProcessNamespace"), c.FIELD_MANAGER):
            return PolicyError(
                "spec.template.spec.shareProcessNamespace", False,
                "kvoffload needs true (CUDA IPC needs distinct PIDs for engine and cache server); remove the field",
                reason="conflict",
            )  # fmt: skip
        pod_spec["shareProcessNamespace"] = True
    if settings.runtime_class_name and uses_sidecar and settings.gpu_access == "nvidia-runtime":
        current = spec.get("runtimeClassName")
        if (
            current
            and current != settings.runtime_class_name
            and owned_by_others(workload, (*TEMPLATE_SPEC, "f:runtimeClassName"), c.FIELD_MANAGER)
        ):
            warnings.append(
                f"runtimeClassName {current!r} is the user's; kvoffload wanted {settings.runtime_class_name!r} "
                "so the cache server sees the GPU; check that yours exposes it"
            )
        else:
            pod_spec["runtimeClassName"] = settings.runtime_class_name

    configmap_data = {
        c.TRTLLM_OPTIONS_FILE: options_text,
        c.POLICY_FILE: json.dumps(settings.policy_document(), sort_keys=True, indent=2) + "\n",
    }
    annotations: dict[str, str] = {}
    scrape, scrape_warning = _scrape_annotations(
        workload, *((c.SIDECAR_HTTP_PORT, c.SIDECAR_PORT_NAME) if uses_sidecar else
                    (c.ENGINE_METRICS_PORT, c.ENGINE_METRICS_PORT_NAME))
    )  # fmt: skip
    annotations.update(scrape)
    if scrape_warning:
        warnings.append(scrape_warning)
    if isinstance(plan, MergeFromConfigMap):
        annotations[c.ANN_ORIGINAL_OPTIONS_PATH] = plan.path
    annotations[c.ANN_INJECTED_VERSION] = cluster.operator_version
    labels = {c.LABEL_INJECTED: "true", **(node_cache.pod_labels if node_cache else {})}
    digest = config_hash({"metadata": {"annotations": annotations, "labels": labels}, "spec": pod_spec}, configmap_data)
    annotations[c.ANN_CONFIG_HASH] = digest

    body = _empty_body(workload)
    body["spec"] = {
        "template": {
            "metadata": {"annotations": dict(sorted(annotations.items())), "labels": labels},
            "spec": pod_spec,
        }
    }
    forceable: tuple[str, ...] = ()
    if "args" in engine_fragment and not isinstance(plan, AlreadyOurs):
        forceable = (conflict_path("containers", engine, "args"),)
    uid = meta.get("uid")
    owner: dict[str, Any] = {
        "apiVersion": SUPPORTED_KINDS[str(workload["kind"])],
        "kind": workload["kind"],
        "name": name,
    }
    if uid:
        owner["uid"] = uid
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": cm_name,
            "namespace": namespace,
            "labels": {c.LABEL_MANAGED_BY: c.LABEL_MANAGED_BY_VALUE},
            "annotations": {c.ANN_CONFIG_HASH: digest},
            "ownerReferences": [owner],
        },
        "data": configmap_data,
    }
    return RenderedInjection(
        workload_apply=body,
        configmap_apply=configmap,
        config_hash=digest,
        engine_container=engine,
        forceable_fields=forceable,
        warnings=tuple(warnings),
    )


def render_removal(workload: Mapping[str, Any]) -> RemovalPlan:
    """How to take the injection out so the template is the user's again.

    Normally one empty apply: the apiserver drops every field the operator owned. When the
    operator rewrote the engine's args it owns them alone, so an empty apply would delete them:
    first apply the user's args back, let a hand-off manager co-own that value, then release.
    """
    if not manages_anything(workload, c.FIELD_MANAGER):
        return RemovalPlan(steps=())
    empty = _empty_body(workload)
    original = None
    if owned_by(workload, (*TEMPLATE_META, "f:annotations", f"f:{c.ANN_ORIGINAL_OPTIONS_PATH}"), c.FIELD_MANAGER):
        original = _template_annotations(workload).get(c.ANN_ORIGINAL_OPTIONS_PATH)
    restored: list[dict[str, Any]] = []
    for x in _pod_spec(workload).get("containers") or []:
        cname = str(x.get("name"))
        if owned_by(workload, (*container_path("containers", cname), "f:args"), c.FIELD_MANAGER):
            restored.append({"name": cname, "args": strip_injected_args(x.get("args") or [], original)})
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
