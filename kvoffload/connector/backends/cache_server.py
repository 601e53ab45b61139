"""The connector's backend over an LMCache MP server: lookups, secured loads, stores.

Data path (why, see docs/connector.md): LMCache 0.5.6's server-driven transfer
(``lmcache_driven``, what LMCache's own TensorRT-LLM MP adapter uses) fails in
the server for TensorRT-LLM's pool layout. The worker-driven transfer
(``engine_driven``: PREPARE -> copy -> COMMIT) works: the worker copies whole
TensorRT-LLM blocks between its pool and slots of the server's L1, which the
server exposes as a POSIX shared-memory segment (``--shm-name`` with
``--no-l1-use-lazy``). The server is the pod's sidecar (``tcp://127.0.0.1:<port>``) or the
one the in-process backend hosts; the connection itself is :mod:`.lmcache_mp`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.connector import planning
from kvoffload.connector.backends.base import BackendError, KvGeometry, LoadResult
from kvoffload.connector.backends.blockcopy import gather_chunks, scatter_chunks
from kvoffload.connector.backends.commits import PENDING_COMMITS, chain_of
from kvoffload.connector.backends.lmcache_mp import KV_POOL_NAME, AsyncLoad, LMCacheMPClient, failure_reason
from kvoffload.connector.lmcache_seam import IPCCacheServerKey, slot_view
from kvoffload.connector.planning import SecuredLoad, SlotRef, TransferOp

logger = logging.getLogger("kvoffload.connector")

STORE_PIPELINE_GROUPS = 4
"""A store's chunks go in up to this many groups, each PREPAREd while the previous one copies."""

_LOCAL_WORKERS: dict[str, CacheServerBackend] = {}
"""Rank 0's worker backend per server URL: the scheduler in the same process secures loads through
its transfer context (PREPARE_RETRIEVE must come from a registered worker instance)."""


class _Unsecured(Exception):
    """PREPARE_RETRIEVE handed out fewer chunks than the load needs (a miss, not a failure)."""


@dataclasses.dataclass
class _IssuedStore:
    """A store whose PREPAREs went and whose copies are queued: what its COMMITs need."""

    prepared_on: tuple[Any, tuple[str, int] | None]
    """The transfer context and server segment that prepared it (its COMMITs go to that server)."""
    keys: list[IPCCacheServerKey] = dataclasses.field(default_factory=list)
    blocks: int = 0
    prepare_s: float = 0.0


class CacheServerBackend(LMCacheMPClient):
    """The connector's lookups, secured loads and stores over an LMCache MP server."""

    def register(self, kv_pool: Any, geometry: KvGeometry) -> None:
        """Register the pool (on failure the heartbeat keeps trying); rank 0 secures this process's loads."""
        if self._rank == 0:
            _LOCAL_WORKERS[self._settings.server_url] = self
        super().register(kv_pool, geometry)

    def close(self) -> None:
        """Stop the threads, unmap, close the connection; this process secures no more loads here."""
        if _LOCAL_WORKERS.get(self._settings.server_url) is self:
            del _LOCAL_WORKERS[self._settings.server_url]
        super().close()

    # --- scheduler side -----------------------------------------------------------
    def lookup(self, session_id: str, token_ids: tuple[int, ...], end: int, salt: str) -> int:
        """Chunk-aligned hit prefix (tokens) of ``token_ids[:end]``; LMCache read-locks those chunks."""
        if not self._up.is_set():
            raise BackendError("lookup", "unavailable")
        self._key_as_local_worker()
        key = self._key(session_id, token_ids, 0, end, salt, worker=False)
        # Read this process's own stores on this prompt's chain: wait (at most one lookup timeout)
        # for their COMMITs; other requests' COMMITs cannot change this answer.
        PENDING_COMMITS.wait_chain(chain_of(key, self.chunk_size), self._lookup_timeout_s)
        client = self._client
        deadline = time.monotonic() + self._lookup_timeout_s
        try:
            # The server may run LOOKUP and WAIT on different threads: WAIT before LOOKUP has
            # registered the prefetch job answers 0 (a miss for KV that is there), so LOOKUP's
            # answer comes first.
            client.lookup(key, 1).result(timeout=max(0.0, deadline - time.monotonic()) + 0.05)
            # WAIT (not QUERY) so a prefetch still running is not misread as a miss.
            chunks = client.wait_prefetch_status(session_id, self._lookup_timeout_s).result(
                timeout=max(0.0, deadline - time.monotonic()) + 0.05
            )
        except Exception as exc:
            raise self._request_failed("lookup", exc, client) from exc
        return int(chunks or 0) * self.chunk_size

    def _key_as_local_worker(self) -> None:
        """Key lookups with the chunk layout of the pool rank 0's worker in this process registered
        (TensorRT-LLM runs the scheduler in rank 0's process); without one nothing is looked up,
        as nothing could be loaded."""
        local = _LOCAL_WORKERS.get(self._settings.server_url)
        model = local.cache_model if local is not None else None
        if model is None:
            raise BackendError("lookup", "unavailable", "no worker in this process registered its KV pool")
        self._cache_model = model

    def free_lookup_locks(
        self, session_id: str, token_ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...], salt: str
    ) -> None:
        """Release lookup read locks on chunk ranges that will not be retrieved (after the session's
        queued COMMITs, as the server would see synchronous ones)."""
        PENDING_COMMITS.wait_session(session_id, self._lookup_timeout_s)
        if not self._up.is_set():
            return
        for start, end in ranges:
            self._client.free_lookup_locks(self._key(session_id, token_ids, start, end, salt, worker=False), 1)

    def end_session(self, session_id: str) -> None:
        """Tell the server the request ended, after the session's queued COMMITs (the server sees
        a session's COMMIT before its end, as with synchronous COMMITs)."""
        PENDING_COMMITS.wait_session(session_id, self._lookup_timeout_s)
        if self._up.is_set():
            self._client.end_session(session_id)

    def secure(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
    ) -> SecuredLoad | None:
        """Secure a load before it is promised: rank 0's worker in this process has the server hand
        out and read-lock the chunks of ``[start, end)`` for every rank. None: promise nothing."""
        local = _LOCAL_WORKERS.get(self._settings.server_url)
        return local.prepare_secured(session_id, token_ids, start, end, salt) if local is not None else None

    def release_secured(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str, secured: SecuredLoad
    ) -> None:
        """Give back a secured load that will never be copied (its request ended first)."""
        local = _LOCAL_WORKERS.get(self._settings.server_url)
        if local is not None:
            local.commit_secured(session_id, token_ids, start, end, salt, secured.segment)

    # --- secured loads ------------------------------------------------------------------
    def prepare_secured(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
    ) -> SecuredLoad | None:
        """PREPARE_RETRIEVE ``[start, end)`` for every rank under this worker's instance (rank 0).

        The server hands out the chunks' L1 slots and keeps them read-locked until COMMIT_RETRIEVE;
        the slots live in the shared-memory segment every worker maps, so from here on the load is
        a local copy even if the server dies. None, with nothing left held, unless every chunk of
        every rank was handed out within the retrieve timeout: the time a load may take, spent here
        instead of in ``start_load_kv`` (also waiting for a store that holds the transfer context).
        """
        if not self._up.is_set() or self._shm_identity is None or self._instance_id is None:
            return None
        deadline = time.monotonic() + self._retrieve_timeout_s
        if not self._lock.acquire(timeout=self._retrieve_timeout_s):
            return None
        asked: list[IPCCacheServerKey] = []
        try:
            transfer, segment = self._transfer, self._shm_identity
            if transfer is None or segment is None:
                return None
            client = transfer.engine_driven_context.req_client
            chunks = (end - start) // self.chunk_size
            per_rank = []
            # Every rank is asked even after a miss: each PREPARE takes over that rank's lookup locks
            # (released by the server on a miss, by our COMMIT otherwise), so none is left behind.
            for key in self._keys_of_every_rank(session_id, token_ids, start, end, salt):
                asked.append(key)
                response = client.prepare_retrieve(key, self._instance_id).result(
                    timeout=max(0.0, deadline - time.monotonic()) + 0.05
                )
                slots = response.context.get("slots") if response.success else None
                if slots and len(slots) == chunks:
                    per_rank.append(
                        tuple(
                            SlotRef(int(d["offset"]), int(d["length"]), tuple(d["shape"]), str(d["dtype"]))
                            for d in slots
                        )
                    )
            if len(per_rank) != self._settings.world_size:
                raise _Unsecured
            with self._retired_lock:
                self._secured_open[segment] += 1  # its segment stays mapped until commit_secured
            return SecuredLoad(segment, tuple(per_rank))
        except _Unsecured:
            self._metrics.error("retrieve", "miss")
        except Exception as exc:
            self._request_failed("retrieve", exc, transfer.engine_driven_context.req_client)
        finally:
            self._lock.release()
        for key in asked:  # whatever was handed out goes back
            self._commit_later("retrieve", key, (transfer, segment))
        return None

    def commit_secured(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str, segment: tuple[str, int]
    ) -> None:
        """Queue the COMMIT_RETRIEVEs (every rank's key) that release a secured load's chunks; its
        segment, if replaced meanwhile, may be unmapped once no other load secured in it is open."""
        for key in self._keys_of_every_rank(session_id, token_ids, start, end, salt):
            self._commit_later("retrieve", key, (None, segment))
        with self._retired_lock:
            self._secured_open[segment] -= 1
            if self._secured_open[segment] <= 0:
                del self._secured_open[segment]

    def _keys_of_every_rank(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
    ) -> list[IPCCacheServerKey]:
        """Rank by rank, the worker keys of one load: what PREPARE secures and COMMIT releases."""
        return [
            self._key(session_id, token_ids, start, end, salt, worker=True, rank=rank)
            for rank in range(self._settings.world_size)
        ]

    def load_secured(self, ops: Sequence[TransferOp]) -> list[LoadResult]:
        """Copy each op's secured chunks (this rank's) into its blocks: local copies, one wait for all.

        Rank 0 keeps the loads, to release their chunks after the iteration (``release_loaded``):
        by then every rank has copied, since the forward pass's collectives wait for all of them.
        """
        started = time.perf_counter()
        with self._copies.after_caller():
            errors = [self._scatter_secured(op) for op in ops]
        self._copies.synchronize()
        seconds = time.perf_counter() - started
        if self._rank == 0:
            self._loaded.extend(ops)
        return [LoadResult(0 if e else self._loaded_bytes(op), seconds, e) for op, e in zip(ops, errors, strict=True)]

    def _scatter_secured(self, op: TransferOp) -> BackendError | None:
        """Issue the copies of ``op``'s secured chunks (this rank's) into its blocks; the error, if any."""
        assert self._pool is not None
        try:
            views = self._secured_views(op)
            scatter_chunks(
                self._pool,
                op.block_ids,
                views,
                op.skip_tokens // self._settings.tokens_per_block,
                self._blocks_per_chunk,
            )
        except (BackendError, ValueError, RuntimeError) as exc:
            error = exc if isinstance(exc, BackendError) else BackendError("retrieve", "error", repr(exc))
            self._metrics.error("retrieve", error.reason)
            return error
        return None

    def expect_async_load(self) -> None:
        """An asynchronous load will be issued (or dropped): until then its segment stays mapped."""
        with self._async_lock:
            self._async_outstanding += 1

    def start_async_load(self, op: TransferOp) -> BackendError | None:
        """Issue an expected asynchronous load's copies without waiting for them (the loader thread):
        the engine goes on computing while they run; ``finished_async_loads`` reports it once its KV
        is in the pool."""
        started = time.perf_counter()
        with self._copies.after_caller():
            error = self._scatter_secured(op)
            copied = self._copies.mark()
        with self._async_lock:
            if error is None:
                self._async_loads.append(AsyncLoad(op, started, copied, self._loaded_bytes(op)))
            else:
                self._async_outstanding -= 1
        return error

    def finished_async_loads(self) -> list[tuple[TransferOp, LoadResult]]:
        """The asynchronous loads whose copies finished since the last call; their chunks go back to
        the server (one rank: nobody else copies them)."""
        with self._async_lock:
            done = [load for load in self._async_loads if load.copied.done()]
            if not done:
                return []
            self._async_loads = [load for load in self._async_loads if load not in done]
            self._async_outstanding -= len(done)
        now = time.perf_counter()
        for load in done:
            self._commit_load(load.op)
        return [(load.op, LoadResult(load.nbytes, now - load.started)) for load in done]

    def order_after_async_loads(self, blocks: frozenset[int]) -> None:
        """Before a forward that may write ``blocks``: it runs after any asynchronous load still
        copying into one of them (a parked request that vanished); device-side, no CPU wait."""
        with self._async_lock:
            touching = [load for load in self._async_loads if not blocks.isdisjoint(load.op.block_ids)]
        for load in touching:
            load.copied.order_current_stream_after()

    def release_loaded(self) -> None:
        """After an iteration: rank 0 releases the chunks of the loads copied in it, and every rank
        unmaps replaced segments (a synchronous load is secured and copied in the same iteration, so
        none is still needed, unless an asynchronous load still copies: the restarted server's L1 and
        the old one share the pod's /dev/shm)."""
        loaded, self._loaded = self._loaded, []
        for op in loaded:
            self._commit_load(op)
        if self._retired:
            self._close_retired(0.0)

    def _commit_load(self, op: TransferOp) -> None:
        """Give a load's secured chunks back to the server (every rank's keys)."""
        if op.secured is not None:
            self.commit_secured(op.session_id, op.token_ids, op.start, op.end, op.salt, op.secured.segment)

    def _secured_views(self, op: TransferOp) -> list[Any]:
        secured = op.secured
        if secured is None:
            raise BackendError("retrieve", "error", "load was not secured at lookup")
        transfer = self._transfer if secured.segment == self._shm_identity else None
        if transfer is None:
            transfer = next((t for t, ident, _ in self._retired if ident == secured.segment), None)
        if transfer is None:
            raise BackendError("retrieve", "unavailable", f"segment {secured.segment} no longer mapped")
        edc = transfer.engine_driven_context
        return [slot_view(edc, slot.offset, slot.length, slot.shape, slot.dtype) for slot in secured.slots[self._rank]]

    def _fast_copies(self) -> bool:
        """Own block<->chunk copies (``blockcopy``) inside LMCache's PREPARE/COMMIT; else LMCache's gather/scatter."""
        return self._use_fast_copies and self._shm_identity is not None and int(self._pool.shape[2]) == 2

    def _run_transfer(
        self, operation: str, timeout_s: float, op: TransferOp, fast: Any, submit: Callable[[Any, Any], Any]
    ) -> Any:
        """One store or retrieve: our own copies inside PREPARE/COMMIT where they apply (``fast``, its
        answer as it gives it), else LMCache's ``submit`` (gather/scatter, whether it succeeded); a
        failed call marks the backend down."""
        transfer = self._acquire(operation, timeout_s)
        try:
            transfer.engine_driven_context.mq_timeout = timeout_s
            key = self._key(op.session_id, op.token_ids, op.start, op.end, op.salt, worker=True)
            if self._fast_copies():
                return fast(transfer.engine_driven_context, key, op)
            return bool(submit(transfer, key).result(timeout=timeout_s))
        except Exception as exc:
            raise self._fail(
                operation, failure_reason(exc), repr(exc), transfer.engine_driven_context.req_client
            ) from exc
        finally:
            self._lock.release()

    def retrieve(self, op: TransferOp) -> int:
        """Copy ``op``'s chunks from the server into its blocks (skipping ``op.skip_tokens``)."""
        start = time.monotonic()
        ok = self._run_transfer("retrieve", self._retrieve_timeout_s, op, self._retrieve_fast, lambda transfer, key: (
            transfer.submit_retrieve(
                op.session_id, key, {KV_POOL_NAME: self._pool}, [list(op.block_ids)],
                transfer.create_recorded_event(),  # None on CPU; CUDA orders on it
                self._blocks_per_chunk, skip_first_n_tokens=op.skip_tokens,
            )
        ))  # fmt: skip
        if not ok:
            timed_out = time.monotonic() - start >= self._retrieve_timeout_s
            raise self._fail("retrieve", "timeout" if timed_out else "miss", f"session={op.session_id}")
        return self._loaded_bytes(op)

    def _loaded_bytes(self, op: TransferOp) -> int:
        """Bytes a finished load of ``op`` wrote into the pool (its blocks after the skipped ones)."""
        return (len(op.block_ids) - op.skip_tokens // self._settings.tokens_per_block) * self._block_bytes

    def _slots_cover(self, chunks: Any, op: TransferOp) -> bool:
        """Whether PREPARE_RETRIEVE handed out a slot for every chunk of ``op`` (else: a miss)."""
        return chunks is not None and len(chunks) * self._blocks_per_chunk == len(op.block_ids)

    def _issue_load_copies(self, op: TransferOp, chunks: Any) -> None:
        """Queue the slot -> block copies of ``op`` on the transfer stream, after the caller's work."""
        with self._copies.after_caller():
            scatter_chunks(
                self._pool,
                op.block_ids,
                chunks,
                op.skip_tokens // self._settings.tokens_per_block,
                self._blocks_per_chunk,
            )

    def _retrieve_fast(self, edc: Any, key: IPCCacheServerKey, op: TransferOp) -> bool:
        assert self._instance_id is not None
        t0 = time.perf_counter()
        chunks = edc.prepare_retrieve(key, self._instance_id)
        t1 = time.perf_counter()
        ok = self._slots_cover(chunks, op)
        try:
            if ok:
                self._issue_load_copies(op, chunks)
                self._copies.synchronize()  # the KV is in before the forward; the server may reuse the slots
        finally:
            t2 = time.perf_counter()
            self._commit_later("retrieve", key)  # the slots go back to the server after the copy
        logger.debug(
            "event=transfer_timing op=retrieve blocks=%d prepare_ms=%.3f copy_ms=%.3f commit_ms=%.3f",
            len(op.block_ids),
            (t1 - t0) * 1e3,
            (t2 - t1) * 1e3,
            (time.perf_counter() - t2) * 1e3,
        )
        return ok

    def store(self, op: TransferOp) -> int:
        """Copy ``op``'s blocks into the server (chunks it already holds are skipped by LMCache)."""
        issued = self._run_transfer("store", self._store_timeout_s, op, self._store_fast, lambda transfer, key: (
            transfer.submit_store(
                op.session_id, key, {KV_POOL_NAME: self._pool}, [list(op.block_ids)],
                transfer.create_recorded_event(),  # None on CPU; CUDA orders on it
                self._blocks_per_chunk,
            )
        ))  # fmt: skip
        if not issued:
            raise self._fail("store", "server_error", f"session={op.session_id}")
        if isinstance(issued, _IssuedStore):
            self._finish_store(issued, commit=True)
        return len(op.block_ids) * self._block_bytes

    def commits_pending(self, session_id: str) -> bool:
        """Whether the session's queued COMMITs (its stores' publication) are not all answered yet."""
        return PENDING_COMMITS.session_pending(session_id)

    def _store_fast(self, edc: Any, key: IPCCacheServerKey, op: TransferOp) -> _IssuedStore:
        """PREPARE and queue the copies, one group of chunks at a time: each group's PREPARE_STORE is
        sent while the previous group's copies run (``key`` is the whole op's). The copies wait on
        the device for the caller's stream (the forward pass that writes the KV), so the PREPAREs
        overlap it; ``store`` waits for the copies after the transfer context is free again."""
        assert self._instance_id is not None
        bpc, block = self._blocks_per_chunk, self._settings.tokens_per_block
        issued = _IssuedStore((self._transfer, self._shm_identity))
        with self._retired_lock:
            self._stores_copying += 1  # the segment stays mapped until these copies finished
        try:
            for a, b in planning.pipeline_groups(op.start, op.end, self.chunk_size, STORE_PIPELINE_GROUPS):
                group_key = key if (a, b) == (op.start, op.end) else self._key(
                    op.session_id, op.token_ids[:b], a, b, op.salt, worker=True
                )  # fmt: skip
                t0 = time.perf_counter()
                prepared = edc.prepare_store(group_key, self._instance_id)
                issued.prepare_s += time.perf_counter() - t0
                if prepared is None:
                    raise RuntimeError("server answered PREPARE_STORE without SHM slots")
                slots, indices = prepared
                if not indices:
                    continue  # LMCache already holds every chunk of this group
                blocks = op.block_ids[(a - op.start) // block : (b - op.start) // block]
                with self._store_copies.after_caller():
                    gather_chunks(self._pool, blocks, slots, indices, bpc)
                issued.keys.append(group_key)
                issued.blocks += len(indices) * bpc
        except BaseException:
            self._finish_store(issued, commit=False)
            raise
        return issued

    def _finish_store(self, issued: _IssuedStore, commit: bool) -> None:
        """Wait for a store's copies (the slots hold the KV before COMMIT publishes them), then queue
        its COMMITs for the context that prepared them (a refused COMMIT is counted by the committer)."""
        t0 = time.perf_counter()
        try:
            self._store_copies.synchronize()
        finally:
            with self._retired_lock:
                self._stores_copying -= 1
        t1 = time.perf_counter()
        if commit:
            for group_key in issued.keys:
                self._commit_later("store", group_key, issued.prepared_on)
        logger.debug(
            "event=transfer_timing op=store blocks=%d prepare_ms=%.3f copy_ms=%.3f commit_ms=%.3f",
            issued.blocks,
            issued.prepare_s * 1e3,
            (t1 - t0) * 1e3,
            (time.perf_counter() - t1) * 1e3,
        )
