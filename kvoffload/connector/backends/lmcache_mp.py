"""LMCache's multi-process server, as a client: connection, registration, health, deferred COMMITs.

LMCache comes through :mod:`kvoffload.connector.lmcache_seam` (its client, transfer contexts, keys,
and the private names that seam lists). :class:`~kvoffload.connector.backends.cache_server.CacheServerBackend`
builds the connector's lookups, loads and stores on it, for the pod's sidecar or for the server
the in-process backend hosts.

COMMIT off the engine's path: after the copy (synchronised, so the KV is where it must be) the
COMMIT that publishes a store or releases a retrieve's slots is sent by a committer thread
while the engine goes on, without holding the transfer lock during its round trip. Lookups in
this process first wait for the pending store COMMITs on their prompt's chain (bounded by the
lookup timeout), and a request's save is reported done only once its COMMITs were answered, so a
request never misses KV that a finished request stored. A COMMIT that fails marks the backend
down like any other failed call.

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
from collections import Counter
from dataclasses import dataclass
from typing import Any

import zmq

from kvoffload.cache_keys import ClientKeys
from kvoffload.connector.backends.base import BackendError, KvGeometry, instance_id
from kvoffload.connector.backends.blockcopy import CopyMark, TransferStream
from kvoffload.connector.backends.commits import PENDING_COMMITS, DeferredCommit, chain_of
from kvoffload.connector.backends.store_reports import StoreReporter
from kvoffload.connector.keys import cache_model_name, chunk_layout
from kvoffload.connector.lmcache_seam import (
    EngineType,
    IPCCacheServerKey,
    MPTransferMode,
    RequestClientFactory,
    ServerDisconnected,
    create_transfer_context,
    fail_requests_on_disconnect,
    shm_segment_name,
)
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.planning import TransferOp
from kvoffload.connector.settings import ConnectorSettings

logger = logging.getLogger("kvoffload.connector")

KV_POOL_NAME = "trtllm_kv_pool"
_STARTUP_WAIT_S = 30.0
_SHM_DIR = "/dev/shm"
_MIN_PING_TIMEOUT_S = 2.0
_RECONNECT_S = 0.25
"""While the server is down the heartbeat tries this often, each time on a fresh socket, so a
restarted server is found within about this long of its start (not a heartbeat interval or two)."""
_PINGS_MISSED_FOR_DOWN = 2
"""PINGs in a row a live connection may leave unanswered before the backend is down: one missed
PING is a busy server (the next goes ``_RECONNECT_S`` later); a dropped connection is down at once."""
_RECONNECT_PING_TIMEOUT_S = 1.0
"""A PING to a server believed down: a restarted one answers a fresh socket in milliseconds."""
_COMMIT_AWAITS_REGISTRATION_S = 15.0
"""How long after a reset COMMITs queued before it wait for the next registration, which says
whether the server that prepared them is still there (same segment: send them there) or gone (drop
them). Dropping one for a live server would keep its reservation, and LMCache would refuse to store
those chunks again until the reservation's write lock expires (600 s by default). One deadline for
all of them: a long outage holds the queue this long once, not once per COMMIT."""
_COMMIT_ATTEMPTS = 3
"""Sends of one COMMIT at most: a connection reset under a COMMIT to a server that is still there
sends it again on the new connection."""
_RETIRED_GRACE_S = 10.0
"""A replaced transfer context (server restarted) stays mapped until the end of the engine's
iteration (``release_loaded``), or this long when the engine is idle, and in any case while a load
secured in its segment is open (rank 0 counts them): such loads still copy from it."""


@dataclass
class AsyncLoad:
    """One asynchronous load in flight: its op, when it was issued, and the mark after its copies."""

    op: TransferOp
    started: float
    copied: CopyMark
    nbytes: int


def failure_reason(exc: BaseException) -> str:
    if isinstance(exc, ServerDisconnected):
        return "unavailable"
    return "timeout" if isinstance(exc, TimeoutError) else "server_error"


def authenticate_as_client(context: zmq.Context[Any], keys: ClientKeys) -> None:
    """Make every socket ``context`` creates from now on a CURVE client with ``keys`` (context-level
    options apply to each new socket, so every reconnect's fresh socket authenticates too)."""
    context.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode("ascii"))
    context.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode("ascii"))
    context.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode("ascii"))


class LMCacheMPClient:
    """One process's connection to an LMCache MP server, for one role (``scheduler`` or ``worker``)."""

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
        if settings.cache_keys is not None:  # node mode: the policy's node cache admits only its client key
            authenticate_as_client(self._zmq, settings.cache_keys)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._up = threading.Event()  # these before the client: its disconnect callback reads them
        self._pings_missed = 0  # in a row, while up (heartbeat thread)
        self._client_lock = threading.Lock()
        """Held while the client is replaced and while a failure marks it down: a failure on a
        connection already replaced must not take the new one down (a late error from a dead
        server would reconnect to the new one again, dropping what was prepared there)."""
        self._wake_heartbeat = threading.Event()
        """Set when the backend goes down (or closes): reconnecting starts at once, not at the next tick."""
        self._client: Any = self._new_client()
        self._needs_reset = False
        self._needs_register = False
        self._pool: Any = None
        self._copies: TransferStream  # loads' copies; set with the pool (register)
        self._store_copies: TransferStream  # stores' copies, apart: a store may wait for a forward pass
        self._stores_copying = 0
        """Stores whose copies were issued and not yet waited for (under ``_retired_lock``)."""
        self._geometry: KvGeometry | None = None
        self._block_bytes = 0
        self._cache_model: str | None = None
        """The model name in this client's keys (:meth:`cache_model`)."""
        self._transfer: Any = None
        self._shm_identity: tuple[str, int] | None = None
        self._registered = threading.Condition(self._lock)
        """Notified when a transfer context is registered (or the client closes): a COMMIT queued
        during a reset waits on it to learn whether its server is still there."""
        self._closing = False
        self._transfer_lost_at = 0.0
        """When a reset last dropped the transfer context (monotonic)."""
        self._retired: list[tuple[Any, tuple[str, int] | None, float]] = []
        self._retired_lock = threading.Lock()  # heartbeat thread and engine thread both close them
        self._secured_open: Counter[tuple[str, int]] = Counter()
        """Secured loads handed out (rank 0) and not yet given back, per segment (under ``_retired_lock``):
        a replaced segment stays mapped while one is open, however long the restart took."""
        self._loaded: list[TransferOp] = []
        self._async_loads: list[AsyncLoad] = []
        """Asynchronous loads whose copies were issued and not yet reported finished."""
        self._async_outstanding = 0
        """Asynchronous loads announced (``expect_async_load``) and not yet finished or dropped."""
        self._async_lock = threading.Lock()  # the loader thread issues, the engine thread polls
        self.chunk_size = self._initial_chunk_size()
        self._blocks_per_chunk = self.chunk_size // settings.tokens_per_block
        self._store_reports = (
            StoreReporter(settings.model_name, settings.tokens_per_block, metrics) if settings.kv_events else None
        )
        """Reports committed stores to the server's KV-event module (opt-in), from the committer thread."""
        self._commits: queue.Queue[DeferredCommit | None] = queue.Queue()
        self._committer = threading.Thread(target=self._commit_loop, name=f"kvoffload-commit-{role}", daemon=True)
        self._committer.start()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name=f"kvoffload-heartbeat-{role}", daemon=True)
        self._heartbeat.start()

    # --- state ------------------------------------------------------------------
    def is_up(self) -> bool:
        """Whether the last contact with the server succeeded."""
        return self._up.is_set()

    @property
    def cache_model(self) -> str | None:
        """The model name in this client's keys, tagged with the layout of the pool it registered
        (``keys.cache_model_name``); None before a pool was registered."""
        return self._cache_model

    def _mark_up(self) -> None:
        if not self._up.is_set():
            logger.info("event=backend_up backend=sidecar role=%s url=%s", self._role, self._settings.server_url)
        self._up.set()
        self._metrics.backend_up.set(1)

    def _fail(self, operation: str, reason: str, detail: str = "", client: Any = None) -> BackendError:
        """Record a failure, mark the backend down (unless it happened on ``client``, a connection
        already replaced) and return the error to raise."""
        self._metrics.error(operation, reason)
        with self._client_lock:
            if client is not None and client is not self._client:
                logger.debug("event=failure_on_replaced_connection operation=%s reason=%s", operation, reason)
                return BackendError(operation, reason, detail)
            if self._up.is_set():
                self._wake_heartbeat.set()
                logger.warning(
                    "event=backend_down backend=sidecar role=%s operation=%s reason=%s detail=%s",
                    self._role,
                    operation,
                    reason,
                    detail,
                )
            self._up.clear()
            self._pings_missed = 0
            self._metrics.backend_up.set(0)
            self._needs_reset = True
        return BackendError(operation, reason, detail)

    def _slow(self, operation: str, detail: str) -> BackendError:
        """A request on the engine's path outlived its deadline: that request fails (counted), the
        backend stays up. Slow is not dead: a dropped connection marks it down at once, and the
        heartbeat, woken now, marks it down if the server does not answer a PING either."""
        self._metrics.error(operation, "timeout")
        self._wake_heartbeat.set()
        logger.debug(
            "event=request_timeout backend=sidecar role=%s operation=%s detail=%s", self._role, operation, detail
        )
        return BackendError(operation, "timeout", detail)

    def _request_failed(self, operation: str, exc: BaseException, client: Any) -> BackendError:
        """A lookup or secure on ``client`` that raised: a timeout fails this request only
        (``_slow``); a dropped connection or a server error marks the backend down."""
        reason = failure_reason(exc)
        if reason == "timeout":
            return self._slow(operation, repr(exc))
        return self._fail(operation, reason, repr(exc), client)

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
            self._fail("heartbeat", failure_reason(exc), "server not reachable at start")
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
        if self._cache_model is None:
            raise BackendError("key", "unavailable", "no KV pool registered: the chunk layout is unknown")
        return IPCCacheServerKey(
            model_name=self._cache_model,
            world_size=self._settings.world_size,
            worker_id=(self._rank if rank is None else rank) if worker else None,
            token_ids=token_ids,
            start=start,
            end=end,
            request_id=session_id,
            cache_salt=salt,
            num_kv_readers=1,
        )

    # --- worker side ----------------------------------------------------------------
    def register(self, kv_pool: Any, geometry: KvGeometry) -> None:
        """Register the pool now; on failure the heartbeat keeps trying."""
        self._pool = kv_pool
        self._copies = TransferStream(kv_pool.device)
        self._store_copies = TransferStream(kv_pool.device)
        self._geometry = geometry
        self._block_bytes = int(kv_pool[0].numel() * kv_pool.element_size())
        layout = chunk_layout(kv_pool.dtype, self._settings.tokens_per_block, self._block_bytes)
        self._cache_model = cache_model_name(self._settings.model_name, layout)
        try:
            self._register_now()
        except Exception as exc:
            self._fail("register", failure_reason(exc), repr(exc))
            self._needs_register = True

    def _register_now(self) -> None:
        assert self._geometry is not None and self._instance_id is not None
        kv = {KV_POOL_NAME: self._pool}
        with self._lock:
            transfer = create_transfer_context(
                kv, instance_id=self._instance_id, req_client=self._client, mode=MPTransferMode.ENGINE_DRIVEN
            )
            transfer.register(
                kv,
                self._cache_model,
                self._settings.world_size,
                self._blocks_per_chunk,
                max(self._store_timeout_s, self._retrieve_timeout_s),
                layout_hints=self._geometry.layout_hints(),
                engine_type=EngineType.TRTLLM,
            )
            old, self._transfer = self._transfer, transfer
            old_identity, self._shm_identity = self._shm_identity, self._shm_of(transfer)
            self._needs_register = False
            self._registered.notify_all()
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
        name = shm_segment_name(transfer)
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
            raise self._slow(operation, "transfer context busy")  # another transfer holds it: not the server's fault
        transfer = self._transfer
        if transfer is None:
            self._lock.release()
            raise BackendError(operation, "unavailable", "KV pool not registered")
        return transfer

    def _retire(self, transfer: Any, identity: tuple[str, int] | None) -> None:
        """Keep a replaced transfer context mapped for a while (secured loads may still read it)."""
        with self._retired_lock:
            self._retired.append((transfer, identity, time.monotonic()))

    def _close_retired(self, older_than_s: float) -> None:
        with self._retired_lock:
            self._close_retired_locked(older_than_s)

    def _close_retired_locked(self, older_than_s: float) -> None:
        if self._async_outstanding or self._stores_copying:  # copies may still use a retired segment
            return
        now = time.monotonic()
        keep = []
        for transfer, identity, since in self._retired:
            if now - since < older_than_s or (identity is not None and self._secured_open[identity] > 0):
                keep.append((transfer, identity, since))
                continue
            try:
                transfer.close()
            except Exception:  # a view still exported: try again next time
                logger.debug("event=retired_close_failed segment=%s", identity, exc_info=True)
                keep.append((transfer, identity, since))
        self._retired = keep

    # --- deferred COMMIT ----------------------------------------------------------------
    def _commit_later(
        self, operation: str, key: IPCCacheServerKey, prepared_on: tuple[Any, tuple[str, int] | None] | None = None
    ) -> None:
        """Queue the COMMIT of a finished copy prepared on ``prepared_on`` (transfer context, segment;
        default: the current ones). It is sent to that segment's server, through whichever connection
        reaches it then, and dropped once that server is gone (``_commit_target``)."""
        chain = chain_of(key, self.chunk_size) if operation == "store" else None
        if prepared_on is None:
            with self._lock:
                prepared_on = (self._transfer, self._shm_identity)
        commit = DeferredCommit(operation, prepared_on[0], key, chain, prepared_on[1])
        PENDING_COMMITS.add(commit)
        self._commits.put(commit)

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
                PENDING_COMMITS.done(item)

    def _commit_now(self, item: DeferredCommit) -> None:
        """Send one COMMIT and wait for its answer, without holding the transfer lock meanwhile (the
        MQ client takes requests from any thread): lookups, secures and copies go on during it. A
        reset under it sends it again to the same server; it is dropped only once that server is gone."""
        for _attempt in range(_COMMIT_ATTEMPTS):
            transfer = self._commit_target(item)
            if transfer is None:
                self._commit_dropped(item)
                return
            edc = transfer.engine_driven_context
            start = time.perf_counter()
            try:
                ok = True
                if item.operation == "store":
                    ok = bool(edc.commit_store(item.key, self._instance_id, []))
                else:
                    edc.commit_retrieve(item.key, self._instance_id)  # releases the slots; the KV is already in
            except Exception as exc:
                with self._lock:
                    replaced = transfer is not self._transfer
                if replaced:  # the connection was reset under it: send it again where it belongs
                    continue
                self._fail(item.operation, failure_reason(exc), f"COMMIT: {exc!r}")
                return
            if not ok:
                self._metrics.error(item.operation, "server_error")
                logger.warning("event=commit_refused operation=%s session=%s", item.operation, item.key.request_id)
            elif item.operation == "store" and self._store_reports is not None:
                self._store_reports.report(self._client, item.key)
            logger.debug("event=commit_timing op=%s commit_ms=%.3f", item.operation,
                         (time.perf_counter() - start) * 1e3)  # fmt: skip
            return
        self._commit_dropped(item)

    def _commit_target(self, item: DeferredCommit) -> Any:
        """The transfer context to send ``item``'s COMMIT through: the one that prepared it while it
        is current; the current one where the context was replaced on the same server segment (a
        re-registration with the server that prepared it: without the COMMIT it would keep the
        reservation, and refuse to store those chunks again, for good); None once that server is gone.
        During a reset it waits for the next registration, which tells which. COMMITs name the
        instance and the key, not the connection."""
        if item.transfer is None and item.segment is None:
            return None
        with self._registered:
            wait_s = self._transfer_lost_at + _COMMIT_AWAITS_REGISTRATION_S - time.monotonic()
            self._registered.wait_for(lambda: self._transfer is not None or self._closing, timeout=max(0.0, wait_s))
            current, segment = self._transfer, self._shm_identity
        if current is None:
            return None
        if item.transfer is current or (item.segment is not None and item.segment == segment):
            return current
        return None

    def _commit_dropped(self, item: DeferredCommit) -> None:
        """Reconnected meanwhile: that server (and its reservation) is gone; a store is lost."""
        if item.operation == "store":
            self._metrics.error("store", "unavailable")
        logger.warning("event=commit_dropped operation=%s session=%s", item.operation, item.key.request_id)

    # --- heartbeat ----------------------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        while True:
            steady = self._up.is_set() and not self._pings_missed
            self._wake_heartbeat.wait(self._heartbeat_s if steady else min(self._heartbeat_s, _RECONNECT_S))
            self._wake_heartbeat.clear()
            if self._stop.is_set():
                return
            try:
                self._close_retired(_RETIRED_GRACE_S)
                self.heartbeat_once()
            except Exception:  # the thread must survive anything
                logger.exception("event=heartbeat_error backend=sidecar role=%s", self._role)

    def heartbeat_once(self) -> None:
        """PING; on success (re)register the pool when needed. A live connection's first missed PING
        only brings the next one forward (a busy server); the second in a row, or any other failure,
        marks the backend down, and the next call reconnects."""
        if self._needs_reset:
            self._reset_client()
        timeout_s = self._ping_timeout_s if self._up.is_set() else min(self._ping_timeout_s, _RECONNECT_PING_TIMEOUT_S)
        try:
            self._client.ping(self._instance_id).result(timeout=timeout_s)
        except Exception as exc:
            reason = failure_reason(exc)
            if self._up.is_set():
                self._pings_missed += 1
                if reason == "timeout" and self._pings_missed < _PINGS_MISSED_FOR_DOWN:
                    self._metrics.error("heartbeat", reason)
                    logger.info("event=ping_missed backend=sidecar role=%s missed=%d", self._role, self._pings_missed)
                    return
                self._fail("heartbeat", reason, repr(exc))
            self._needs_reset = True
            return
        self._pings_missed = 0
        if self._pool is not None and (self._needs_register or self._shm_replaced()):
            try:
                self._register_now()
            except Exception as exc:
                self._fail("register", failure_reason(exc), repr(exc))
                self._needs_register = True
                return
        self._mark_up()

    def _new_client(self) -> Any:
        client = RequestClientFactory.create(self._settings.server_url, context=self._zmq)
        fail_requests_on_disconnect(client, lambda: self._on_disconnect(client))
        return client

    def _on_disconnect(self, client: Any) -> None:
        """The server's connection dropped: down at once, so the next request fails fast instead of
        waiting out its timeout on a dead server, and reconnecting starts now."""
        if self._up.is_set() and not self._stop.is_set():  # not our own close; _fail ignores a replaced client
            self._fail("heartbeat", "unavailable", "the LMCache server's connection dropped", client)

    def _reset_client(self) -> None:
        """New socket; the old one's queued requests are dropped (LINGER 0)."""
        with self._lock:
            old, new = self._client, self._new_client()
            with self._client_lock:
                self._client = new
                self._needs_reset = False
            if self._pool is not None:
                self._needs_register = True
            transfer, self._transfer = self._transfer, None
            identity, self._shm_identity = self._shm_identity, None
            if transfer is not None:
                self._transfer_lost_at = time.monotonic()
        if transfer is not None:
            self._retire(transfer, identity)
        old.close()

    def close(self) -> None:
        """Send the queued COMMITs, stop the heartbeat, unregister and close the connection."""
        with self._registered:
            self._closing = True  # a COMMIT waiting for a registration gives up
            self._registered.notify_all()
        self._commits.put(None)
        self._committer.join(timeout=max(5.0, self._store_timeout_s))
        self._stop.set()
        self._wake_heartbeat.set()
        self._heartbeat.join(timeout=5)
        self._close_retired(0.0)
        with self._lock:
            transfer, self._transfer = self._transfer, None
        if self._pool is not None:
            self._store_copies.synchronize()  # a store's copies may still write into the segment
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
