"""A worker's transfers between its registered KV pool and the server's L1: secured loads (sync,
layer-wise, and asynchronous through :mod:`.async_loads`), stores, and LMCache's own retrieve where
our copies do not apply.

Our copies (``blockcopy``) run inside LMCache's PREPARE/COMMIT on two streams: loads on one, stores
on another (a store may wait for a forward pass). A store's chunks go in groups, each PREPAREd while
the previous group copies; COMMITs go to the committer once the copies are done.

A store that fails anywhere between its first PREPARE_STORE and its COMMITs (a copy that raises, a
PREPARE that times out, the wait for its copies failing) publishes nothing: once its copies are
waited for, every group it PREPAREd is aborted (``Committer.abort``), the group whose PREPARE failed
too (the server may make that reservation after the PREPARE timed out here).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.connector import planning
from kvoffload.connector.backends.async_loads import AsyncLoads
from kvoffload.connector.backends.base import BackendError, LoadResult
from kvoffload.connector.backends.blockcopy import (
    CopyMark,
    GroupedPages,
    TransferStream,
    gather_chunks,
    scatter_chunks,
)
from kvoffload.connector.backends.chunk_keys import ChunkKeys
from kvoffload.connector.backends.commits import chain_of
from kvoffload.connector.backends.committer import Committer
from kvoffload.connector.backends.connection import ServerConnection, failure_reason
from kvoffload.connector.backends.layer_copies import (
    CopyTimer,
    LayerwiseLoad,
    PoolRows,
    RowRuns,
    layer_spans,
    rows_copy_available,
)
from kvoffload.connector.backends.securing import Securing
from kvoffload.connector.backends.segments import Segment, Segments
from kvoffload.connector.lmcache_seam import IPCCacheServerKey, slot_view
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.wire import TransferOp

logger = logging.getLogger("kvoffload.connector")

KV_POOL_NAME = "trtllm_kv_pool"
STORE_PIPELINE_GROUPS = 4
"""A store's chunks go in up to this many groups, each PREPAREd while the previous one copies."""


@dataclasses.dataclass
class IssuedStore:
    """A store whose PREPAREs went and whose copies are queued: what its COMMITs need."""

    prepared_on: tuple[Any, Segment | None]
    """The transfer context and server segment that prepared it (its COMMITs go to that server)."""
    keys: list[IPCCacheServerKey] = dataclasses.field(default_factory=list)
    """The groups whose chunks were copied (their COMMITs publish them)."""
    prepared: list[IPCCacheServerKey] = dataclasses.field(default_factory=list)
    """Every group a PREPARE_STORE was sent for (what an abandoned store aborts)."""
    blocks: int = 0
    prepare_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Timeouts:
    """Per-call deadlines (seconds)."""

    retrieve_s: float
    store_s: float


class PoolTransfers:
    """Loads into and stores from one registered KV pool, for one rank."""

    def __init__(self, kv_pool: Any, *, rank: int, instance_id: int, tokens_per_block: int, chunk_size: int,
                 timeouts: Timeouts, use_fast_copies: bool, connection: ServerConnection, segments: Segments,
                 keys: ChunkKeys, committer: Committer, securing: Securing | None,
                 metrics: ConnectorMetrics, pages: GroupedPages | None = None,
                 catch_up: Callable[[], None] | None = None) -> None:  # fmt: skip
        self.pool = kv_pool
        """The pool LMCache is registered with (several layer groups: a one-block stand-in of the chunk's size)."""
        self.pages = pages
        """Several layer groups (``layout.GroupedLayout``): their pages, which every copy reads and writes."""
        self.block_bytes = pages.block_bytes if pages else int(kv_pool[0].numel() * kv_pool.element_size())
        self.load_copies = TransferStream(kv_pool.device)
        self.store_copies = TransferStream(kv_pool.device)
        self._rank = rank
        self._instance_id = instance_id
        self._tokens_per_block = tokens_per_block
        self._chunk_size = chunk_size
        self._blocks_per_chunk = chunk_size // tokens_per_block
        self._timeouts = timeouts
        self._use_fast_copies = use_fast_copies
        self._connection = connection
        self._segments = segments
        self._keys = keys
        self._committer = committer
        self._securing = securing
        """Rank 0's: gives loaded chunks back to the server (None on other ranks: nothing to give back)."""
        self._metrics = metrics
        self._catch_up = catch_up
        """Registers the pool with the server now if it must (a restart replaced its segment): a load
        rank 0 secured in the new segment may reach this rank before its own heartbeat did that."""
        self._loaded: list[tuple[TransferOp, CopyMark | None]] = []
        """Rank 0's loads copied (or, layer-wise, copying: until the mark) whose chunks go back next."""
        self.async_loads = AsyncLoads(self.load_copies, segments, scatter=self._scatter_secured,
                                      give_back=self._give_back, loaded_bytes=self.loaded_bytes)  # fmt: skip
        """Asynchronous loads whose copies were issued and not yet reported finished."""

    # --- secured loads -------------------------------------------------------------------
    def load_secured(self, ops: Sequence[TransferOp]) -> list[LoadResult]:
        """Copy each op's secured chunks (this rank's) into its blocks: local copies, one wait for all.

        Rank 0 keeps the loads, to release their chunks after the iteration (``release_loaded``):
        by then every rank has copied, since the forward pass's collectives wait for all of them.
        """
        started = time.perf_counter()
        with self.load_copies.after_caller():
            errors = [self._scatter_secured(op) for op in ops]
        self.load_copies.synchronize()
        seconds = time.perf_counter() - started
        if self._rank == 0:
            self._loaded.extend((op, None) for op in ops)
        return [LoadResult(0 if e else self.loaded_bytes(op), seconds, e) for op, e in zip(ops, errors, strict=True)]

    def layerwise_loads_possible(self) -> bool:
        """Whether ``load_secured_by_layer`` can copy into this pool: one pool of whole blocks, each
        its layers one after the other (not several layer groups' pages)."""
        return (
            self.pages is None
            and self.pool.dim() >= 3
            and self.pool.is_contiguous()
            and rows_copy_available(self.pool.device)
        )

    def load_secured_by_layer(self, ops: Sequence[TransferOp]) -> LayerwiseLoad:
        """Issue each op's secured chunk copies span of layers by span (``layer_copies``), without
        waiting: the forward pass orders each layer after its span's mark. Rank 0 gives the chunks
        back once the last span landed (``release_loaded``)."""
        rows = PoolRows.of(self.pool)
        bpc, tpb = self._blocks_per_chunk, self._tokens_per_block
        errors: list[BackendError | None] = []
        views: list[list[Any]] = []
        for op in ops:
            try:
                views.append(self._secured_views(op))
                errors.append(None)
            except (BackendError, ValueError, RuntimeError) as exc:
                errors.append(self._retrieve_error(exc))
                views.append([])
        marks = []
        with self.load_copies.after_caller():
            timer = CopyTimer(self.pool.device)
            planned: list[RowRuns | None] = []
            for i, op in enumerate(ops):
                try:
                    planned.append(None if errors[i] else rows.runs(op.block_ids, views[i], op.skip_tokens // tpb, bpc))
                except ValueError as exc:
                    errors[i] = self._retrieve_error(exc)
                    planned.append(None)
            runs = sum(len(p.runs) for p in planned if p is not None)
            load_bytes = sum(self.loaded_bytes(op) for op, p in zip(ops, planned, strict=True) if p is not None)
            spans = layer_spans(rows.num_layers, runs, load_bytes=load_bytes)
            for span in spans:
                for i, op_runs in enumerate(planned):
                    if errors[i] is not None or op_runs is None:
                        continue
                    try:
                        op_runs.copy_span(span)
                    except RuntimeError as exc:
                        errors[i] = self._retrieve_error(exc)
                marks.append(self.load_copies.mark())
            timer.stop()
        if self._rank == 0:
            self._loaded.extend((op, marks[-1]) for op in ops)
        results = [LoadResult(0 if e else self.loaded_bytes(op), 0.0, e) for op, e in zip(ops, errors, strict=True)]
        return LayerwiseLoad(results, spans, marks, timer)

    def _retrieve_error(self, exc: Exception) -> BackendError:
        error = exc if isinstance(exc, BackendError) else BackendError("retrieve", "error", repr(exc))
        self._metrics.error("retrieve", error.reason)
        return error

    def _scatter_secured(self, op: TransferOp) -> BackendError | None:
        """Issue the copies of ``op``'s secured chunks (this rank's) into its blocks; the error, if any."""
        try:
            self._scatter(op, self._secured_views(op))
        except (BackendError, ValueError, RuntimeError) as exc:
            return self._retrieve_error(exc)
        return None

    def _scatter(self, op: TransferOp, chunks: Any) -> None:
        if self.pages is not None:
            skip = op.skip_tokens // self._tokens_per_block
            self.pages.scatter(op.block_ids, op.group_block_ids, chunks, skip, self._blocks_per_chunk)
            return
        scatter_chunks(self.pool, op.block_ids, chunks, op.skip_tokens // self._tokens_per_block,
                       self._blocks_per_chunk)  # fmt: skip

    def _secured_views(self, op: TransferOp) -> list[Any]:
        secured = op.secured
        if secured is None:
            raise BackendError("retrieve", "error", "load was not secured at lookup")
        transfer = self._segments.mapping(secured.segment)
        if transfer is None and self._catch_up is not None:
            self._catch_up()
            transfer = self._segments.mapping(secured.segment)
        if transfer is None:
            raise BackendError("retrieve", "unavailable", f"segment {secured.segment} no longer mapped")
        edc = transfer.engine_driven_context
        slots = secured.slots[self._keys.rank]  # a replicated pool's one copy (rank 0's) serves every rank
        return [slot_view(edc, slot.offset, slot.length, slot.shape, slot.dtype) for slot in slots]

    def release_loaded(self) -> None:
        """After an iteration: rank 0 releases the chunks of the loads copied in it (a layer-wise
        load's once its last span landed: at a later call if it still copies), and every rank
        unmaps replaced segments (a synchronous load is secured and copied in the same iteration, so
        none is still needed, unless an asynchronous load still copies: the restarted server's L1 and
        the old one share the pod's /dev/shm; a secured load's segment stays mapped until it went back)."""
        copying: list[tuple[TransferOp, CopyMark | None]] = []
        for op, mark in self._loaded:
            if mark is None or mark.done():
                self._give_back(op)
            else:
                copying.append((op, mark))
        self._loaded = copying
        if self._segments.any_retired:
            self._segments.close_retired(0.0)

    def _give_back(self, op: TransferOp) -> None:
        """Give a load's secured chunks back to the server (every rank's keys); a prefix reservation's
        go back when it closes (the scheduler's ``release_prefix_reservation``: every rank copied)."""
        if op.secured is not None and self._securing is not None and op.reservation_id is None:
            self._securing.commit(op.session_id, op.token_ids, op.start, op.end, op.salt, op.secured.segment)

    def loaded_bytes(self, op: TransferOp) -> int:
        """Bytes a finished load of ``op`` wrote into the pool (its blocks after the skipped ones)."""
        return (len(op.block_ids) - op.skip_tokens // self._tokens_per_block) * self.block_bytes

    def _abort(self, issued: IssuedStore) -> None:
        """Abort every reservation of an abandoned store (counted once per store)."""
        if not issued.prepared:
            return
        self._metrics.stores_aborted.inc()
        for group_key in issued.prepared:
            self._committer.abort(group_key, issued.prepared_on)
        logger.warning("event=store_aborted session=%s groups=%d", issued.prepared[0].request_id, len(issued.prepared))

    # --- stores and LMCache's retrieve ------------------------------------------------------
    def _fast_copies(self) -> bool:
        """Own block<->chunk copies (``blockcopy``) inside LMCache's PREPARE/COMMIT; else LMCache's gather/scatter."""
        return self._use_fast_copies and self._segments.segment is not None and int(self.pool.shape[2]) == 2

    def _acquire(self, operation: str, timeout_s: float) -> Any:
        if not self._connection.is_up():
            raise BackendError(operation, "unavailable")
        if not self._segments.lock.acquire(timeout=timeout_s):
            raise self._connection.slow(operation, "transfer context busy")  # another transfer holds it
        transfer = self._segments.transfer
        if transfer is None:
            self._segments.lock.release()
            raise BackendError(operation, "unavailable", "KV pool not registered")
        return transfer

    def _run_transfer(self, operation: str, timeout_s: float, op: TransferOp, fast: Any,
                      submit: Callable[[Any, Any], Any]) -> Any:  # fmt: skip
        """One store or retrieve: our own copies inside PREPARE/COMMIT where they apply (``fast``, its
        answer as it gives it), else LMCache's ``submit`` (gather/scatter, whether it succeeded); a
        failed call marks the connection down."""
        transfer = self._acquire(operation, timeout_s)
        try:
            transfer.engine_driven_context.mq_timeout = timeout_s
            key = self._keys.key(op.session_id, op.token_ids, op.start, op.end, op.salt, worker=True)
            if self._fast_copies():
                return fast(transfer.engine_driven_context, key, op)
            if self.pages is not None:  # LMCache's gather/scatter knows one pool of one layer group
                raise BackendError(operation, "unavailable", "layer groups move only through the shared-memory L1")
            return bool(submit(transfer, key).result(timeout=timeout_s))
        except BackendError:
            raise
        except Exception as exc:
            raise self._connection.fail(
                operation, failure_reason(exc), repr(exc), transfer.engine_driven_context.req_client
            ) from exc
        finally:
            self._segments.lock.release()

    def retrieve(self, op: TransferOp) -> int:
        """Copy ``op``'s chunks from the server into its blocks (skipping ``op.skip_tokens``)."""
        start = time.monotonic()
        ok = self._run_transfer("retrieve", self._timeouts.retrieve_s, op, self._retrieve_fast, lambda transfer, key: (
            transfer.submit_retrieve(
                op.session_id, key, {KV_POOL_NAME: self.pool}, [list(op.block_ids)],
                transfer.create_recorded_event(),  # None on CPU; CUDA orders on it
                self._blocks_per_chunk, skip_first_n_tokens=op.skip_tokens,
            )
        ))  # fmt: skip
        if not ok:
            timed_out = time.monotonic() - start >= self._timeouts.retrieve_s
            raise self._connection.fail("retrieve", "timeout" if timed_out else "miss", f"session={op.session_id}")
        return self.loaded_bytes(op)

    def _retrieve_fast(self, edc: Any, key: IPCCacheServerKey, op: TransferOp) -> bool:
        t0 = time.perf_counter()
        chunks = edc.prepare_retrieve(key, self._instance_id)
        t1 = time.perf_counter()
        ok = chunks is not None and len(chunks) * self._blocks_per_chunk == len(op.block_ids)
        try:
            if ok:
                with self.load_copies.after_caller():
                    self._scatter(op, chunks)
                self.load_copies.synchronize()  # the KV is in before the forward; the server may reuse the slots
        finally:
            t2 = time.perf_counter()
            # the slots go back to the server after the copy
            self._committer.later("retrieve", key, None, (self._segments.transfer, self._segments.segment))
        logger.debug(
            "event=transfer_timing op=retrieve blocks=%d prepare_ms=%.3f copy_ms=%.3f commit_ms=%.3f",
            len(op.block_ids),
            (t1 - t0) * 1e3,
            (t2 - t1) * 1e3,
            (time.perf_counter() - t2) * 1e3,
        )
        return ok

    def store(self, op: TransferOp) -> int:
        """Copy ``op``'s blocks into the server (chunks it already holds are skipped by LMCache); 0
        bytes on a rank whose chunks another rank stores (a replicated pool's, rank 0 writes them)."""
        if not self._keys.stores:
            return 0
        issued = self._run_transfer("store", self._timeouts.store_s, op, self._store_fast, lambda transfer, key: (
            transfer.submit_store(
                op.session_id, key, {KV_POOL_NAME: self.pool}, [list(op.block_ids)],
                transfer.create_recorded_event(),  # None on CPU; CUDA orders on it
                self._blocks_per_chunk,
            )
        ))  # fmt: skip
        if not issued:
            raise self._connection.fail("store", "server_error", f"session={op.session_id}")
        if isinstance(issued, IssuedStore):
            self.finish_store(issued, commit=True)
        return len(op.block_ids) * self.block_bytes

    def _store_fast(self, edc: Any, key: IPCCacheServerKey, op: TransferOp) -> IssuedStore:
        """PREPARE and queue the copies, one group of chunks at a time: each group's PREPARE_STORE is
        sent while the previous group's copies run (``key`` is the whole op's). The copies wait on
        the device for the caller's stream (the forward pass that writes the KV), so the PREPAREs
        overlap it; ``store`` waits for the copies after the transfer context is free again."""
        bpc, block = self._blocks_per_chunk, self._tokens_per_block
        issued = IssuedStore((self._segments.transfer, self._segments.segment))
        self._segments.copies_started()  # the segment stays mapped until these copies finished
        try:
            for a, b in planning.pipeline_groups(op.start, op.end, self._chunk_size, STORE_PIPELINE_GROUPS):
                group_key = key if (a, b) == (op.start, op.end) else self._keys.key(
                    op.session_id, op.token_ids[:b], a, b, op.salt, worker=True
                )  # fmt: skip
                t0 = time.perf_counter()
                issued.prepared.append(group_key)  # before the PREPARE: the server may reserve even if it times out
                prepared = edc.prepare_store(group_key, self._instance_id)
                issued.prepare_s += time.perf_counter() - t0
                if prepared is None:
                    raise RuntimeError("server answered PREPARE_STORE without SHM slots")
                slots, indices = prepared
                if not indices:
                    continue  # LMCache already holds every chunk of this group
                lo, hi = (a - op.start) // block, (b - op.start) // block
                with self.store_copies.after_caller():
                    if self.pages is not None:
                        groups = [ids[lo:hi] for ids in op.group_block_ids]
                        self.pages.gather(op.block_ids[lo:hi], groups, slots, indices, bpc)
                    else:
                        gather_chunks(self.pool, op.block_ids[lo:hi], slots, indices, bpc)
                issued.keys.append(group_key)
                issued.blocks += len(indices) * bpc
        except BaseException:
            self.finish_store(issued, commit=False)
            raise
        return issued

    def finish_store(self, issued: IssuedStore, commit: bool) -> None:
        """The last step of a store (``store`` calls it once the transfer context is free): wait for a
        store's copies (the slots hold the KV before COMMIT publishes them), then queue its COMMITs for
        the context that prepared them (a refused COMMIT is counted by the committer). Without
        ``commit``, or when the wait fails, every group it PREPAREd is aborted instead, after its copies
        stopped writing (the server frees the slots)."""
        t0 = time.perf_counter()
        try:
            self.store_copies.synchronize()
        except BaseException:
            commit = False
            raise
        finally:
            self._segments.copies_finished()
            if not commit:
                self._abort(issued)
        t1 = time.perf_counter()
        if commit:
            for group_key in issued.keys:
                self._committer.later("store", group_key, chain_of(group_key, self._chunk_size), issued.prepared_on)
        logger.debug(
            "event=transfer_timing op=store blocks=%d prepare_ms=%.3f copy_ms=%.3f commit_ms=%.3f",
            issued.blocks,
            issued.prepare_s * 1e3,
            (t1 - t0) * 1e3,
            (time.perf_counter() - t1) * 1e3,
        )
