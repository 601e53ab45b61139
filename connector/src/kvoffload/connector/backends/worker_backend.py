"""Each worker's backend over an LMCache MP server: registers the pool, keeps it registered, and
copies KV between TensorRT-LLM's pool and the server (``copies``).

Data path (why, see docs/connector.md): LMCache 0.5.6's server-driven transfer
(``lmcache_driven``, what LMCache's own TensorRT-LLM MP adapter uses) fails in
the server for TensorRT-LLM's pool layout. The worker-driven transfer
(``engine_driven``: PREPARE -> copy -> COMMIT) works: the worker copies whole
TensorRT-LLM blocks between its pool and slots of the server's L1, which the
server exposes as a POSIX shared-memory segment (``--shm-name`` with
``--no-l1-use-lazy``). The server is the pod's sidecar (``tcp://127.0.0.1:<port>``) or the
one the in-process backend hosts.

The backend is composed of parts that each own their fields and locks: the connection and
heartbeat (:mod:`.server_link`), the transfer context and its segments (:mod:`.segments`), the
committer (:mod:`.committer`), secured loads (:mod:`.securing`) and, once a pool is registered,
the copies (:mod:`.pool_transfers`, reached through :mod:`.pool_copies`). This module wires them;
its heartbeat notices restarts (a failed PING, or the server's segment replaced) and registers the
pool again. Rank 0's backend also secures loads for the scheduler of its process
(:mod:`.scheduler_client`, through ``EngineProcess.worker``).
"""

from __future__ import annotations

import logging
from typing import Any

from kvoffload.connector.backends.base import KvGeometry, instance_id
from kvoffload.connector.backends.blockcopy import GroupedPages
from kvoffload.connector.backends.chunk_keys import ChunkKeys
from kvoffload.connector.backends.committer import Committer
from kvoffload.connector.backends.connection import failure_reason
from kvoffload.connector.backends.engine_process import EngineProcess
from kvoffload.connector.backends.pool_copies import PoolCopies
from kvoffload.connector.backends.pool_transfers import KV_POOL_NAME, PoolTransfers, Timeouts
from kvoffload.connector.backends.securing import SecuredHit, Securing
from kvoffload.connector.backends.segments import RETIRED_GRACE_S, Segment, Segments
from kvoffload.connector.backends.server_link import ServerLink
from kvoffload.connector.backends.store_reports import StoreReporter
from kvoffload.connector.identities import model_identity
from kvoffload.connector.keys import cache_model_name, chunk_layout
from kvoffload.connector.layout import GroupedLayout, KeyRanks, PoolLayout, describe_pool, key_ranks, transfer_shape
from kvoffload.connector.lmcache_seam import EngineType, IPCCacheServerKey, MPTransferMode, create_transfer_context
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.settings import ConnectorSettings
from kvoffload.connector.wire import SecuredLoad

logger = logging.getLogger("kvoffload.connector")


class WorkerBackend:
    """One worker's registration, heartbeat and copies over an LMCache MP server, for one rank."""

    def __init__(self, settings: ConnectorSettings, *, rank: int, metrics: ConnectorMetrics,
                 process: EngineProcess, use_fast_copies: bool = True) -> None:  # fmt: skip
        self._settings = settings
        self._rank = rank
        self._metrics = metrics
        self._process = process
        self._use_fast_copies = use_fast_copies
        self._instance_id = instance_id()
        self._timeouts = Timeouts(settings.retrieve_timeout_ms / 1000.0, settings.store_timeout_ms / 1000.0)
        self._link = ServerLink(settings, "worker", metrics)
        self.connection = self._link.connection
        """The request client, up or down, PINGs."""
        self.chunk_size = self._link.chunk_size
        self.segments = Segments()
        """The registered transfer context, its segment and the retired ones."""
        self._keys = ChunkKeys(settings.world_size, rank)
        self._needs_register = False
        self._geometry: KvGeometry | None = None
        self.transfers: PoolTransfers | None = None
        """The registered pool's loads and stores (None before ``register``)."""
        self.grouped_layout: GroupedLayout | None = None
        """A worker's cache of several layer groups, once registered (``register_grouped``)."""
        reports = StoreReporter(settings.model_name, settings.tokens_per_block, metrics) if settings.kv_events else None
        self.committer = Committer("worker", self._instance_id, self.connection, self.segments, process.pending,
                                   metrics, reports)  # fmt: skip
        self._securing = Securing(
            instance_id=self._instance_id, chunk_size=self.chunk_size,
            retrieve_timeout_s=self._timeouts.retrieve_s, connection=self.connection, segments=self.segments,
            keys=self._keys, committer=self.committer, metrics=metrics,
        )  # fmt: skip
        self.copies = PoolCopies(lambda: self.transfers, parked=process.parked_loads(settings.server_url),
                                 saving=process.saving_requests(settings.server_url), pending=process.pending,
                                 reports=reports)  # fmt: skip
        """What the worker hooks load and store through."""
        # ``heartbeat_once`` looked up at each beat: the stand-in engine stalls a rank's by replacing it.
        self._link.start_heartbeat(
            lambda: self.heartbeat_once(), between=lambda: self.segments.close_retired(RETIRED_GRACE_S)
        )

    # --- state --------------------------------------------------------------------------------
    def is_up(self) -> bool:
        """Whether the last contact with the server succeeded."""
        return self.connection.is_up()

    @property
    def cache_model(self) -> str | None:
        """The model name in this backend's keys, tagged with the layout of the pool it registered
        (``keys.cache_model_name``); None before a pool was registered."""
        return self._keys.model

    @property
    def instance_id(self) -> int:
        """The worker instance this backend registered its pool as (the server's name for it)."""
        return self._instance_id

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
        self._link.stop_heartbeat(10)

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
        assert transfers is not None and geometry is not None
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

    def heartbeat_once(self) -> None:
        """One heartbeat, on the caller's thread; never two at once (the heartbeat thread, a load that
        catches up with a restarted server's segment, a test)."""
        self._link.beat_once(self._beat)

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
        self._link.stop_heartbeat(5)
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

    # --- rank 0's worker, for the scheduler -------------------------------------------------------
    def prepare_secured(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
    ) -> SecuredLoad | None:
        """PREPARE_RETRIEVE ``[start, end)`` for every rank under this worker's instance (``Securing.prepare``)."""
        return self._securing.prepare(session_id, token_ids, start, end, salt)

    def lookup_and_secure(self, client: Any, lookup_key: IPCCacheServerKey, start: int, cap: int, wait_s: float,
                          deadline: float) -> SecuredHit | None:  # fmt: skip
        """LOOKUP and PREPARE_RETRIEVE for every rank in one server call (``Securing.lookup_and_prepare``)."""
        return self._securing.lookup_and_prepare(client, lookup_key, start, cap, wait_s, deadline)

    def commit_secured(self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str,
                       segment: Segment) -> None:  # fmt: skip
        """Queue the COMMIT_RETRIEVEs that release a secured load's chunks (``Securing.commit``)."""
        self._securing.commit(session_id, token_ids, start, end, salt, segment)
