"""A worker's asynchronous loads: copies into the pool issued by the loader thread for parked
requests, which the engine does not wait for; reported once their KV is in the pool.

The loader thread issues a load (``start``) after an event on the engine's stream; the engine
thread polls for the finished ones (``finished``) and, before a forward that may write a block a
load still copies into (a parked request that vanished), orders that forward after the load
(``order_after``) or waits for it (``wait``). The segment a load reads stays mapped from
``expect`` until its copies finished.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from kvoffload.connector.backends.base import BackendError, LoadResult
from kvoffload.connector.backends.blockcopy import CopyMark, TransferStream
from kvoffload.connector.backends.segments import Segments
from kvoffload.connector.wire import TransferOp


@dataclasses.dataclass
class AsyncLoad:
    """One asynchronous load in flight: its op, when it was issued, and the mark after its copies."""

    op: TransferOp
    started: float
    copied: CopyMark
    nbytes: int


class AsyncLoads:
    """The asynchronous loads of one registered pool, issued and not yet reported finished."""

    def __init__(self, load_copies: TransferStream, segments: Segments, *,
                 scatter: Callable[[TransferOp], BackendError | None], give_back: Callable[[TransferOp], None],
                 loaded_bytes: Callable[[TransferOp], int]) -> None:  # fmt: skip
        self._load_copies = load_copies
        self._segments = segments
        self._scatter = scatter
        """Issues a load's copies into the pool (``PoolTransfers``); the error, if any."""
        self._give_back = give_back
        """Gives a copied load's secured chunks back to the server (rank 0)."""
        self._loaded_bytes = loaded_bytes
        self._loads: list[AsyncLoad] = []
        self._lock = threading.Lock()  # the loader thread issues, the engine thread polls

    def expect(self) -> None:
        """An asynchronous load will be issued (or dropped): until then its segment stays mapped."""
        self._segments.copies_started()

    def start(self, op: TransferOp) -> BackendError | None:
        """Issue an expected asynchronous load's copies without waiting for them (the loader thread):
        the engine goes on computing while they run; ``finished`` reports it once its KV is in the pool."""
        started = time.perf_counter()
        with self._load_copies.after_caller():
            error = self._scatter(op)
            copied = self._load_copies.mark()
        if error is None:
            with self._lock:
                self._loads.append(AsyncLoad(op, started, copied, self._loaded_bytes(op)))
        else:
            self._segments.copies_finished()
        return error

    def finished(self) -> list[tuple[TransferOp, LoadResult]]:
        """The asynchronous loads whose copies finished since the last call; their chunks go back to
        the server (one rank: nobody else copies them)."""
        with self._lock:
            done = [load for load in self._loads if load.copied.done()]
            if not done:
                return []
            self._loads = [load for load in self._loads if load not in done]
        self._segments.copies_finished(len(done))
        now = time.perf_counter()
        for load in done:
            self._give_back(load.op)
        return [(load.op, LoadResult(load.nbytes, now - load.started)) for load in done]

    def order_after(self, blocks: frozenset[int]) -> None:
        """Before a forward that may write ``blocks``: it runs after any asynchronous load still
        copying into one of them (a parked request that vanished); device-side, no CPU wait."""
        with self._lock:
            touching = [load for load in self._loads if not blocks.isdisjoint(load.op.pages())]
        for load in touching:
            load.copied.order_current_stream_after()

    def wait(self, blocks: frozenset[int]) -> None:
        """Return once no asynchronous load copies into one of ``blocks`` any more (host-side wait)."""
        with self._lock:
            touching = [load.copied for load in self._loads if not blocks.isdisjoint(load.op.pages())]
        for copied in touching:
            copied.wait()
