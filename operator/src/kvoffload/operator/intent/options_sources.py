"""Which workloads take their TensorRT-LLM options from which of the user's ConfigMaps."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload.operator.intent.workload import WorkloadRef


@dataclass
class OptionsSources:
    """(namespace, ConfigMap) -> the workloads (kind, name) whose options file is merged from it."""

    _by_configmap: dict[tuple[str, str], set[tuple[str, str]]] = field(default_factory=dict)
    _versions: dict[tuple[str, str], str] = field(default_factory=dict)
    """The resourceVersion each ConfigMap had when it was last merged or checked."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def track(self, workload: WorkloadRef, configmap: str | None) -> None:
        """The workload's options come from ``configmap`` now (None: from none)."""
        namespace, ref = workload.namespace, (workload.kind, workload.name)
        with self._lock:
            for key, refs in list(self._by_configmap.items()):
                if key[0] == namespace and key[1] != configmap:
                    refs.discard(ref)
                    if not refs:
                        del self._by_configmap[key]
                        self._versions.pop(key, None)
            if configmap is not None:
                self._by_configmap.setdefault((namespace, configmap), set()).add(ref)

    def workloads(self, namespace: str, configmap: str) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._by_configmap.get((namespace, configmap), ()))

    def configmaps(self) -> list[tuple[str, str]]:
        with self._lock:
            return sorted(self._by_configmap)

    def saw(self, namespace: str, configmap: str, version: str | None) -> bool:
        """Record the version seen now; True when it differs from the one seen before (an edit)."""
        key = (namespace, configmap)
        with self._lock:
            previous = self._versions.get(key)
            if version is None:
                self._versions.pop(key, None)
            else:
                self._versions[key] = version
        return previous is not None and previous != version

    def edited(self, get: Callable[[str, str], Mapping[str, Any] | None]) -> list[tuple[str, str]]:
        """GET (through ``get``) each ConfigMap a workload merges; the ones edited or deleted since they
        were last seen. A few per cluster, every few seconds: the operator may not list or watch
        every ConfigMap in the cluster."""
        edited = []
        for namespace, name in self.configmaps():
            cm = get(namespace, name)
            if self.saw(namespace, name, ((cm or {}).get("metadata") or {}).get("resourceVersion")):
                edited.append((namespace, name))
        return edited
