"""Which workloads take their TensorRT-LLM options from which of the user's ConfigMaps."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass
class OptionsSources:
    """(namespace, ConfigMap) -> the workloads (kind, name) whose options file is merged from it."""

    _by_configmap: dict[tuple[str, str], set[tuple[str, str]]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def track(self, workload: Mapping[str, Any], configmap: str | None) -> None:
        """The workload's options come from ``configmap`` now (None: from none)."""
        meta = workload.get("metadata") or {}
        namespace, ref = str(meta.get("namespace")), (str(workload.get("kind")), str(meta.get("name")))
        with self._lock:
            for key, refs in list(self._by_configmap.items()):
                if key[0] == namespace and key[1] != configmap:
                    refs.discard(ref)
                    if not refs:
                        del self._by_configmap[key]
            if configmap is not None:
                self._by_configmap.setdefault((namespace, configmap), set()).add(ref)

    def workloads(self, namespace: str, configmap: str) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._by_configmap.get((namespace, configmap), ()))
