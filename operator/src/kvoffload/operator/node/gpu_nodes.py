"""The largest GPU node's allocatable memory, for the fit check in :mod:`kvoffload.operator.plan.node_fit`.

The nodes are listed at most every ``NODES_TTL_S`` (their sizes rarely change).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from kvoffload.operator.api.kube import Kube, KubeApiError
from kvoffload.operator.plan.node_fit import largest_gpu_node_memory

log = logging.getLogger("kvoffload.operator")
NODES_TTL_S = 30.0


@dataclass
class GpuNodeMemory:
    """The largest GPU node's allocatable memory, listed at most every ``NODES_TTL_S``."""

    kube: Kube
    _value: int | None = None
    _listed_at: float = float("-inf")
    _unreadable_logged: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def largest(self) -> int | None:
        with self._lock:
            if time.monotonic() - self._listed_at < NODES_TTL_S:
                return self._value
            try:
                nodes = self.kube.request("GET", "/api/v1/nodes").get("items") or []
            except KubeApiError as exc:  # no right to list nodes (RBAC edited by hand): skip the check, say so once
                if not self._unreadable_logged:
                    log.warning("node fit not checked: cannot list nodes (%s)", exc)
                    self._unreadable_logged = True
                nodes = []
            self._value, self._listed_at = largest_gpu_node_memory(nodes), time.monotonic()
            return self._value
