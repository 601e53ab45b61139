"""Events on workloads: each distinct (object, state, message) posted once, as ``kvoffload-operator``;
Normal ones only when asked for (``--events all``)."""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.api.kube import Kube, KubeApiError, events_path

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

    def post(self, obj: Mapping[str, Any], type_: str, reason: str, message: str, state: str = "") -> None:
        if type_ == "Normal" and not self.normal:
            return
        meta = obj.get("metadata") or {}
        dedupe = (str(meta.get("uid")), state, reason, message)
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
            "metadata": {"generateName": f"{meta.get('name')}.", "namespace": meta.get("namespace")},
            "involvedObject": {
                "apiVersion": obj.get("apiVersion"),
                "kind": obj.get("kind"),
                "name": meta.get("name"),
                "namespace": meta.get("namespace"),
                "uid": meta.get("uid"),
                "resourceVersion": meta.get("resourceVersion"),
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
            self.kube.create(events_path(str(meta.get("namespace"))), event)
        except KubeApiError as exc:
            log.warning("event not posted: %s", exc)
