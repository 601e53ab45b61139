"""What the worker hooks copy through: the registered pool's loads and stores
(:class:`.pool_transfers.PoolTransfers`), parked requests' loads and the COMMITs pending in this
engine process. Before a pool is registered loads and stores fail (``BackendError``, unavailable)
and the rest answers nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvoffload.connector.backends.base import BackendError, LoadResult
from kvoffload.connector.backends.commits import PendingCommits
from kvoffload.connector.backends.engine_process import ParkedLoads, SavingRequests
from kvoffload.connector.backends.store_reports import StoreReporter
from kvoffload.connector.wire import TransferOp

if TYPE_CHECKING:
    from kvoffload.connector.backends.layer_copies import LayerwiseLoad
    from kvoffload.connector.backends.pool_transfers import PoolTransfers


class PoolCopies:
    """One worker's loads and stores between TensorRT-LLM's pool and the server's segment."""

    def __init__(self, transfers: Callable[[], PoolTransfers | None], *, parked: ParkedLoads,
                 saving: SavingRequests, pending: PendingCommits, reports: StoreReporter | None) -> None:  # fmt: skip
        self._transfers = transfers
        self._parked = parked
        self._saving = saving
        self._pending = pending
        self._reports = reports

    def _pool(self, operation: str) -> PoolTransfers:
        transfers = self._transfers()
        if transfers is None:
            raise BackendError(operation, "unavailable", "KV pool not registered")
        return transfers

    def load_secured(self, ops: Sequence[TransferOp]) -> list[LoadResult]:
        """Copy each op's secured chunks into its blocks; one result per op."""
        return self._pool("retrieve").load_secured(ops)

    def load_secured_by_layer(self, ops: Sequence[TransferOp]) -> LayerwiseLoad | None:
        """Issue ``load_secured``'s copies span of layers by span without waiting; None where this pool cannot."""
        transfers = self._pool("retrieve")
        return transfers.load_secured_by_layer(ops) if transfers.layerwise_loads_possible() else None

    def expect_async_load(self) -> None:
        """An asynchronous load will be issued (its segment stays mapped till then)."""
        self._pool("retrieve").async_loads.expect()

    def start_async_load(self, op: TransferOp) -> BackendError | None:
        """Issue an expected asynchronous load's copies without waiting; the error, if any."""
        return self._pool("retrieve").async_loads.start(op)

    def finished_async_loads(self) -> list[tuple[TransferOp, LoadResult]]:
        """Asynchronous loads whose KV is in the pool since the last call (their chunks released)."""
        transfers = self._transfers()
        return transfers.async_loads.finished() if transfers is not None else []

    def order_after_async_loads(self, blocks: frozenset[int]) -> None:
        """Order the next forward after asynchronous loads still copying into ``blocks``."""
        transfers = self._transfers()
        if transfers is not None:
            transfers.async_loads.order_after(blocks)

    def wait_async_loads(self, blocks: frozenset[int]) -> None:
        """Return once no asynchronous load copies into ``blocks`` any more (host-side)."""
        transfers = self._transfers()
        if transfers is not None:
            transfers.async_loads.wait(blocks)

    def abandoned_load_blocks(self) -> frozenset[int]:
        """Blocks written by loads of parked requests TensorRT-LLM finished (cancelled) meanwhile."""
        return self._parked.abandoned_blocks()

    def ended_saving_requests(self) -> frozenset[int]:
        """Requests with saves planned that TensorRT-LLM finished without ``request_finished`` (cancelled)."""
        return self._saving.ended()

    def release_loaded(self) -> None:
        """After an iteration: release the chunks of the loads copied in it (rank 0)."""
        transfers = self._transfers()
        if transfers is not None:
            transfers.release_loaded()

    def retrieve(self, op: TransferOp) -> int:
        """Load ``op``'s chunks into its blocks; bytes moved."""
        return self._pool("retrieve").retrieve(op)

    def store(self, op: TransferOp) -> int:
        """Store ``op``'s blocks; bytes moved."""
        if self._reports is not None and op.lora is not None:
            self._reports.scope(op.salt, op.lora)
        return self._pool("store").store(op)

    def commits_pending(self, session_id: str) -> bool:
        """Whether the session's queued COMMITs (its stores' publication) are not all answered yet; never waits."""
        return self._pending.session_pending(session_id)
