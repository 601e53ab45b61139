"""Events on workloads: each distinct (object, state, message) posted once, as ``kvoffload-operator``.

The operator posts them from one background thread, so a reconcile never waits for its Event (a
write that decides nothing); ``flush`` drains them at shutdown."""

from __future__ import annotations

import datetime
import logging
import queue
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload import contract as c

from .kube import Kube, KubeApiError, events_path

log = logging.getLogger("kvoffload.operator")
EVENT_MESSAGE_LIMIT = 1000


def now_timestamp() -> str:
    """The current time as Kubernetes writes it (RFC 3339, seconds, UTC)."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class EventRecorder:
    """Posts core/v1 Events about workloads, each distinct (object, state, message) once.

    ``background``: posted by a thread of its own, in order; otherwise in the caller's thread.
    """

    kube: Kube
    background: bool = False
    _seen: dict[tuple[str, ...], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _queue: queue.Queue[tuple[str, dict[str, Any]]] = field(default_factory=queue.Queue)
    _poster: threading.Thread | None = None

    def post(self, obj: Mapping[str, Any], type_: str, reason: str, message: str, state: str = "") -> None:
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
        namespace = str(meta.get("namespace"))
        if not self.background:
            self._create(namespace, event)
            return
        with self._lock:
            if self._poster is None:
                self._poster = threading.Thread(target=self._post_loop, name="kvoffload-events", daemon=True)
                self._poster.start()
        self._queue.put((namespace, event))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued Event was posted (or ``timeout_s`` passed); True if none is left."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def _post_loop(self) -> None:
        while True:
            namespace, event = self._queue.get()
            try:
                self._create(namespace, event)
            finally:
                self._queue.task_done()

    def _create(self, namespace: str, event: dict[str, Any]) -> None:
        try:
            self.kube.create(events_path(namespace), event)
        except KubeApiError as exc:
            log.warning("event not posted: %s", exc)
        except Exception:  # the poster must outlive any one Event
            log.exception("event not posted")
