"""Will an injected pod fit on a GPU node? Decided before it is injected, from the nodes' allocatable memory.

A pod whose memory requests (the user's containers plus the cache server with its L1) exceed every
GPU node's allocatable memory would stay Pending; the operator refuses it with a Warning instead.
Pure: the nodes are listed by :mod:`kvoffload.operator.node.gpu_nodes`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.workload import GPU_RESOURCE, Workload
from kvoffload.operator.plan.pod_memory import cache_server_memory_bytes, memory_request_bytes
from kvoffload.policy_values import PolicyError
from kvoffload.quantity import format_bytes, kubernetes_bytes


def user_memory_requests(workload: Workload) -> int:
    """The memory the workload's containers request (a limit counts where no request is set)."""
    return sum(memory_request_bytes(x.spec.get("resources")) for x in workload.containers)


def largest_gpu_node_memory(nodes: Iterable[Mapping[str, Any]]) -> int | None:
    """The largest allocatable memory among nodes offering GPUs; None when no node offers one."""
    sizes = [
        kubernetes_bytes((n.get("status") or {}).get("allocatable", {}).get("memory")) or 0
        for n in nodes
        if (kubernetes_bytes(((n.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, 0)) or 0) > 0
    ]
    return max(sizes) if sizes else None


def node_fit_problem(workload: Workload, settings: InjectionSettings, largest: int | None) -> PolicyError | None:
    """Why no GPU node could run the injected pod, or None (also when no GPU node is known)."""
    if largest is None or settings.backend != c.BACKEND_SIDECAR or settings.mode != "sidecar":
        return None
    needed = user_memory_requests(workload) + cache_server_memory_bytes(settings)
    if needed <= largest:
        return None
    return PolicyError(
        "cache.l1Size", format_bytes(settings.l1_bytes),
        f"an L1 that fits a GPU node: the pod would request {format_bytes(needed)} of memory (the engine's "
        f"requests plus the cache server's L1 and overhead) and the largest GPU node allocates "
        f"{format_bytes(largest)}, so it would stay Pending",
        reason="no_node_fits",
    )  # fmt: skip
