"""The memory a pod asks for: a container's request as Kubernetes reads it, and the injected cache
server's resources (rendered with the container by ``containers``, summed by ``node_fit``)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.quantity import format_bytes, kubernetes_bytes


def memory_request_bytes(resources: Mapping[str, Any] | None) -> int:
    """The memory a container's ``resources`` request: its request, else its limit (which Kubernetes
    then takes as the request), else none."""
    res = resources or {}
    amount = (res.get("requests") or {}).get("memory") or (res.get("limits") or {}).get("memory")
    return (kubernetes_bytes(amount) or 0) if amount is not None else 0


def cache_server_memory_bytes(settings: InjectionSettings) -> int:
    """The memory the injected cache-server container requests (the resources it is rendered with)."""
    return memory_request_bytes(sidecar_resources(settings))


def sidecar_resources(settings: InjectionSettings) -> dict[str, Any]:
    """The cache-server container's resources: the policy's, else its L1 and overhead as request and limit."""
    if settings.sidecar_resources:
        return copy.deepcopy(dict(settings.sidecar_resources))
    memory = format_bytes(settings.l1_bytes + settings.sidecar_memory_overhead_bytes)
    return {
        "requests": {"cpu": settings.sidecar_cpu_request, "memory": memory},
        "limits": {"memory": memory},
    }
