"""The connector's backend over an LMCache MP server: lookups, secured loads, stores.

Data path (why, see docs/connector.md): LMCache 0.5.6's server-driven transfer
(``lmcache_driven``, what LMCache's own TensorRT-LLM MP adapter uses) fails in
the server for TensorRT-LLM's pool layout. The worker-driven transfer
(``engine_driven``: PREPARE -> copy -> COMMIT) works: the worker copies whole
TensorRT-LLM blocks between its pool and slots of the server's L1, which the
server exposes as a POSIX shared-memory segment (``--shm-name`` with
``--no-l1-use-lazy``). The server is the pod's sidecar (``tcp://127.0.0.1:<port>``) or the
one the in-process backend hosts.

The backend is composed of parts that each own their fields and locks: the connection
(:mod:`.connection`: request client, up/down, PINGs), the transfer context and its segments
(:mod:`.segments`), the committer (:mod:`.commits`), secured loads (:mod:`.securing`) and, once a
pool is registered, the copies (:mod:`.pool_transfers`). This module wires them and runs the
heartbeat: it PINGs the server (which also keeps the server's reaper from dropping this worker),
notices restarts (a failed PING, or the server's segment replaced) and registers the pool again.
Every call has its own timeout; while the connection is down calls fail at once (lookups answer 0,
stores are skipped) and nothing waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvoffload.connector.backends.abandoned_lookups import AbandonedLookups
from kvoffload.connector.backends.base import BackendError, KvGeometry, LoadResult, instance_id
from kvoffload.connector.backends.blockcopy import GroupedPages
from kvoffload.connector.backends.chunk_keys import ChunkKeys
from kvoffload.connector.backends.commits import chain_of
from kvoffload.connector.backends.committer import Committer
from kvoffload.connector.backends.connection import ServerConnection, failure_reason
from kvoffload.connector.backends.engine_process import EngineProcess
from kvoffload.connector.backends.layer_copies import LayerwiseLoad
from kvoffload.connector.backends.pool_transfers import KV_POOL_NAME, PoolTransfers, Timeouts
from kvoffload.connector.backends.securing import Securing
from kvoffload.connector.backends.segments import RETIRED_GRACE_S, Segment, Segments
from kvoffload.connector.backends.store_reports import StoreReporter
from kvoffload.connector.identities import model_identity
from kvoffload.connector.keys import cache_model_name, chunk_layout
from kvoffload.connector.layout import (
    GroupedLayout,
    KeyRanks,
    PoolLayout,
    describe_pool,
    key_ranks,
    transfer_shape,
)
from kvoffload.connector.lmcache_seam import EngineType, MPTransferMode, create_transfer_context
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.settings import ConnectorSettings
from kvoffload.connector.wire import SecuredLoad, TransferOp

logger = logging.getLogger("kvoffload.connector")

_STARTUP_WAIT_S = 30.0


class CacheServerBackend:
    """The connector's lookups, secured loads and stores over an LMCache MP server, for one role
    (``scheduler`` or ``worker``) and rank."""

    def __init__(self, settings: ConnectorSettings, *, rank: int, role: str, metrics: ConnectorMetrics,
                 process: EngineProcess, use_fast_copies: bool = True) -> None:  # fmt: skip
        self._settings = settings
        self._rank = rank
        self._role = role
        self._metrics = metrics
        self._process = process
        self._use_fast_copies = use_fast_copies
        self._instance_id: int | None = instance_id() if role == "worker" else None
        self._heartbeat_lock = threading.Lock()  # the heartbeat thread and a load catching up, one at a time
        self._lookup_timeout_s = settings.lookup_timeout_ms / 1000.0
        self._timeouts = Timeouts(settings.retrieve_timeout_ms / 1000.0, settings.store_timeout_ms / 1000.0)
        self.connection = ServerConnection(settings, role, metrics)
        """The request client, up or down, PINGs."""
        self.segments = Segments()
        """The registered transfer context, its segment and the retired ones."""
        self._keys = ChunkKeys(settings.world_size, rank)
        self._needs_register = False
        self._geometry: KvGeometry | None = None
        self.transfers: PoolTransfers | None = None
        self.grouped_layout: GroupedLayout | None = None
        """A worker's cache of several layer groups, once registered (``register_grouped``)."""
        """The registered pool's loads and stores (None before ``register``)."""
        self.chunk_size = self._initial_chunk_size()
        reports = StoreReporter(settings.model_name, settings.tokens_per_block, metrics) if settings.kv_events else None
        self._reports = reports
        self.committer = Committer(role, self._instance_id, self.connection, self.segments, process.pending,
                                    metrics, reports)  # fmt: skip
        self._securing = None if self._instance_id is None else Securing(
            instance_id=self._instance_id, chunk_size=self.chunk_size,
            retrieve_timeout_s=self._timeouts.retrieve_s, connection=self.connection, segments=self.segments,
            keys=self._keys, committer=self.committer, metrics=metrics,
        )  # fmt: skip
        self.abandoned_lookups = AbandonedLookups(self.connection, metrics)
        """Lookups answered too late, whose server prefetch is settled before the session's next lookup and at its end."""
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name=f"kvoffload-heartbeat-{role}", daemon=True)
        self._heartbeat.start()

    # --- state --------------------------------------------------------------------------------
    def is_up(self) -> bool:
        """Whether the last contact with the server succeeded."""
        return self.connection.is_up()

    @property
    def cache_model(self) -> str | None:
        """The model name in this backend's keys, tagged with the layout of the pool it registered
        (``keys.cache_model_name``); None before a pool was registered."""
        return self._keys.model

    def layer_groups(self) -> GroupedLayout | None:
        """Scheduler: the layer groups the worker of this process registered (None: one pool, or none yet)."""
        local = self._process.worker(self._settings.server_url)
        return local.grouped_layout if local is not None else None

    @property
    def chunk_keys(self) -> ChunkKeys:
        """How this backend names chunks on the server (model, key world and rank)."""
        return self._keys

    @property
    def segment(self) -> Segment | None:
        """The server segment the current transfer context maps (None: none registered, or pickle mode)."""
        return self.segments.segment

    @property
    def connection_generation(self) -> int:
        """How many times the connection was replaced by a fresh one (it went down)."""
        return self.connection.generation

    @property
    def registration_generation(self) -> int:
        """How many transfer contexts were registered (the pool again after each reset or restart)."""
        return self.segments.generation

    def wait_commits(self, timeout_s: float) -> bool:
        """True once every COMMIT queued in this engine process was answered or dropped (within ``timeout_s``)."""
        return self._process.pending.wait_idle(timeout_s)

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread: from then on only ``heartbeat_once`` PINGs (tests drive it by hand)."""
        self.connection.stop()
        self._heartbeat.join(10)

    def _initial_chunk_size(self) -> int:
        wait_s = 2.0 if self._settings.chunk_size else _STARTUP_WAIT_S
        try:
            server_chunk = int(self.connection.client.get_chunk_size().result(timeout=wait_s))
        except Exception as exc:
            if self._settings.chunk_size is None:
                raise RuntimeError(
                    f"kvoffload connector: LMCache server at {self._settings.server_url} did not answer "
                    f"within {wait_s:.0f}s and KVOFFLOAD_CHUNK_SIZE is unset"
                ) from exc
            self.connection.fail("heartbeat", failure_reason(exc), "server not reachable at start")
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
        self.connection.mark_up()
        return server_chunk

    # --- registration and heartbeat -------------------------------------------------------------
    def register(self, kv_pool: Any, geometry: KvGeometry, layout: PoolLayout | None = None) -> None:
        """Register the pool now (on failure the heartbeat keeps trying); rank 0 secures this process's loads.

        ``layout`` (``layout.describe_pool`` of the pool's shape when None) decides the keys: a pool
        every tensor-parallel rank holds alike (MLA) is keyed as one rank's and stored by rank 0 only,
        and LMCache is shown its two-plane view (``layout.transfer_shape``).
        """
        if layout is None:
            layout = describe_pool(tuple(kv_pool.shape), self._settings.tokens_per_block)
        kv_pool = kv_pool.view(transfer_shape(tuple(kv_pool.shape), layout))
        self._register_pool(kv_pool, geometry, key_ranks(layout, self._settings.world_size, self._rank), layout.tag())

    def register_grouped(self, pages: GroupedPages, layout: GroupedLayout, dtype: Any) -> None:
        """Register a cache of several layer groups: a chunk holds every group's pages of its blocks
        (``layout.GroupedLayout``), each rank its own (its heads). LMCache sizes chunk slots from the
        registered pool, so it is shown one block of that size, ``[1, 1, 2, elems]`` of ``dtype``."""
        import torch

        itemsize = torch.tensor([], dtype=dtype).element_size()
        per_plane = 2 * itemsize * self._settings.tokens_per_block
        if pages.block_bytes % per_plane:
            raise RuntimeError(
                f"kvoffload: a block of every layer group holds {pages.block_bytes} bytes, not a whole number of "
                f"two {dtype} planes of {self._settings.tokens_per_block} tokens"
            )
        head_dim = pages.block_bytes // per_plane
        stand_in = torch.zeros((1, 1, 2, self._settings.tokens_per_block * head_dim), dtype=dtype, device=pages.device)
        ranks = KeyRanks(self._settings.world_size, self._rank, True)
        self.grouped_layout = layout
        self._register_pool(stand_in, KvGeometry(1, self._settings.tokens_per_block, head_dim), ranks, layout.tag(),
                            pages)  # fmt: skip

    def _register_pool(self, kv_pool: Any, geometry: KvGeometry, ranks: KeyRanks, tag: str,
                       pages: GroupedPages | None = None) -> None:  # fmt: skip
        assert self._instance_id is not None, "only a worker registers a pool"
        self._keys.use(ranks)
        if self._rank == 0:
            self._process.attach(self._settings.server_url, self)
        self._geometry = geometry
        self.transfers = PoolTransfers(
            kv_pool, rank=self._rank, instance_id=self._instance_id, tokens_per_block=self._settings.tokens_per_block,
            chunk_size=self.chunk_size, timeouts=self._timeouts, use_fast_copies=self._use_fast_copies,
            connection=self.connection, segments=self.segments, keys=self._keys, committer=self.committer,
            securing=self._securing if self._rank == 0 else None, metrics=self._metrics, pages=pages,
            catch_up=self.heartbeat_once,
        )  # fmt: skip
        chunks = chunk_layout(kv_pool.dtype, self._settings.tokens_per_block, self.transfers.block_bytes, tag)
        weights = model_identity(self._settings.model_source, self._settings.model_revision)
        self._keys.model = cache_model_name(self._settings.model_name, chunks, weights)
        try:
            self._register_now()
        except Exception as exc:
            self.connection.fail("register", failure_reason(exc), repr(exc))
            self._needs_register = True

    def _register_now(self) -> None:
        transfers, geometry = self.transfers, self._geometry
        assert transfers is not None and geometry is not None and self._instance_id is not None
        kv = {KV_POOL_NAME: transfers.pool}
        with self.segments.lock:
            transfer = create_transfer_context(
                kv, instance_id=self._instance_id, req_client=self.connection.client,
                mode=MPTransferMode.ENGINE_DRIVEN,
            )  # fmt: skip
            transfer.register(
                kv,
                self._keys.model,
                self._keys.world_size,
                self.chunk_size // self._settings.tokens_per_block,
                max(self._timeouts.store_s, self._timeouts.retrieve_s),
                layout_hints=geometry.layout_hints(),
                engine_type=EngineType.TRTLLM,
            )
            self.segments.install(transfer)
            self._needs_register = False
        shm = self.segments.segment is not None
        (logger.info if shm else logger.warning)(
            "event=registered backend=sidecar rank=%d instance=%d transfer=%s shape=%s geometry=%s",
            self._rank, self._instance_id, "shm" if shm else "pickle", tuple(transfers.pool.shape), geometry,
        )  # fmt: skip
        self.connection.mark_up()

    def _heartbeat_loop(self) -> None:
        while self.connection.wait_for_next_ping():
            try:
                self.segments.close_retired(RETIRED_GRACE_S)
                self.heartbeat_once()
            except Exception:  # the thread must survive anything
                logger.exception("event=heartbeat_error backend=sidecar role=%s", self._role)

    def heartbeat_once(self) -> None:
        """One heartbeat, on the caller's thread; never two at once (the heartbeat thread, a load that
        catches up with a restarted server's segment, a test)."""
        with self._heartbeat_lock:
            self._beat()

    def _beat(self) -> None:
        """PING (``ServerConnection.ping``); a connection that went down is replaced first, and on
        success the pool is registered again when needed (a reset, or the server's segment replaced)."""
        if self.connection.needs_reset:
            self._reset()
        if not self.connection.ping(self._instance_id):
            return
        if self.transfers is not None and (self._needs_register or self.segments.replaced_on_server()):
            try:
                self._register_now()
            except Exception as exc:
                self.connection.fail("register", failure_reason(exc), repr(exc))
                self._needs_register = True
                return
        self.connection.mark_up()
        self.committer.retry_aborts()

    def _reset(self) -> None:
        """A fresh socket; the transfer context on the old one goes (retired until nothing reads it)."""
        with self.segments.lock:
            old = self.connection.replace_client()
            if self.transfers is not None:
                self._needs_register = True
            self.segments.drop()
        old.close()

    def close(self) -> None:
        """Send the queued COMMITs and aborts, stop the heartbeat, unregister and close the connection;
        this process secures no more loads here. A context that may still hold a reservation (an abort
        never answered) is not unregistered: the server's release of it is not where a store ends."""
        self._process.detach(self._settings.server_url, self)
        self.segments.stop_waiting()  # a COMMIT waiting for a registration gives up
        self.committer.close(timeout_s=max(5.0, self._timeouts.store_s))
        self.abandoned_lookups.close(timeout_s=5.0)
        self.connection.stop()
        self._heartbeat.join(timeout=5)
        transfer = self.segments.detach()
        if self.transfers is not None:
            self.transfers.store_copies.synchronize()  # a store's copies may still write into the segment
            self.transfers.load_copies.synchronize()  # and a layer-wise load's still read from it
        if transfer is not None:
            if self.committer.unaborted:
                logger.warning("event=unregister_skipped backend=sidecar reason=unaborted_stores count=%d",
                               self.committer.unaborted)  # fmt: skip
            elif self.connection.is_up():
                try:
                    future = transfer.unregister()
                    if future is not None:
                        future.result(timeout=1.0)
                except Exception:
                    logger.debug("event=unregister_failed backend=sidecar", exc_info=True)
            transfer.close()
        self.connection.close()

    # --- scheduler side -------------------------------------------------------------------------
    def lookup(self, session_id: str, token_ids: tuple[int, ...], end: int, salt: str) -> int:
        """Chunk-aligned hit prefix (tokens) of ``token_ids[:end]``; LMCache read-locks those chunks."""
        if not self.connection.is_up():
            raise BackendError("lookup", "unavailable")
        self._key_as_local_worker()
        key = self._keys.key(session_id, token_ids, 0, end, salt, worker=False)
        # Read this process's own stores on this prompt's chain: wait (at most one lookup timeout)
        # for their COMMITs; other requests' COMMITs cannot change this answer.
        self._process.pending.wait_chain(chain_of(key, self.chunk_size), self._lookup_timeout_s)
        client = self.connection.client
        deadline = time.monotonic() + self._lookup_timeout_s
        sent = False
        try:
            # A lookup of this session that was answered too late is settled first (its locks go);
            # while its prefetch still runs no new LOOKUP goes (it would replace that job).
            if not self.abandoned_lookups.settle(client, session_id, deadline - time.monotonic()):
                raise self.connection.slow("lookup", "the session's previous prefetch still runs")
            # The server may run LOOKUP and WAIT on different threads: WAIT before LOOKUP has
            # registered the prefetch job answers 0 (a miss for KV that is there), so LOOKUP's
            # answer comes first.
            sent = True
            client.lookup(key, 1).result(timeout=max(0.0, deadline - time.monotonic()) + 0.05)
            # WAIT (not QUERY) so a prefetch still running is not misread as a miss.
            chunks = client.wait_prefetch_status(session_id, self._lookup_timeout_s).result(
                timeout=max(0.0, deadline - time.monotonic()) + 0.05
            )
        except BackendError:
            raise
        except Exception as exc:
            if sent:  # the server may have started the prefetch: its locks are settled later
                self.abandoned_lookups.abandoned(session_id, key)
            raise self.connection.request_failed("lookup", exc, client) from exc
        if chunks is None:  # the prefetch outlived the lookup timeout: a miss now, its locks settled later
            self.abandoned_lookups.abandoned(session_id, key)
            raise self.connection.slow("lookup", "prefetch outlived the lookup timeout")
        return int(chunks) * self.chunk_size

    def _key_as_local_worker(self) -> None:
        """Key lookups with the chunk layout of the pool rank 0's worker in this process registered
        (TensorRT-LLM runs the scheduler in rank 0's process); without one nothing is looked up,
        as nothing could be loaded."""
        local = self._process.worker(self._settings.server_url)
        if local is None or local.cache_model is None:
            raise BackendError("lookup", "unavailable", "no worker in this process registered its KV pool")
        self._keys.adopt(local.chunk_keys)

    def free_lookup_locks(
        self, session_id: str, token_ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...], salt: str
    ) -> None:
        """Release lookup read locks on chunk ranges that will not be retrieved (after the session's
        queued COMMITs, as the server would see synchronous ones)."""
        self._process.pending.wait_session(session_id, self._lookup_timeout_s)
        if not self.connection.is_up():
            return
        for start, end in ranges:
            key = self._keys.key(session_id, token_ids, start, end, salt, worker=False)
            self.connection.client.free_lookup_locks(key, 1)

    def end_session(self, session_id: str) -> None:
        """Tell the server the request ended, after the session's queued COMMITs (the server sees
        a session's COMMIT before its end, as with synchronous COMMITs)."""
        self._process.pending.wait_session(session_id, self._lookup_timeout_s)
        if self.abandoned_lookups.end(session_id, lambda: self._end_session_now(session_id)):
            return  # settled off the engine's path first
        self._end_session_now(session_id)

    def _end_session_now(self, session_id: str) -> None:
        if self.connection.is_up():
            self.connection.client.end_session(session_id)

    def secure(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
    ) -> SecuredLoad | None:
        """Secure a load before it is promised: rank 0's worker in this process has the server hand
        out and read-lock the chunks of ``[start, end)`` for every rank. None: promise nothing."""
        local = self._process.worker(self._settings.server_url)
        return local.prepare_secured(session_id, token_ids, start, end, salt) if local is not None else None

    def release_secured(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str, secured: SecuredLoad
    ) -> None:
        """Give back a secured load that will never be copied (its request ended first)."""
        local = self._process.worker(self._settings.server_url)
        if local is not None:
            local.commit_secured(session_id, token_ids, start, end, salt, secured.segment)

    # --- rank 0's worker, for the scheduler -------------------------------------------------------
    def prepare_secured(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
    ) -> SecuredLoad | None:
        """PREPARE_RETRIEVE ``[start, end)`` for every rank under this worker's instance (``Securing.prepare``)."""
        return self._securing.prepare(session_id, token_ids, start, end, salt) if self._securing else None

    def commit_secured(self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str,
                       segment: Segment) -> None:  # fmt: skip
        """Queue the COMMIT_RETRIEVEs that release a secured load's chunks (``Securing.commit``)."""
        if self._securing is not None:
            self._securing.commit(session_id, token_ids, start, end, salt, segment)

    # --- worker side: the registered pool's transfers ----------------------------------------------
    def _pool(self, operation: str) -> PoolTransfers:
        if self.transfers is None:
            raise BackendError(operation, "unavailable", "KV pool not registered")
        return self.transfers

    def load_secured(self, ops: Sequence[TransferOp]) -> list[LoadResult]:
        return self._pool("retrieve").load_secured(ops)

    def load_secured_by_layer(self, ops: Sequence[TransferOp]) -> LayerwiseLoad | None:
        transfers = self._pool("retrieve")
        return transfers.load_secured_by_layer(ops) if transfers.layerwise_loads_possible() else None

    def expect_async_load(self) -> None:
        self._pool("retrieve").expect_async_load()

    def start_async_load(self, op: TransferOp) -> BackendError | None:
        return self._pool("retrieve").start_async_load(op)

    def finished_async_loads(self) -> list[tuple[TransferOp, LoadResult]]:
        return self.transfers.finished_async_loads() if self.transfers is not None else []

    def order_after_async_loads(self, blocks: frozenset[int]) -> None:
        if self.transfers is not None:
            self.transfers.order_after_async_loads(blocks)

    def wait_async_loads(self, blocks: frozenset[int]) -> None:
        if self.transfers is not None:
            self.transfers.wait_async_loads(blocks)

    def park_load(self, request_id: int, llm_request: Any, blocks: frozenset[int]) -> None:
        self._process.parked_loads(self._settings.server_url).park(request_id, llm_request, blocks)

    def unpark_load(self, request_id: int) -> None:
        self._process.parked_loads(self._settings.server_url).unpark(request_id)

    def abandoned_load_blocks(self) -> frozenset[int]:
        return self._process.parked_loads(self._settings.server_url).abandoned_blocks()

    def release_loaded(self) -> None:
        if self.transfers is not None:
            self.transfers.release_loaded()

    def retrieve(self, op: TransferOp) -> int:
        return self._pool("retrieve").retrieve(op)

    def store(self, op: TransferOp) -> int:
        if self._reports is not None and op.lora is not None:
            self._reports.scope(op.salt, op.lora)
        return self._pool("store").store(op)

    def commits_pending(self, session_id: str) -> bool:
        """Whether the session's queued COMMITs (its stores' publication) are not all answered yet."""
        return self._process.pending.session_pending(session_id)
