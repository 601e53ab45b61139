"""What the user's own pod fields allow the injection, decided from the workload as read: their
/dev/shm volume is reused if it can hold LMCache's L1, hostNetwork is refused while a cache server
shares the pod's loopback, ``shareProcessNamespace: false`` is refused where CUDA IPC needs one PID
namespace, and a runtime class of theirs is kept with a warning. Pure."""

from __future__ import annotations

from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.workload import Container, Workload
from kvoffload.operator.plan.node_wiring import NodeCacheWiring
from kvoffload.policy_values import PolicyError
from kvoffload.quantity import QuantityError, format_bytes, parse_bytes


def user_shm_volume(
    workload: Workload, settings: InjectionSettings, engine: Container, node_cache: NodeCacheWiring | None, needed: int
) -> str | None | PolicyError:
    """The user's own /dev/shm volume, reused if it can hold ``needed`` bytes (LMCache's L1 and the engine's share)."""
    mounts = engine.spec.get("volumeMounts") or []
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


def pod_level_fields(workload: Workload, settings: InjectionSettings, uses_sidecar: bool, cache_in_pod: bool
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
