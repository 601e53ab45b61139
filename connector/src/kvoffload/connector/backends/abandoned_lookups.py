"""Lookups answered too late, and the release of what the server's prefetch of each still holds.

A lookup is LOOKUP (the server starts a prefetch job under the session and read-locks every chunk it
finds) then WAIT (its answer, which hands the result and the locks over to the session). When WAIT
answers nothing within the lookup timeout the connector counts a miss, but LMCache 0.5.6 keeps the
job, its unconsumed result and its read locks (until the read TTL, 300 s): locked chunks cannot be
evicted. So an abandoned lookup is settled: WAIT again (the job's result goes to the session), then
FREE_LOOKUP_LOCKS over the lookup's range. Before the session's next lookup it is settled within that
lookup's deadline (no new LOOKUP is sent while it runs: it would replace the job and strand its
locks); at the session's end, on this module's thread, before END_SESSION.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from kvoffload.connector.backends.connection import ServerConnection
from kvoffload.connector.lmcache_seam import IPCCacheServerKey
from kvoffload.connector.metrics import ConnectorMetrics

logger = logging.getLogger("kvoffload.connector")

SETTLE_AT_END_S = 60.0
"""How long the session's end waits, off the engine's path, for an abandoned prefetch to finish
before it ends the session anyway (the server's read TTL then frees what it holds)."""
_WAIT_STEP_S = 1.0


class AbandonedLookups:
    """One scheduler's abandoned lookups by session, settled before the session looks up again and at its end."""

    def __init__(self, connection: ServerConnection, metrics: ConnectorMetrics) -> None:
        self._connection = connection
        self._metrics = metrics
        self._lock = threading.Lock()
        self._by_session: dict[str, IPCCacheServerKey] = {}
        self._ends: queue.Queue[tuple[str, Callable[[], None]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_session)

    def abandoned(self, session_id: str, key: IPCCacheServerKey) -> None:
        """The lookup of ``key`` got no answer in time: its prefetch job may still hold locks."""
        with self._lock:
            self._by_session[session_id] = key
        self._metrics.lookups_abandoned.inc()
        logger.debug("event=lookup_abandoned session=%s end=%d", session_id, key.end)

    def settle(self, client: Any, session_id: str, timeout_s: float) -> bool:
        """Settle the session's abandoned lookup, if any, within ``timeout_s``: True once none is left
        (a new LOOKUP may go), False while its prefetch still runs."""
        with self._lock:
            key = self._by_session.get(session_id)
        if key is None:
            return True
        # WAIT hands a finished prefetch's result and locks to the session (0: already handed over).
        answer = client.wait_prefetch_status(session_id, max(0.0, timeout_s)).result(timeout=max(0.0, timeout_s) + 0.05)
        if answer is None:
            return False
        client.free_lookup_locks(key, 1).result(timeout=max(0.05, timeout_s))
        with self._lock:
            self._by_session.pop(session_id, None)
        logger.debug("event=lookup_settled session=%s hit_chunks=%d", session_id, int(answer))
        return True

    def end(self, session_id: str, end_session: Callable[[], None]) -> bool:
        """At the session's end: False when nothing of it was abandoned (the caller ends it now);
        else True, and this module's thread settles it, then calls ``end_session``."""
        with self._lock:
            if session_id not in self._by_session:
                return False
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="kvoffload-lookup-settle", daemon=True)
                self._thread.start()
        self._ends.put((session_id, end_session))
        return True

    def close(self, timeout_s: float) -> None:
        """Settle what is queued (waiting at most ``timeout_s``), then stop."""
        self._ends.put(None)
        if self._thread is not None:
            self._thread.join(timeout=timeout_s)

    def _loop(self) -> None:
        while (item := self._ends.get()) is not None:
            session_id, end_session = item
            try:
                self._settle_at_end(session_id)
                end_session()
            except Exception:  # the thread must outlive any one session
                logger.exception("event=lookup_settle_failed session=%s", session_id)

    def _settle_at_end(self, session_id: str) -> None:
        deadline = time.monotonic() + SETTLE_AT_END_S
        while time.monotonic() < deadline and self._connection.is_up():
            try:
                if self.settle(self._connection.client, session_id, _WAIT_STEP_S):
                    return
            except Exception as exc:
                logger.debug("event=lookup_settle_retry session=%s detail=%r", session_id, exc)
                time.sleep(_WAIT_STEP_S)
        with self._lock:
            self._by_session.pop(session_id, None)
        logger.info("event=lookup_left_to_ttl session=%s", session_id)
