"""A named background queue of transfer ops: one thread runs them in order, off the engine's thread.

The worker holds two (saves, loads). Each owns its lock, its thread and its fields; a fence lets the
engine's thread take the queued ops that touch given blocks and wait out the one running on them.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from kvoffload.connector.wire import TransferOp

logger = logging.getLogger("kvoffload.connector")

Work = tuple[TransferOp, Any]
"""One op and the event on the engine's stream its copies wait for (None: none)."""


class OpPipeline:
    """Ops queued by the engine's thread, run one at a time in order by a thread of their own."""

    def __init__(
        self, name: str, run: Callable[[TransferOp, Any], None], on_thread_start: Callable[[], None] | None = None
    ) -> None:
        """``run(op, event)`` does one op on the pipeline's thread (an exception is logged as
        ``event=<name>_error``); ``on_thread_start`` runs once on that thread before any op."""
        self._name = name
        self._run = run
        self._on_thread_start = on_thread_start
        self._cv = threading.Condition()
        self._queue: deque[Work] = deque()
        self._current: TransferOp | None = None  # the op the thread is running
        self._pending: dict[int, int] = {}  # request id -> its ops queued or running
        self._thread: threading.Thread | None = None

    @property
    def started(self) -> bool:
        """Whether the pipeline's thread runs (``start`` was called)."""
        return self._thread is not None

    def start(self) -> None:
        """Start the pipeline's thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=f"kvoffload-{self._name}", daemon=True)
            self._thread.start()

    def submit(self, work: Iterable[Work]) -> None:
        """Queue ``work``, in order, behind what is queued already."""
        with self._cv:
            for op, event in work:
                self._pending[op.request_id] = self._pending.get(op.request_id, 0) + 1
                self._queue.append((op, event))
            self._cv.notify_all()

    def fence(self, touched: frozenset[int], taken: Callable[[TransferOp, Any], None]) -> None:
        """Take every queued op naming one of ``touched`` blocks out of the queue (``taken(op, event)``
        for each, in order, under the lock), then wait until the running op names none of them."""
        self._take_out(lambda op: not touched.isdisjoint(op.pages()), taken)

    def fence_requests(self, requests: frozenset[int], taken: Callable[[TransferOp, Any], None]) -> None:
        """As ``fence``, for the ops of ``requests`` whatever blocks they name."""
        self._take_out(lambda op: op.request_id in requests, taken)

    def _take_out(self, matches: Callable[[TransferOp], bool], taken: Callable[[TransferOp, Any], None]) -> None:
        with self._cv:
            keep: deque[Work] = deque()
            for op, event in self._queue:
                if not matches(op):
                    keep.append((op, event))
                    continue
                self._done(op.request_id)
                taken(op, event)
            self._queue = keep
            self._cv.wait_for(lambda: self._current is None or not matches(self._current))

    def pending_requests(self) -> frozenset[int]:
        """Requests with an op queued or running."""
        with self._cv:
            return frozenset(self._pending)

    def _done(self, request_id: int) -> None:
        """One op of ``request_id`` ran or was taken out (called with the lock held)."""
        left = self._pending.get(request_id, 1) - 1
        if left <= 0:
            self._pending.pop(request_id, None)
        else:
            self._pending[request_id] = left

    def _loop(self) -> None:
        if self._on_thread_start is not None:
            self._on_thread_start()
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                op, event = self._queue.popleft()
                self._current = op
            try:
                self._run(op, event)
            except Exception:  # the thread must survive anything, or requests would wait forever
                logger.exception("event=%s_error request=%d", self._name, op.request_id)
            finally:
                with self._cv:
                    self._current = None
                    self._done(op.request_id)
                    self._cv.notify_all()
