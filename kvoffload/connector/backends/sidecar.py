"""Sidecar backend: LMCache's multi-process server in the same pod, over ZMQ ``tcp://127.0.0.1:<port>``.

Data path (why, see docs/connector.md): LMCache 0.5.6's server-driven transfer
(``lmcache_driven``, what LMCache's own TensorRT-LLM MP adapter uses) fails in
the server for TensorRT-LLM's pool layout. The worker-driven transfer
(``engine_driven``: PREPARE -> copy -> COMMIT) works: the worker copies whole
TensorRT-LLM blocks between its pool and slots of the server's L1, which the
server exposes as a POSIX shared-memory segment (``--shm-name`` with
``--no-l1-use-lazy``). Everything here is LMCache's public client API:
``RequestClientFactory``, ``create_transfer_context``, ``IPCCacheServerKey``.

COMMIT off the engine's path: after the copy (synchronised, so the KV is where it must be) the
COMMIT that publishes a store or releases a retrieve's slots is sent by a committer thread
while the engine goes on. Lookups in this process first wait for pending COMMITs (bounded by
the lookup timeout), so a request never misses KV that a finished request of this process
stored. A COMMIT that fails marks the backend down like any other failed call.

Failure handling: every call has its own timeout (settings, ms). A failed call
marks the backend down; while down, calls fail at once (lookups answer 0, stores
are skipped) and nothing waits. A heartbeat thread PINGs the server (which also
keeps the server's reaper from dropping this worker), notices restarts (failed
ping, or the server's SHM segment replaced) and registers the KV pool again.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq
from lmcache.utils import EngineType
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.transfer_context import MPTransferMode, create_transfer_context
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

from kvoffload.connector.backends.base import BackendError, KvGeometry, LoadResult, instance_id
from kvoffload.connector.backends.blockcopy import TransferStream, gather_chunks, scatter_chunks
from kvoffload.connector.keys import cache_model_name
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.planning import SecuredLoad, SlotRef, TransferOp
from kvoffload.connector.settings import ConnectorSettings

logger = logging.getLogger("kvoffload.connector")

_KV_NAME = "trtllm_kv_pool"
_STARTUP_WAIT_S = 30.0
_SHM_DIR = "/dev/shm"
_MIN_PING_TIMEOUT_S = 2.0
_RETIRED_GRACE_S = 10.0
"""A replaced transfer context (server restarted) stays mapped until the end of the engine's
iteration (``release_loaded``), or this long when the engine is idle: loads secured in its segment
just before the restart still copy from it."""

_LOCAL_WORKERS: dict[str, SidecarBackend] = {}
"""Rank 0's worker backend per server URL: the scheduler in the same process secures loads through
its transfer context (PREPARE_RETRIEVE must come from a registered worker instance)."""


class _Unsecured(Exception):
    """PREPARE_RETRIEVE handed out fewer chunks than the load needs (a miss, not a failure)."""


def _reason(exc: BaseException) -> str:
    return "timeout" if isinstance(exc, TimeoutError) else "server_error"


class PendingCommits:
    """COMMITs queued in this process and not yet answered; lookups wait for none to be left."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = threading.Condition()

    def add(self) -> None:
        with self._idle:
            self._count += 1

    def done(self) -> None:
        with self._idle:
            self._count -= 1
            if self._count == 0:
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """True when none is pending (at once, or within ``timeout_s``)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._count == 0, timeout=timeout_s)


PENDING_COMMITS = PendingCommits()


@dataclass(frozen=True)
class _Commit:
    operation: str
    transfer: Any
    key: IPCCacheServerKey


class SidecarBackend:
    """LMCache MP server client for one process and role (``scheduler`` looks up, ``worker`` moves KV)."""

    def __init__(
        self,
        settings: ConnectorSettings,
        *,
        rank: int,
        role: str,
        metrics: ConnectorMetrics,
        use_fast_copies: bool = True,
    ) -> None:
        self._settings = settings
        self._use_fast_copies = use_fast_copies
        self._rank = rank
        self._role = role
        self._metrics = metrics
        self._instance_id: int | None = instance_id() if role == "worker" else None
        self._lookup_timeout_s = settings.lookup_timeout_ms / 1000.0
        self._retrieve_timeout_s = settings.retrieve_timeout_ms / 1000.0
        self._store_timeout_s = settings.store_timeout_ms / 1000.0
        self._heartbeat_s = settings.heartbeat_interval_ms / 1000.0
        # PINGs run on the heartbeat thread, never on the engine's path: a busy-but-alive server
        # gets a generous answer window before it is declared down.
        self._ping_timeout_s = max(_MIN_PING_TIMEOUT_S, self._heartbeat_s)
        self._zmq = zmq.Context()
        # Drop queued requests when a socket closes: a restarted server must never
        # receive PREPARE/LOOKUP messages that were meant for its predecessor.
        self._zmq.setsockopt(zmq.LINGER, 0)
        self._lock = threading.RLock()
        self._client: Any = RequestClientFactory.create(settings.server_url, context=self._zmq)
        self._up = threading.Event()
        self._needs_reset = False
        self._needs_register = False
        self._pool: Any = None
        self._copies: TransferStream  # set with the pool (register)
        self._geometry: KvGeometry | None = None
        self._block_bytes = 0
        self._transfer: Any = None
        self._shm_identity: tuple[str, int] | None = None
        self._retired: list[tuple[Any, tuple[str, int] | None, float]] = []
        self._retired_lock = threading.Lock()  # heartbeat thread and engine thread both close them
        self._loaded: list[TransferOp] = []
        self.chunk_size = self._initial_chunk_size()
        self._blocks_per_chunk = self.chunk_size // settings.tokens_per_block
        self._stop = threading.Event()
        self._commits: queue.Queue[_Commit | None] = queue.Queue()
        self._committer = threading.Thread(target=self._commit_loop, name=f"kvoffload-commit-{role}", daemon=True)
        self._committer.start()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name=f"kvoffload-heartbeat-{role}", daemon=True)
        self._heartbeat.start()

    # --- state ------------------------------------------------------------------
    def is_up(self) -> bool:
        """Whether the last contact with the server succeeded."""
        return self._up.is_set()

    def _mark_up(self) -> None:
        if not self._up.is_set():
            logger.info("event=backend_up backend=sidecar role=%s url=%s", self._role, self._settings.server_url)
        self._up.set()
        self._metrics.backend_up.set(1)

    def _fail(self, operation: str, reason: str, detail: str = "") -> BackendError:
        """Record a failure, mark the backend down and return the error to raise."""
        self._metrics.error(operation, reason)
        if self._up.is_set():
            logger.warning(
                "event=backend_down backend=sidecar role=%s operation=%s reason=%s detail=%s",
                self._role,
                operation,
                reason,
                detail,
            )
        self._up.clear()
        self._metrics.backend_up.set(0)
        self._needs_reset = True
        return BackendError(operation, reason, detail)

    def _initial_chunk_size(self) -> int:
        wait_s = 2.0 if self._settings.chunk_size else _STARTUP_WAIT_S
        try:
            server_chunk = int(self._client.get_chunk_size().result(timeout=wait_s))
        except Exception as exc:
            if self._settings.chunk_size is None:
                raise RuntimeError(
                    f"kvoffload connector: LMCache server at {self._settings.server_url} did not answer "
                    f"within {wait_s:.0f}s and KVOFFLOAD_CHUNK_SIZE is unset"
                ) from exc
            self._fail("heartbeat", _reason(exc), "server not reachable at start")
            return self._settings.chunk_size
        if self._settings.chunk_size and self._settings.chunk_size != server_chunk:
            logger.warning(
                "event=chunk_size_mismatch configured=%d server=%d using=server",
                self._settings.chunk_size,
                server_chunk,
            )
        if server_chunk % self._settings.tokens_per_block != 0:
            raise RuntimeError(
                f"kvoffload connector: LMCache chunk_size={server_chunk} is not a multiple of "
                f"tokens_per_block={self._settings.tokens_per_block}"
            )
        self._mark_up()
        return server_chunk

    # --- keys -------------------------------------------------------------------
    def _key(
        self,
        session_id: str,
        token_ids: tuple[int, ...],
        start: int,
        end: int,
        salt: str,
        worker: bool,
        rank: int | None = None,
    ) -> IPCCacheServerKey:
        return IPCCacheServerKey(
            model_name=cache_model_name(self._settings.model_name),
            world_size=self._settings.world_size,
            worker_id=(self._rank if rank is None else rank) if worker else None,
            token_ids=token_ids,
            start=start,
            end=end,
            request_id=session_id,
            cache_salt=salt,
            num_kv_readers=1,
        )

    # --- scheduler side -----------------------------------------------------------
    def lookup(self, session_id: str, token_ids: tuple[int, ...], end: int, salt: str) -> int:
        """Chunk-aligned hit prefix (tokens) of ``token_ids[:end]``; LMCache read-locks those chunks."""
        if not self._up.is_set():
            raise BackendError("lookup", "unavailable")
        # Read this process's own stores: wait (at most one lookup timeout) for their COMMITs.
        PENDING_COMMITS.wait_idle(self._lookup_timeout_s)
        key = self._key(session_id, token_ids, 0, end, salt, worker=False)
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
            raise self._fail("lookup", _reason(exc), repr(exc)) from exc
        return int(chunks or 0) * self.chunk_size

    def free_lookup_locks(
        self, session_id: str, token_ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...], salt: str
    ) -> None:
        """Release lookup read locks on chunk ranges that will not be retrieved."""
        PENDING_COMMITS.wait_idle(self._lookup_timeout_s)
        if not self._up.is_set():
            return
        for start, end in ranges:
            self._client.free_lookup_locks(self._key(session_id, token_ids, start, end, salt, worker=False), 1)

    def end_session(self, session_id: str) -> None:
        """Tell the server the request ended, after this process's queued COMMITs (the server sees
        a session's COMMIT before its end, as with synchronous COMMITs)."""
        PENDING_COMMITS.wait_idle(self._lookup_timeout_s)
        if self._up.is_set():
            self._client.end_session(session_id)

    def secure(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
    ) -> SecuredLoad | None:
        """Secure a load before it is promised: rank 0's worker in this process has the server hand
        out and read-lock the chunks of ``[start, end)`` for every rank. None: promise nothing."""
        local = _LOCAL_WORKERS.get(self._settings.server_url)
        return local.prepare_secured(session_id, token_ids, start, end, salt) if local is not None else None

    def release_secured(self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str) -> None:
        """Give back a secured load that will never be copied (its request ended first)."""
        local = _LOCAL_WORKERS.get(self._settings.server_url)
        if local is not None:
            local.commit_secured(session_id, token_ids, start, end, salt)

    # --- worker side ----------------------------------------------------------------
    def register(self, kv_pool: Any, geometry: KvGeometry) -> None:
        """Register the pool now; on failure the heartbeat keeps trying."""
        if self._rank == 0:
            _LOCAL_WORKERS[self._settings.server_url] = self
        self._pool = kv_pool
        self._copies = TransferStream(kv_pool.device)
        self._geometry = geometry
        self._block_bytes = int(kv_pool[0].numel() * kv_pool.element_size())
        try:
            self._register_now()
        except Exception as exc:
            self._fail("register", _reason(exc), repr(exc))
            self._needs_register = True

    def _register_now(self) -> None:
        assert self._geometry is not None and self._instance_id is not None
        kv = {_KV_NAME: self._pool}
        with self._lock:
            transfer = create_transfer_context(
                kv, instance_id=self._instance_id, req_client=self._client, mode=MPTransferMode.ENGINE_DRIVEN
            )
            transfer.register(
                kv,
                cache_model_name(self._settings.model_name),
                self._settings.world_size,
                self._blocks_per_chunk,
                max(self._store_timeout_s, self._retrieve_timeout_s),
                layout_hints=self._geometry.layout_hints(),
                engine_type=EngineType.TRTLLM,
            )
            old, self._transfer = self._transfer, transfer
            old_identity, self._shm_identity = self._shm_identity, self._shm_of(transfer)
            self._needs_register = False
        if old is not None:
            self._retire(old, old_identity)
        mode = "shm" if self._shm_identity else "pickle"
        log = logger.info if self._shm_identity else logger.warning
        log(
            "event=registered backend=sidecar rank=%d instance=%d transfer=%s shape=%s geometry=%s",
            self._rank,
            self._instance_id,
            mode,
            tuple(self._pool.shape),
            self._geometry,
        )
        self._mark_up()

    @staticmethod
    def _shm_of(transfer: Any) -> tuple[str, int] | None:
        """(segment name, inode) of the server L1 segment this context mapped; None in pickle mode."""
        # lmcache 0.5.6 keeps the name on the SHM context only as a private attribute.
        name = getattr(getattr(transfer, "_engine_driven_context", None), "_shm_name", None)
        if not name:
            return None
        try:
            return name, os.stat(os.path.join(_SHM_DIR, name.lstrip("/"))).st_ino
        except OSError:
            return name, -1

    def _shm_replaced(self) -> bool:
        ident = self._shm_identity
        if ident is None:
            return False
        try:
            return os.stat(os.path.join(_SHM_DIR, ident[0].lstrip("/"))).st_ino != ident[1]
        except OSError:
            return True

    def _acquire(self, operation: str, timeout_s: float) -> Any:
        if not self._up.is_set():
            raise BackendError(operation, "unavailable")
        if not self._lock.acquire(timeout=timeout_s):
            raise self._fail(operation, "timeout", "transfer context busy")
        transfer = self._transfer
        if transfer is None:
            self._lock.release()
            raise BackendError(operation, "unavailable", "KV pool not registered")
        return transfer

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
            return SecuredLoad(segment, tuple(per_rank))
        except _Unsecured:
            self._metrics.error("retrieve", "miss")
        except Exception as exc:
            self._fail("retrieve", _reason(exc), repr(exc))
        finally:
            self._lock.release()
        for key in asked:  # whatever was handed out goes back
            self._commit_later("retrieve", key)
        return None

    def commit_secured(self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str) -> None:
        """Queue the COMMIT_RETRIEVEs (every rank's key) that release a secured load's chunks."""
        for key in self._keys_of_every_rank(session_id, token_ids, start, end, salt):
            self._commit_later("retrieve", key)

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
        assert self._pool is not None
        started = time.perf_counter()
        results: list[LoadResult] = []
        with self._copies.after_caller():
            for op in ops:
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
                    results.append(LoadResult(0, 0.0, error))
                    continue
                results.append(LoadResult(self._loaded_bytes(op), 0.0))
        self._copies.synchronize()
        seconds = time.perf_counter() - started
        if self._rank == 0:
            self._loaded.extend(ops)
        return [LoadResult(r.nbytes, seconds, r.error) for r in results]

    def release_loaded(self) -> None:
        """After an iteration: rank 0 releases the chunks of the loads copied in it, and every rank
        unmaps replaced segments (a load is secured and copied in the same iteration, so none is
        still needed: the restarted server's L1 and the old one share the pod's /dev/shm)."""
        loaded, self._loaded = self._loaded, []
        for op in loaded:
            self.commit_secured(op.session_id, op.token_ids, op.start, op.end, op.salt)
        if self._retired:
            self._close_retired(0.0)

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
        return [
            edc._make_tensor_view(offset=slot.offset, length=slot.length, shape=list(slot.shape), dtype_str=slot.dtype)
            for slot in secured.slots[self._rank]
        ]

    def _retire(self, transfer: Any, identity: tuple[str, int] | None) -> None:
        """Keep a replaced transfer context mapped for a while (secured loads may still read it)."""
        with self._retired_lock:
            self._retired.append((transfer, identity, time.monotonic()))

    def _close_retired(self, older_than_s: float) -> None:
        with self._retired_lock:
            self._close_retired_locked(older_than_s)

    def _close_retired_locked(self, older_than_s: float) -> None:
        now = time.monotonic()
        keep = []
        for transfer, identity, since in self._retired:
            if now - since < older_than_s:
                keep.append((transfer, identity, since))
                continue
            try:
                transfer.close()
            except Exception:  # a view still exported: try again next time
                logger.debug("event=retired_close_failed segment=%s", identity, exc_info=True)
                keep.append((transfer, identity, since))
        self._retired = keep

    def _fast_copies(self) -> bool:
        """Own block<->chunk copies (``blockcopy``) inside LMCache's PREPARE/COMMIT; else LMCache's gather/scatter."""
        return self._use_fast_copies and self._shm_identity is not None and int(self._pool.shape[2]) == 2

    def retrieve(self, op: TransferOp) -> int:
        """Copy ``op``'s chunks from the server into its blocks (skipping ``op.skip_tokens``)."""
        transfer = self._acquire("retrieve", self._retrieve_timeout_s)
        start = time.monotonic()
        try:
            transfer.engine_driven_context.mq_timeout = self._retrieve_timeout_s
            key = self._key(op.session_id, op.token_ids, op.start, op.end, op.salt, worker=True)
            if self._fast_copies():
                ok = self._retrieve_fast(transfer.engine_driven_context, key, op)
            else:
                ok = transfer.submit_retrieve(
                    op.session_id,
                    key,
                    {_KV_NAME: self._pool},
                    [list(op.block_ids)],
                    transfer.create_recorded_event(),  # None on CPU; CUDA orders on it
                    self._blocks_per_chunk,
                    skip_first_n_tokens=op.skip_tokens,
                ).result(timeout=self._retrieve_timeout_s)
        except Exception as exc:
            raise self._fail("retrieve", _reason(exc), repr(exc)) from exc
        finally:
            self._lock.release()
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
        transfer = self._acquire("store", self._store_timeout_s)
        try:
            transfer.engine_driven_context.mq_timeout = self._store_timeout_s
            key = self._key(op.session_id, op.token_ids, op.start, op.end, op.salt, worker=True)
            if self._fast_copies():
                ok = self._store_fast(transfer.engine_driven_context, key, op)
            else:
                ok = transfer.submit_store(
                    op.session_id,
                    key,
                    {_KV_NAME: self._pool},
                    [list(op.block_ids)],
                    transfer.create_recorded_event(),  # None on CPU; CUDA orders on it
                    self._blocks_per_chunk,
                ).result(timeout=self._store_timeout_s)
        except Exception as exc:
            raise self._fail("store", _reason(exc), repr(exc)) from exc
        finally:
            self._lock.release()
        if not ok:
            raise self._fail("store", "server_error", f"session={op.session_id}")
        return len(op.block_ids) * self._block_bytes

    def _store_fast(self, edc: Any, key: IPCCacheServerKey, op: TransferOp) -> bool:
        assert self._instance_id is not None
        bpc = self._blocks_per_chunk
        # PREPARE needs no KV: it overlaps the forward pass still running; the copies are ordered
        # after it on the device (after_caller).
        t0 = time.perf_counter()
        prepared = edc.prepare_store(key, self._instance_id)
        t1 = time.perf_counter()
        if prepared is None:
            raise RuntimeError("server answered PREPARE_STORE without SHM slots")
        slots, indices = prepared
        if not indices:
            return True  # LMCache already holds every chunk
        with self._copies.after_caller():
            gather_chunks(self._pool, op.block_ids, slots, indices, bpc)
        self._copies.synchronize()  # the slots hold the KV before COMMIT publishes them
        t2 = time.perf_counter()
        self._commit_later("store", key)
        committed = True  # a COMMIT the server refuses is counted as a store error by the committer
        logger.debug(
            "event=transfer_timing op=store blocks=%d prepare_ms=%.3f copy_ms=%.3f commit_ms=%.3f",
            len(indices) * bpc,
            (t1 - t0) * 1e3,
            (t2 - t1) * 1e3,
            (time.perf_counter() - t2) * 1e3,
        )
        return committed

    # --- deferred COMMIT ----------------------------------------------------------------
    def _commit_later(self, operation: str, key: IPCCacheServerKey) -> None:
        """Queue the COMMIT of a finished copy (for the current transfer context; one queued for a
        context replaced before it is sent is dropped: that server is gone)."""
        PENDING_COMMITS.add()
        self._commits.put(_Commit(operation, self._transfer, key))

    def _commit_loop(self) -> None:
        while True:
            item = self._commits.get()
            if item is None:
                return
            try:
                self._commit_now(item)
            except Exception:  # the committer must outlive any one COMMIT
                logger.exception("event=commit_failed operation=%s", item.operation)
            finally:
                PENDING_COMMITS.done()

    def _commit_now(self, item: _Commit) -> None:
        with self._lock:
            if item.transfer is not self._transfer or item.transfer is None:
                # Reconnected meanwhile: that server (and its reservation) is gone; a store is lost.
                if item.operation == "store":
                    self._metrics.error("store", "unavailable")
                logger.warning("event=commit_dropped operation=%s session=%s", item.operation, item.key.request_id)
                return
            edc = item.transfer.engine_driven_context
            start = time.perf_counter()
            try:
                ok = True
                if item.operation == "store":
                    ok = bool(edc.commit_store(item.key, self._instance_id, []))
                else:
                    edc.commit_retrieve(item.key, self._instance_id)  # releases the slots; the KV is already in
            except Exception as exc:
                self._fail(item.operation, _reason(exc), f"COMMIT: {exc!r}")
                return
            if not ok:
                self._metrics.error(item.operation, "server_error")
                logger.warning("event=commit_refused operation=%s session=%s", item.operation, item.key.request_id)
            logger.debug("event=commit_timing op=%s commit_ms=%.3f", item.operation,
                         (time.perf_counter() - start) * 1e3)  # fmt: skip

    # --- heartbeat ----------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                self._close_retired(_RETIRED_GRACE_S)
                self.heartbeat_once()
            except Exception:  # the thread must survive anything
                logger.exception("event=heartbeat_error backend=sidecar role=%s", self._role)

    def heartbeat_once(self) -> None:
        """PING; on failure reconnect, on success (re)register the pool when needed."""
        if self._needs_reset:
            self._reset_client()
        try:
            self._client.ping(self._instance_id).result(timeout=self._ping_timeout_s)
        except Exception as exc:
            if self._up.is_set():
                self._fail("heartbeat", _reason(exc), repr(exc))
            self._needs_reset = True
            return
        if self._pool is not None and (self._needs_register or self._shm_replaced()):
            try:
                self._register_now()
            except Exception as exc:
                self._fail("register", _reason(exc), repr(exc))
                self._needs_register = True
                return
        self._mark_up()

    def _reset_client(self) -> None:
        """New socket; the old one's queued requests are dropped (LINGER 0)."""
        with self._lock:
            old = self._client
            self._client = RequestClientFactory.create(self._settings.server_url, context=self._zmq)
            self._needs_reset = False
            if self._pool is not None:
                self._needs_register = True
            transfer, self._transfer = self._transfer, None
            identity, self._shm_identity = self._shm_identity, None
        if transfer is not None:
            self._retire(transfer, identity)
        old.close()

    def close(self) -> None:
        """Send the queued COMMITs, stop the heartbeat, unregister and close the connection."""
        self._commits.put(None)
        self._committer.join(timeout=max(5.0, self._store_timeout_s))
        self._stop.set()
        self._heartbeat.join(timeout=5)
        if _LOCAL_WORKERS.get(self._settings.server_url) is self:
            del _LOCAL_WORKERS[self._settings.server_url]
        self._close_retired(0.0)
        with self._lock:
            transfer, self._transfer = self._transfer, None
        if transfer is not None:
            if self._up.is_set():
                try:
                    future = transfer.unregister()
                    if future is not None:
                        future.result(timeout=1.0)
                except Exception:
                    logger.debug("event=unregister_failed backend=sidecar", exc_info=True)
            transfer.close()
        self._client.close()
