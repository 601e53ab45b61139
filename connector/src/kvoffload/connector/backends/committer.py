"""The committer: one backend's deferred COMMITs, sent on a thread of its own (``commits`` says why),
and the aborts of stores that will not be finished.

An abort is a COMMIT_STORE carrying ``contract.STORE_ABORT_PAYLOAD``: the server's transfer guard
discards the reservation instead of publishing it. Aborts go to the server that prepared the store;
one that could not be sent (the server stalled, the connection reset) is kept and sent again once the
connection is up (``retry_aborts``, from the heartbeat), until it is answered or its server is gone
(a restarted server holds none of its predecessor's reservations). While any is kept, the backend
does not unregister its context at close: the server's release of a context (a patched one drops
pending reservations; LMCache 0.5.6's own publishes them) is never where an unfinished store ends."""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvoffload import contract
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
        self._unaborted: list[DeferredCommit] = []
        """Aborts not answered yet (kept for ``retry_aborts``)."""
        self._unaborted_lock = threading.Lock()
        self._stranded = 0
        """Aborts the server failed as a bad payload (it runs without kvoffload's transfer guard)."""
        self._open = True
        """False once ``close`` queued its stop: nothing is queued after it (nothing would send it)."""
        self._open_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=f"kvoffload-commit-{role}", daemon=True)
        self._thread.start()

    def later(self, operation: str, key: IPCCacheServerKey, chain: Chain | None, prepared_on: tuple[Any, Segment | None],
              on_done: Callable[[], None] | None = None) -> None:  # fmt: skip
        """Queue the COMMIT of a finished copy prepared on ``prepared_on`` (transfer context, segment);
        ``on_done`` is called once it was answered or dropped."""
        commit = DeferredCommit(operation, prepared_on[0], key, chain, prepared_on[1], on_done)
        with self._open_lock:
            if self._open:
                self._pending.add(commit)
                self._queue.put(commit)
                return
        self._refused_after_close(commit)

    def abort(self, key: IPCCacheServerKey, prepared_on: tuple[Any, Segment | None]) -> None:
        """Queue the abort of a store's reservation of ``key`` (prepared on ``prepared_on``): it is
        discarded, never published (sent after the COMMITs queued before it)."""
        self.later("abort", key, None, prepared_on)

    def retry_aborts(self) -> None:
        """Queue again the aborts that could not be sent (the heartbeat calls it once the server answers).
        After ``close`` they stay kept: the backend then leaves its context registered."""
        with self._open_lock:
            if not self._open:
                return
            with self._unaborted_lock:
                kept, self._unaborted = self._unaborted, []
            for item in kept:
                self._pending.add(item)
                self._queue.put(item)

    @property
    def unaborted(self) -> int:
        """Aborts not answered yet: reservations the server may still hold for this worker."""
        with self._unaborted_lock:
            return len(self._unaborted) + self._stranded

    def _keep_abort(self, item: DeferredCommit) -> None:
        """Keep an unanswered abort (or the abort of a store whose COMMIT's fate is unknown) for later."""
        abort = (
            item if item.operation == "abort" else DeferredCommit("abort", item.transfer, item.key, None, item.segment)
        )
        abort = dataclasses.replace(abort, on_done=None)
        with self._unaborted_lock:
            self._unaborted.append(abort)

    def close(self, timeout_s: float) -> None:
        """Send what is queued (waiting at most ``timeout_s``), then stop; what is queued later (a
        heartbeat's retry racing the close) is refused, never left pending."""
        with self._open_lock:
            self._open = False
            self._queue.put(None)
        self._thread.join(timeout=timeout_s)

    def _refused_after_close(self, item: DeferredCommit) -> None:
        """A COMMIT queued after ``close``: a store's reservation is kept to abort (so the context is
        not unregistered over it), a load's slots go with the context."""
        if item.operation in ("store", "abort"):
            self._keep_abort(item)
        logger.warning("event=commit_after_close operation=%s session=%s", item.operation, item.key.request_id)
        if item.on_done is not None:
            item.on_done()

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
                if item.on_done is not None:
                    item.on_done()

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
                elif item.operation == "abort":
                    self._send_abort(edc, item)
                    return
                else:
                    edc.commit_retrieve(item.key, self._instance_id)  # releases the slots; the KV is already in
            except Exception as exc:
                if not self._segments.is_current(transfer):  # reset under it: send it again where it belongs
                    continue
                if item.operation == "store":
                    self._keep_abort(item)  # the COMMIT may not have arrived: its reservation must not stay
                self._connection.fail(item.operation, failure_reason(exc), f"COMMIT: {exc!r}")
                return
            if not ok and item.operation == "store":
                self._keep_abort(item)  # refused or unanswered: whatever stays reserved is aborted
            if not ok:
                self._metrics.error(item.operation, "server_error")
                logger.warning("event=commit_refused operation=%s session=%s", item.operation, item.key.request_id)
            elif item.operation == "store" and self._reports is not None:
                self._reports.report(self._connection.client, item.key)
            logger.debug("event=commit_timing op=%s commit_ms=%.3f", item.operation,
                         (time.perf_counter() - start) * 1e3)  # fmt: skip
            return
        if item.operation in ("store", "abort"):
            self._keep_abort(item)  # reset after reset under it, the server still there: abort it later
        self._dropped(item)

    def _send_abort(self, edc: Any, item: DeferredCommit) -> None:
        """Send one abort; kept for a retry unless answered. A server without the transfer guard fails
        it as a bad payload: that is noted (``abort_unsupported``), the connection stays up."""
        try:
            edc.req_client.commit_store(item.key, self._instance_id, contract.STORE_ABORT_PAYLOAD).result(
                timeout=edc.mq_timeout
            )
        except Exception as exc:
            reason = failure_reason(exc)
            if reason == "server_error":  # not sent again: it would fail the same way
                with self._unaborted_lock:
                    self._stranded += 1
                logger.warning("event=abort_unsupported session=%s detail=%r", item.key.request_id, exc)
                return
            self._connection.slow("store", f"abort: {exc!r}")
            self._keep_abort(item)
            return
        logger.debug("event=store_aborted session=%s", item.key.request_id)

    def _dropped(self, item: DeferredCommit) -> None:
        """Reconnected meanwhile: that server (and its reservation) is gone; a store is lost."""
        if item.operation == "store":
            self._metrics.error("store", "unavailable")
        if item.operation == "abort":
            logger.debug("event=abort_dropped session=%s", item.key.request_id)
            return
        logger.warning("event=commit_dropped operation=%s session=%s", item.operation, item.key.request_id)
