"""What to inject into one workload, decided once: ``plan_injection(workload, settings, ...) -> InjectionPlan``.

Every decision that needs the workload, the settings or the cluster is taken here (which container
is the engine, how the TensorRT-LLM options reach it, its env, its /dev/shm, whether a cache server
rides along, what the user's pod-level fields allow); ``fragment.render`` only turns the plan into
apply bodies. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload import contract as c
from kvoffload.operator import __version__
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.trtllm_options import (
    ManualStep,
    MergeFromConfigMap,
    OptionsPlan,
    chunk_size_problem,
    desired_args,
    merged_options_yaml,
    model_layout_problem,
    plan_options,
    served_model,
)
from kvoffload.operator.intent.workload import GPU_RESOURCE, OUR_VOLUMES, SUPPORTED_KINDS, Container, Workload
from kvoffload.operator.plan.containers import engine_env, merge_engine_env, shm_size_limit
from kvoffload.policy_values import WORKLOAD_DEPENDENT, PolicyError
from kvoffload.quantity import QuantityError, format_bytes, parse_bytes


@dataclass(frozen=True)
class ClusterInfo:
    """Facts about the cluster that change what is injected."""

    native_sidecars: bool
    """The apiserver is >= 1.29: the cache server runs as an init container with restartPolicy Always."""
    operator_version: str = __version__
    injection: str = "template"
    """Where the injection lands: ``template`` (the workload's pod template, by Server-Side Apply) or
    ``admission`` (each pod as it is created, by the operator's webhook; the template gets one label)."""


@dataclass(frozen=True)
class NodeCacheWiring:
    """Node mode: the engine uses its node's shared cache pod instead of a sidecar."""

    server_url: str
    """The cache pods' node-local Service (``internalTrafficPolicy: Local``)."""
    shm_host_path: str
    """The node directory mounted at /dev/shm in the engine and in the node's cache pod."""
    pod_labels: Mapping[str, str]
    """Labels on the engine pods by which the operator finds the nodes needing a cache pod."""
    keys_secret: str
    """The policy's CURVE key Secret: the engine mounts its client files (``ENGINE_KEY_FILES``)."""


@dataclass(frozen=True)
class EngineChoice:
    """The engine container, as the user wrote it, and how its TensorRT-LLM options reach it."""

    container: Container
    """The engine container as the user wrote it."""
    options: OptionsPlan

    @property
    def name(self) -> str:
        return self.container.name

    @property
    def user_options_source(self) -> MergeFromConfigMap | None:
        """The user's ConfigMap holding their options file, when the handler must fetch it."""
        return self.options if isinstance(self.options, MergeFromConfigMap) else None


@dataclass(frozen=True)
class InjectionPlan:
    """Everything decided for one workload; :func:`kvoffload.operator.plan.fragment.render` renders it."""

    workload: Workload
    settings: InjectionSettings
    cluster: ClusterInfo
    engine: EngineChoice
    engine_args: list[str] | None
    """The engine's args to apply, or None to leave the field alone."""
    engine_env: list[dict[str, Any]]
    options_text: str
    user_options_yaml: str | None
    """The user's own options file (from their ConfigMap) the text was merged over."""
    user_shm_volume: str | None
    """The user's own /dev/shm volume, reused; None: kvoffload provides one."""
    node_cache: NodeCacheWiring | None
    uses_sidecar: bool
    """A cache server rides along in the pod (and so the pod shares one PID namespace)."""
    runtime_class_name: str | None
    warnings: tuple[str, ...]


def _shape_problem(workload: Workload) -> PolicyError | None:
    kind = workload.ref.kind
    if kind not in SUPPORTED_KINDS:
        return PolicyError("kind", kind, "Deployment or StatefulSet (apps/v1)", reason="unsupported")
    if not workload.containers:
        return PolicyError("spec.template.spec.containers", None, "at least one container", reason="unsupported")
    return None


def _engine_container(workload: Workload, settings: InjectionSettings) -> Container | PolicyError:
    """The TensorRT-LLM container: the annotated one, else the GPU one, else the only one."""
    containers = workload.user_containers
    names = [x.name for x in containers]
    if settings.container is not None:
        if settings.container in names:
            return workload.container(settings.container)
        return PolicyError(c.ANN_CONTAINER, settings.container, "one of the pod's containers: " + ", ".join(names))
    gpu = [x for x in containers if x.requests_gpu]
    if len(gpu) == 1:
        return workload.container(gpu[0].name)
    if len(containers) == 1:
        return workload.container(names[0])
    why = f"{len(gpu)} containers request {GPU_RESOURCE}" if gpu else f"no container requests {GPU_RESOURCE}"
    return PolicyError(
        c.ANN_CONTAINER, None,
        f"{why}; set {c.ANN_CONTAINER} to the TensorRT-LLM container, one of: " + ", ".join(names),
        reason="ambiguous_container",
    )  # fmt: skip


def _collision_problem(workload: Workload, engine: Container) -> PolicyError | None:
    """Names and paths we inject that the user already uses for something else."""
    if workload.reserved_name_taken is not None:
        list_name, name = workload.reserved_name_taken
        return PolicyError(
            f"spec.template.spec.{list_name}[{name}]", name,
            "kvoffload reserves this container name; rename your container", reason="conflict",
        )  # fmt: skip
    for v in workload.volumes:
        if v.get("name") in OUR_VOLUMES:
            return PolicyError(
                "spec.template.spec.volumes", v.get("name"),
                "kvoffload reserves this volume name; rename your volume", reason="conflict",
            )  # fmt: skip
    ours = (c.RUN_MOUNT_PATH, c.BUNDLE_MOUNT_PATH, c.TRTLLM_OPTIONS_MOUNT_PATH)
    for m in engine.spec.get("volumeMounts") or []:
        if str(m.get("mountPath", "")).rstrip("/") in ours:
            return PolicyError(
                f"container {engine.name} volumeMounts", m.get("mountPath"),
                "kvoffload mounts its own volume there; move your mount", reason="conflict",
            )  # fmt: skip
    return None


def choose_engine(workload: Workload, settings: InjectionSettings) -> EngineChoice | PolicyError:
    """The engine container and its options plan, or why the workload cannot be injected."""
    engine = _shape_problem(workload) or _engine_container(workload, settings)
    if isinstance(engine, PolicyError):
        return engine
    problem = _collision_problem(workload, engine)
    if problem:
        return problem
    model = served_model(engine.spec)
    layout_problem = model_layout_problem(model) if model else None
    if layout_problem:
        return PolicyError(f"container {engine.name} model", model, layout_problem, reason="unsupported")
    return EngineChoice(engine, plan_options(engine.spec, workload.volumes, workload.original_options_path))


def _user_shm_volume(
    workload: Workload, settings: InjectionSettings, engine: EngineChoice, node_cache: NodeCacheWiring | None
) -> str | None | PolicyError:
    """The user's own /dev/shm volume, reused if it can hold LMCache's L1 and the engine's share."""
    mounts = engine.container.spec.get("volumeMounts") or []
    user_shm = next((m for m in mounts if str(m.get("mountPath", "")).rstrip("/") == c.SHM_MOUNT_PATH), None)
    if user_shm is not None and node_cache is not None:
        return PolicyError(
            f"container {engine.name} volumeMounts", c.SHM_MOUNT_PATH,
            "mode node mounts the node's shared /dev/shm there (the cache pod's L1 lives in it); remove your mount",
            reason="conflict",
        )  # fmt: skip
    if user_shm is None:
        return None
    volume = next((v for v in workload.volumes if v.get("name") == user_shm.get("name")), {})
    limit = (volume.get("emptyDir") or {}).get("sizeLimit")
    needed = shm_size_limit(settings)
    try:
        size = parse_bytes(str(limit), "sizeLimit") if limit is not None else None
    except QuantityError:
        size = None  # a Kubernetes quantity our byte syntax does not cover: the apiserver judged it
    if size is not None and size < needed:
        return PolicyError(
            f"container {engine.name} volumeMounts {c.SHM_MOUNT_PATH} (volume {user_shm.get('name')})",
            f"sizeLimit {limit}",
            f"at least {format_bytes(needed)}: LMCache keeps its L1 ({format_bytes(settings.l1_bytes)}) in /dev/shm "
            "beside the engine's share, and without room falls back to a path ~100x slower where no load can be "
            "secured; raise the sizeLimit, or remove the mount and kvoffload provides one",
            reason="shm_too_small",
        )  # fmt: skip
    return str(user_shm["name"])


def _options(engine: EngineChoice, settings: InjectionSettings, user_options_yaml: str | None) -> str | PolicyError:
    """The options file the engine gets: ours, merged over the user's where they keep one in a ConfigMap."""
    plan = engine.options
    text, error = merged_options_yaml(user_options_yaml if isinstance(plan, MergeFromConfigMap) else None)
    if error:
        assert isinstance(plan, MergeFromConfigMap)
        return PolicyError(f"ConfigMap {plan.configmap} key {plan.key}", "<file>", error, reason="invalid_options")
    # Where the engine's options are known (ours, or merged from the user's ConfigMap), a chunk size
    # its blocks do not divide is refused here, not by the connector when the engine starts.
    chunk_problem = None if isinstance(plan, ManualStep) else chunk_size_problem(text, settings.chunk_size)
    if chunk_problem:
        return PolicyError("cache.chunkSize", settings.chunk_size, chunk_problem, reason=WORKLOAD_DEPENDENT)
    return text


def _pod_level(workload: Workload, settings: InjectionSettings, uses_sidecar: bool, cache_in_pod: bool
               ) -> tuple[str | None, list[str]] | PolicyError:  # fmt: skip
    """(runtime class to set, warnings) as the user's pod-level fields allow, or why they conflict."""
    pod = workload.pod
    warnings: list[str] = []
    if cache_in_pod and pod.host_network:
        # LMCache's request port and admin API have no authentication; loopback keeps them to the
        # pod, but a host-network pod's loopback is the node's, shared by every pod and process on it.
        return PolicyError(
            "spec.template.spec.hostNetwork", True,
            "the cache server listens on loopback without authentication, and with hostNetwork that is the "
            "node's loopback: anything on the node could read, overwrite or clear the cache and reach its "
            "admin API; remove hostNetwork, or use mode node (the cache runs in its own pod)",
            reason="host_network",
        )  # fmt: skip
    if uses_sidecar and pod.process_namespace_kept_apart:
        # CUDA IPC needs the engine's and the cache server's PIDs to differ; one PID namespace
        # per pod guarantees that (two namespaces could both hand out the same PID).
        return PolicyError(
            "spec.template.spec.shareProcessNamespace", False,
            "kvoffload needs true (CUDA IPC needs distinct PIDs for engine and cache server); remove the field",
            reason="conflict",
        )  # fmt: skip
    runtime_class = None
    if settings.runtime_class_name and uses_sidecar and settings.gpu_access == "nvidia-runtime":
        current = pod.runtime_class_name
        if current and current != settings.runtime_class_name and pod.runtime_class_is_users:
            warnings.append(
                f"runtimeClassName {current!r} is the user's; kvoffload wanted {settings.runtime_class_name!r} "
                "so the cache server sees the GPU; check that yours exposes it"
            )
        else:
            runtime_class = settings.runtime_class_name
    return runtime_class, warnings


def plan_injection(
    workload: Workload,
    settings: InjectionSettings,
    cluster: ClusterInfo,
    engine: EngineChoice,
    user_options_yaml: str | None = None,
    node_cache: NodeCacheWiring | None = None,
) -> InjectionPlan | PolicyError:
    """The plan for an opted-in workload whose engine :func:`choose_engine` found.

    ``user_options_yaml`` is the user's options file when ``engine.user_options_source`` named a
    ConfigMap (the handler fetched it); ``node_cache`` wires the engine to its node's cache pod.
    """
    warnings = [engine.options.message] if isinstance(engine.options, ManualStep) else []
    args = desired_args(engine.container.spec.get("args") or [], engine.options)
    if args is None and engine.container.we_own_args:
        args = list(engine.container.spec.get("args") or [])  # keep the user's value while we still own the field
    options_text = _options(engine, settings, user_options_yaml)
    if isinstance(options_text, PolicyError):
        return options_text
    url = node_cache.server_url if node_cache else c.server_url(c.REQUEST_PORT)
    uses_sidecar = settings.backend == c.BACKEND_SIDECAR and node_cache is None
    env, env_error = merge_engine_env(
        engine_env(settings, url, serve_metrics=not uses_sidecar, cache_keys=node_cache is not None),
        engine.container.spec.get("env") or [],
        engine.name,
    )
    if env_error:
        return env_error
    user_shm = _user_shm_volume(workload, settings, engine, node_cache)
    if isinstance(user_shm, PolicyError):
        return user_shm
    pod_level = _pod_level(workload, settings, uses_sidecar, cache_in_pod=node_cache is None)
    if isinstance(pod_level, PolicyError):
        return pod_level
    runtime_class, pod_warnings = pod_level
    return InjectionPlan(
        workload=workload, settings=settings, cluster=cluster, engine=engine, engine_args=args, engine_env=env,
        options_text=options_text, user_options_yaml=user_options_yaml, user_shm_volume=user_shm, node_cache=node_cache, uses_sidecar=uses_sidecar,
        runtime_class_name=runtime_class, warnings=(*warnings, *pod_warnings),
    )  # fmt: skip
