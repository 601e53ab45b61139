"""Events on workloads: each distinct (object, state, message) posted once, as ``kvoffload-operator``;
Normal ones only when asked for (``--events all``)."""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

from kvoffload import contract as c
from kvoffload.operator.api.kube import Kube, KubeApiError, events_path
from kvoffload.operator.intent.workload import WorkloadRef

log = logging.getLogger("kvoffload.operator")
EVENT_MESSAGE_LIMIT = 1000


def now_timestamp() -> str:
    """The current time as Kubernetes writes it (RFC 3339, seconds, UTC)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class EventRecorder:
    """Posts core/v1 Events about workloads, each distinct (object, state, message) once; Normal ones
    (what went as asked: injected, removed) only with ``normal``."""

    kube: Kube
    normal: bool = False
    _seen: dict[tuple[str, ...], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def post(self, about: WorkloadRef, type_: str, reason: str, message: str, state: str = "") -> None:
        if type_ == "Normal" and not self.normal:
            return
        dedupe = (str(about), about.uid, state, reason, message)
        with self._lock:
            if dedupe in self._seen:
                return
            if len(self._seen) > 10000:
                self._seen.clear()
            self._seen[dedupe] = time.monotonic()
        now = now_timestamp()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{about.name}.", "namespace": about.namespace},
            "involvedObject": {
                "apiVersion": about.api_version,
                "kind": about.kind,
                "name": about.name,
                "namespace": about.namespace,
                "uid": about.uid or None,
                "resourceVersion": about.resource_version,
            },
            "type": type_,
            "reason": reason,
            "message": message[:EVENT_MESSAGE_LIMIT],
            "source": {"component": c.FIELD_MANAGER},
            "reportingComponent": c.FIELD_MANAGER,
            "reportingInstance": socket.gethostname(),
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.kube.create(events_path(about.namespace), event)
        except KubeApiError as exc:
            log.warning("event not posted: %s", exc)
