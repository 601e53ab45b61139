"""What to inject into one workload, decided once: ``plan_workload(workload, settings, ...) -> InjectionPlan``.

Every decision that needs the workload, the settings or the cluster is taken here (how a node-mode
engine reaches its node's cache, which container is the engine, its TensorRT-LLM args and options
file, its env, its /dev/shm, whether a cache server rides along, what the user's pod-level fields
allow); ``fragment.render`` only turns the plan into apply bodies. Pure but for the reader of the
user's options ConfigMap it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload import contract as c
from kvoffload.operator import __version__
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.trtllm_options import ManualStep, MergeFromConfigMap, options_file_mode
from kvoffload.operator.intent.workload import (
    GPU_RESOURCE,
    OUR_VOLUMES,
    SUPPORTED_KINDS,
    Container,
    Workload,
    WorkloadRef,
)
from kvoffload.operator.plan.containers import engine_env, merge_engine_env, shm_size_limit
from kvoffload.operator.plan.node_wiring import NodeCacheWiring
from kvoffload.operator.plan.options_file import engine_options, unreadable_in_pod
from kvoffload.operator.plan.user_pod import pod_level_fields, user_shm_volume
from kvoffload.policy_values import PolicyError
from kvoffload.trtllm_options_merge import options_digest


@dataclass(frozen=True)
class ClusterInfo:
    """Facts about the cluster that change what is injected."""

    native_sidecars: bool
    """The apiserver is >= 1.29: the cache server runs as an init container with restartPolicy Always."""
    operator_version: str = __version__
    injection: str = "template"
    """Where the injection lands: ``template`` (the workload's pod template, by Server-Side Apply) or
    ``admission`` (each pod as it is created, by the operator's webhook; the template gets one label)."""
    webhook_excluded_namespaces: frozenset[str] = frozenset()
    """Admission mode: namespaces the webhook's registration never sends (kube-system, the operator's
    own); a workload opted in there is refused, never labelled."""

    @property
    def writes_configmaps(self) -> bool:
        """Template mode keeps each workload's files in a generated ConfigMap; admission mode writes
        none (the chart grants it no ConfigMap write), so it never deletes one either."""
        return self.injection != "admission"


OptionsReader = Callable[[WorkloadRef, MergeFromConfigMap | None], Mapping[str, Any] | None]
"""Reads the ConfigMap holding the user's options file (None: it does not exist, or there is no
source); told of every plan, also of one without a source (the caller tracks which workload merges
which ConfigMap)."""


@dataclass(frozen=True)
class RecordedOptions:
    """The user's options file as read already (an injection record's, an earlier plan's): planning
    with it reads nothing."""

    text: str | None = None


@dataclass(frozen=True)
class CheckedOptions:
    """The user's options file known only by its digest (an injection record's, read by the webhook
    for a pod): the operator read and checked the file when it planned the record, and the pod's init
    step merges it from the ConfigMap, so planning with it reads nothing and checks nothing of the
    file again (``options_file.engine_options``). The webhook's answers then hold no options text.

    Re-checking at pod time could only catch a file edited since the record was planned; the
    operator re-plans on such an edit (``intent.options_sources``) and the pod's init step says so."""

    digest: str | None = None


@dataclass(frozen=True)
class InjectionPlan:
    """Everything decided for one workload; :func:`kvoffload.operator.plan.fragment.render` renders it."""

    workload: Workload
    settings: InjectionSettings
    cluster: ClusterInfo
    engine: Container
    """The engine container as the user wrote it."""
    engine_args: list[str] | None
    """The engine's args to apply, or None to leave the field alone."""
    engine_env: list[dict[str, Any]]
    options_text: str | None
    """The merged options file; None where the pod's init step merges it (planned from ``CheckedOptions``)."""
    user_options_yaml: str | None
    """The user's own options file (from their ConfigMap) the text was merged over (None where only
    its digest is known)."""
    user_options_digest: str | None
    """sha256 of the user's options file (None: the engine's options come from no ConfigMap)."""
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
            return containers[names.index(settings.container)]
        return PolicyError(c.ANN_CONTAINER, settings.container, "one of the pod's containers: " + ", ".join(names))
    gpu = [x for x in containers if x.requests_gpu]
    if len(gpu) == 1:
        return gpu[0]
    if len(containers) == 1:
        return containers[0]
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


def choose_engine(workload: Workload, settings: InjectionSettings) -> Container | PolicyError:
    """The engine container, or why the workload cannot be injected."""
    engine = _shape_problem(workload) or _engine_container(workload, settings)
    if isinstance(engine, PolicyError):
        return engine
    return _collision_problem(workload, engine) or engine


def plan_workload(workload: Workload, settings: InjectionSettings, cluster: ClusterInfo,
                  options: OptionsReader | RecordedOptions | CheckedOptions, node_cache: NodeCacheWiring | None = None
                  ) -> InjectionPlan | PolicyError:  # fmt: skip
    """The plan for an opted-in workload, the one sequence every caller runs: choose the engine, take
    the user's options file (read through ``options`` where a ConfigMap holds it, or as recorded
    already) and plan the rest (``plan_injection``); ``node_cache`` wires a node-mode engine to its
    node's cache pod (``node_wiring.node_cache_wiring``). The caller renders the plan for its mode."""
    engine = choose_engine(workload, settings)
    if isinstance(engine, PolicyError):
        return engine
    if isinstance(options, CheckedOptions):
        return plan_injection(workload, settings, cluster, engine, None, node_cache, checked=options)
    if isinstance(options, RecordedOptions):
        user_options = options.text
    else:
        read = _read_user_options(workload, engine, options)
        if isinstance(read, PolicyError):
            return read
        user_options = read
    return plan_injection(workload, settings, cluster, engine, user_options, node_cache)


def _read_user_options(workload: Workload, engine: Container, read_options: OptionsReader) -> str | None | PolicyError:
    """The user's options file from the ConfigMap the engine's options come from (None: no ConfigMap)."""
    source = engine.options if isinstance(engine.options, MergeFromConfigMap) else None
    configmap = read_options(workload.ref, source)
    if source is None:
        return None
    user_options = ((configmap or {}).get("data") or {}).get(source.key)
    if user_options is None:
        what = "does not exist" if configmap is None else f"has no key {source.key!r}"
        return PolicyError(
            f"ConfigMap {source.configmap}", source.key,
            f"the TensorRT-LLM options file {source.path} comes from it but it {what}", reason="options_missing",
        )  # fmt: skip
    return user_options


def options_unreadable_in_pod(workload: Workload, engine: Container) -> PolicyError | None:
    """Admission mode merges the user's options file in the pod (``OPTIONS_INIT_CONTAINER``, uid
    65532): a file mode that keeps it out refuses the workload before a pod would stop there."""
    source = engine.options
    if not isinstance(source, MergeFromConfigMap):
        return None
    mode = options_file_mode(source.path, engine.spec, workload.volumes)
    problem = None if mode is None else unreadable_in_pod(mode, workload.pod.fs_group)
    if problem is None:
        return None
    return PolicyError(f"the ConfigMap volume holding {source.path}", f"{mode:#o}", problem, reason="invalid_options")


def plan_injection(
    workload: Workload,
    settings: InjectionSettings,
    cluster: ClusterInfo,
    engine: Container,
    user_options_yaml: str | None = None,
    node_cache: NodeCacheWiring | None = None,
    checked: CheckedOptions | None = None,
) -> InjectionPlan | PolicyError:
    """The plan for an opted-in workload whose engine :func:`choose_engine` found.

    ``user_options_yaml`` is the user's options file where the engine's options come from a
    ConfigMap; ``node_cache`` wires the engine to its node's cache pod; ``checked``: instead of the
    file, its digest only, from a record (the pod's init step merges the file).
    """
    options = engine_options(engine, settings, user_options_yaml, merged_in_pod=checked is not None)
    if isinstance(options, PolicyError):
        return options
    unreadable = options_unreadable_in_pod(workload, engine) if cluster.injection == "admission" else None
    if unreadable is not None:
        return unreadable
    args, options_text = options
    url = node_cache.server_url if node_cache else c.server_url(c.REQUEST_PORT)
    uses_sidecar = settings.backend == c.BACKEND_SIDECAR and node_cache is None
    ours = engine_env(settings, url, serve_metrics=not uses_sidecar, cache_keys=node_cache is not None)
    env, env_error = merge_engine_env(ours, engine.spec.get("env") or [], engine.name)
    if env_error:
        return env_error
    shm_bytes = shm_size_limit(settings)
    user_shm = user_shm_volume(workload, settings, engine, node_cache, shm_bytes)
    if isinstance(user_shm, PolicyError):
        return user_shm
    pod_level = pod_level_fields(workload, settings, uses_sidecar, cache_in_pod=node_cache is None)
    if isinstance(pod_level, PolicyError):
        return pod_level
    runtime_class, pod_warnings = pod_level
    warnings = [engine.options.message] if isinstance(engine.options, ManualStep) else []
    return InjectionPlan(
        workload=workload, settings=settings, cluster=cluster, engine=engine, engine_args=args, engine_env=env,
        options_text=options_text, user_options_yaml=user_options_yaml, user_shm_volume=user_shm,
        user_options_digest=checked.digest if checked is not None else _digest_of(engine, user_options_yaml),
        node_cache=node_cache, uses_sidecar=uses_sidecar, runtime_class_name=runtime_class,
        warnings=(*warnings, *pod_warnings),
    )  # fmt: skip


def _digest_of(engine: Container, user_options_yaml: str | None) -> str | None:
    """The digest an injection record keeps of the user's options file (where they come from a ConfigMap)."""
    if not isinstance(engine.options, MergeFromConfigMap) or user_options_yaml is None:
        return None
    return options_digest(user_options_yaml)
