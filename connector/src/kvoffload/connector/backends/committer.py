"""The committer: one backend's deferred COMMITs, sent on a thread of its own (``commits`` says why)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from kvoffload.connector.backends.commits import Chain, DeferredCommit, PendingCommits
from kvoffload.connector.backends.connection import ServerConnection, failure_reason
from kvoffload.connector.backends.segments import Segment, Segments
from kvoffload.connector.backends.store_reports import StoreReporter
from kvoffload.connector.lmcache_seam import IPCCacheServerKey
from kvoffload.connector.metrics import ConnectorMetrics

logger = logging.getLogger("kvoffload.connector")

COMMIT_ATTEMPTS = 3
"""Sends of one COMMIT at most: a connection reset under a COMMIT to a server that is still there
sends it again on the new connection."""


class Committer:
    """Sends one backend's deferred COMMITs on a thread of its own, in the order they were queued,
    to the server that prepared them, through whichever connection reaches it then."""

    def __init__(self, role: str, instance_id: int | None, connection: ServerConnection, segments: Segments,
                 pending: PendingCommits, metrics: ConnectorMetrics, reports: StoreReporter | None) -> None:  # fmt: skip
        self._instance_id = instance_id
        self._connection = connection
        self._segments = segments
        self._pending = pending
        self._metrics = metrics
        self._reports = reports
        """Reports committed stores to the server's KV-event module (opt-in)."""
        self._queue: queue.Queue[DeferredCommit | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"kvoffload-commit-{role}", daemon=True)
        self._thread.start()

    def later(self, operation: str, key: IPCCacheServerKey, chain: Chain | None, prepared_on: tuple[Any, Segment | None]
              ) -> None:  # fmt: skip
        """Queue the COMMIT of a finished copy prepared on ``prepared_on`` (transfer context, segment)."""
        commit = DeferredCommit(operation, prepared_on[0], key, chain, prepared_on[1])
        self._pending.add(commit)
        self._queue.put(commit)

    def close(self, timeout_s: float) -> None:
        """Send what is queued (waiting at most ``timeout_s``), then stop."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                self.send(item)
            except Exception:  # the committer must outlive any one COMMIT
                logger.exception("event=commit_failed operation=%s", item.operation)
            finally:
                self._pending.done(item)

    def send(self, item: DeferredCommit) -> None:
        """Send one COMMIT and wait for its answer, without holding the transfer lock meanwhile (the
        MQ client takes requests from any thread): lookups, secures and copies go on during it. A
        reset under it sends it again to the same server; it is dropped only once that server is gone."""
        for _attempt in range(COMMIT_ATTEMPTS):
            transfer = self._segments.commit_target(item.transfer, item.segment)
            if transfer is None:
                self._dropped(item)
                return
            edc = transfer.engine_driven_context
            start = time.perf_counter()
            try:
                ok = True
                if item.operation == "store":
                    ok = bool(edc.commit_store(item.key, self._instance_id, []))
                else:
                    edc.commit_retrieve(item.key, self._instance_id)  # releases the slots; the KV is already in
            except Exception as exc:
                if not self._segments.is_current(transfer):  # reset under it: send it again where it belongs
                    continue
                self._connection.fail(item.operation, failure_reason(exc), f"COMMIT: {exc!r}")
                return
            if not ok:
                self._metrics.error(item.operation, "server_error")
                logger.warning("event=commit_refused operation=%s session=%s", item.operation, item.key.request_id)
            elif item.operation == "store" and self._reports is not None:
                self._reports.report(self._connection.client, item.key)
            logger.debug("event=commit_timing op=%s commit_ms=%.3f", item.operation,
                         (time.perf_counter() - start) * 1e3)  # fmt: skip
            return
        self._dropped(item)

    def _dropped(self, item: DeferredCommit) -> None:
        """Reconnected meanwhile: that server (and its reservation) is gone; a store is lost."""
        if item.operation == "store":
            self._metrics.error("store", "unavailable")
        logger.warning("event=commit_dropped operation=%s session=%s", item.operation, item.key.request_id)
