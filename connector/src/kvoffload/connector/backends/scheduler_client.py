"""The scheduler's client of the LMCache MP server: lookups, their locks, sessions, and the loads
it secures through rank 0's worker backend in this engine process.

TensorRT-LLM runs the scheduler in rank 0's process. PREPARE_RETRIEVE must come from a registered
worker instance, so the scheduler secures and releases loads through that worker's backend
(``EngineProcess.worker``), and keys its lookups with the chunk layout of the pool it registered.
Every call has its own timeout; while the connection is down lookups fail at once (a miss) and
nothing waits. The worker's side is :mod:`.worker_backend`; the two share only the parts in
:mod:`.server_link` and :mod:`.engine_process`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kvoffload import secured_lookup
from kvoffload.connector.backends.abandoned_lookups import AbandonedLookups
from kvoffload.connector.backends.base import BackendError
from kvoffload.connector.backends.chunk_keys import ChunkKeys
from kvoffload.connector.backends.commits import chain_of
from kvoffload.connector.backends.engine_process import EngineProcess, LocalWorker
from kvoffload.connector.backends.securing import PrefetchStillRunning, SecuredHit, SecuredLookupFailed
from kvoffload.connector.backends.server_link import ServerLink
from kvoffload.connector.layout import GroupedLayout
from kvoffload.connector.lmcache_seam import IPCCacheServerKey, ServerModuleCallRequest
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.settings import ConnectorSettings
from kvoffload.connector.wire import SecuredLoad

logger = logging.getLogger("kvoffload.connector")

PROBE_TIMEOUT_S = 2.0
"""How long the heartbeat waits for a server to say it has secured lookups (a server without any
server module never answers the call)."""


class SchedulerClient:
    """The scheduler's lookups, lookup locks and sessions on an LMCache MP server, and the loads it
    secures through this process's rank 0 worker."""

    def __init__(self, settings: ConnectorSettings, *, metrics: ConnectorMetrics, process: EngineProcess) -> None:
        self._url = settings.server_url
        self._process = process
        self._lookup_timeout_s = settings.lookup_timeout_ms / 1000.0
        self._link = ServerLink(settings, "scheduler", metrics)
        self.connection = self._link.connection
        """The request client, up or down, PINGs."""
        self.chunk_size = self._link.chunk_size
        self.abandoned_lookups = AbandonedLookups(self.connection, metrics)
        """Lookups answered too late, whose server prefetch is settled before the session's next lookup and at its end."""
        self._metrics = metrics
        self._one_call: tuple[int, bool] = (-1, False)
        """(connection generation, whether that server looks up and secures in one call)."""
        self._link.start_heartbeat(lambda: self.heartbeat_once())  # looked up at each beat, as the worker does
        # The first beat comes a heartbeat interval from now; the server is asked at once, aside.
        threading.Thread(target=self._link.beat_once, args=(self._ask_for_one_call,), daemon=True,
                         name="kvoffload-secured-lookups").start()  # fmt: skip

    def is_up(self) -> bool:
        """Whether the last contact with the server succeeded."""
        return self.connection.is_up()

    @property
    def connection_generation(self) -> int:
        """How many times the connection was replaced by a fresh one (it went down)."""
        return self.connection.generation

    def heartbeat_once(self) -> None:
        """One heartbeat on the caller's thread; never two at once (``ServerLink.beat_once``)."""
        self._link.beat_once(self._beat)

    def stop_heartbeat(self) -> None:
        """Stop the heartbeat thread: from then on only ``heartbeat_once`` PINGs (tests drive it by hand)."""
        self._link.stop_heartbeat(10)

    def _beat(self) -> None:
        """PING (``ServerConnection.ping``); a connection that went down is replaced first."""
        if self.connection.needs_reset:
            self.connection.replace_client().close()
        if self.connection.ping(None):
            self.connection.mark_up()
            self._ask_for_one_call()

    def _ask_for_one_call(self) -> None:
        """Once per connection, off the engine's path: whether the server has secured lookups
        (``kvoffload.secured_lookup``: the sidecar's server and the in-process one do)."""
        generation = self.connection.generation
        if self._one_call[0] == generation:
            return
        request = ServerModuleCallRequest(method=secured_lookup.METHOD, payload=secured_lookup.PROBE)
        try:
            response = self.connection.client.server_module_call(request).result(timeout=PROBE_TIMEOUT_S)
            has_it = bool(response.success) and response.payload == secured_lookup.PROBE_ANSWER
        except Exception:  # no answer: a server without server modules
            has_it = False
        self._one_call = (generation, has_it)
        logger.info("event=secured_lookups backend=sidecar available=%s", has_it)

    @property
    def looks_up_in_one_call(self) -> bool:
        """Whether lookups and their securing go to this server in one call (``lookup_and_secure``)."""
        return self._one_call == (self.connection.generation, True)

    def close(self) -> None:
        """Settle abandoned lookups, stop the heartbeat and close the connection."""
        self.abandoned_lookups.close(timeout_s=5.0)
        self._link.stop_heartbeat(5)
        self.connection.close()

    def _local_worker(self) -> LocalWorker | None:
        return self._process.worker(self._url)

    def layer_groups(self) -> GroupedLayout | None:
        """The layer groups the worker of this process registered (None: one pool, or none yet)."""
        local = self._local_worker()
        return local.grouped_layout if local is not None else None

    def lookup(self, session_id: str, token_ids: tuple[int, ...], end: int, salt: str) -> int:
        """Chunk-aligned hit prefix (tokens) of ``token_ids[:end]``; LMCache read-locks those chunks."""
        key, client, deadline = self._ready_to_look_up(session_id, token_ids, end, salt)
        sent = False
        try:
            self._settle_abandoned(client, session_id, deadline)
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

    def lookup_and_secure(
        self, session_id: str, token_ids: tuple[int, ...], end: int, salt: str, start: int, cap: int
    ) -> SecuredHit | None:
        """``lookup`` of ``token_ids[:end]`` and ``secure`` of ``[start, min(hit, cap))`` in one server
        call, every lookup lock of the hit settled by the server (``Securing.lookup_and_prepare``).
        None: the server cannot (the caller calls ``lookup``, then ``secure``)."""
        local = self._local_worker()
        if local is None or not self.looks_up_in_one_call:
            return None
        key, client, deadline = self._ready_to_look_up(session_id, token_ids, end, salt)
        try:
            self._settle_abandoned(client, session_id, deadline)
            return local.lookup_and_secure(client, key, start, cap, max(0.0, deadline - time.monotonic()), deadline)
        except BackendError:
            raise
        except PrefetchStillRunning:  # a miss now, its locks settled later
            self.abandoned_lookups.abandoned(session_id, key)
            raise self.connection.slow("lookup", "prefetch outlived the lookup timeout") from None
        except SecuredLookupFailed as exc:  # a miss; this server's lookups go apart from now on
            self._one_call = (self._one_call[0], False)
            self._metrics.error("lookup", "server_error")
            logger.warning("event=secured_lookup_failed detail=%r", str(exc))
            raise BackendError("lookup", "server_error", str(exc)) from None
        except Exception as exc:
            raise self.connection.request_failed("lookup", exc, client) from exc

    def _ready_to_look_up(
        self, session_id: str, token_ids: tuple[int, ...], end: int, salt: str
    ) -> tuple[IPCCacheServerKey, Any, float]:
        """The lookup key of ``token_ids[:end]``, the client and the lookup's deadline, once this
        process's own stores on the prompt's chain were answered (at most one lookup timeout: other
        requests' COMMITs cannot change the answer)."""
        if not self.connection.is_up():
            raise BackendError("lookup", "unavailable")
        key = self._lookup_keys().key(session_id, token_ids, 0, end, salt, worker=False)
        self._process.pending.wait_chain(chain_of(key, self.chunk_size), self._lookup_timeout_s)
        return key, self.connection.client, time.monotonic() + self._lookup_timeout_s

    def _settle_abandoned(self, client: Any, session_id: str, deadline: float) -> None:
        """Settle the session's lookup answered too late, if any (its locks go); while its prefetch
        still runs no new LOOKUP goes (it would replace that job): a miss now."""
        if not self.abandoned_lookups.settle(client, session_id, deadline - time.monotonic()):
            raise self.connection.slow("lookup", "the session's previous prefetch still runs")

    def _lookup_keys(self) -> ChunkKeys:
        """The chunk keys of rank 0's worker in this process (TensorRT-LLM runs the scheduler there):
        lookups are keyed with the layout of the pool it registered; without one nothing is looked
        up, as nothing could be loaded."""
        local = self._local_worker()
        if local is None or local.chunk_keys.model is None:
            raise BackendError("lookup", "unavailable", "no worker in this process registered its KV pool")
        return local.chunk_keys

    def free_lookup_locks(
        self, session_id: str, token_ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...], salt: str
    ) -> None:
        """Release lookup read locks on chunk ranges that will not be retrieved (after the session's
        queued COMMITs, as the server would see synchronous ones)."""
        self._process.pending.wait_session(session_id, self._lookup_timeout_s)
        if not self.connection.is_up():
            return
        keys = self._lookup_keys()
        for start, end in ranges:
            key = keys.key(session_id, token_ids, start, end, salt, worker=False)
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
        local = self._local_worker()
        return local.prepare_secured(session_id, token_ids, start, end, salt) if local is not None else None

    def release_secured(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str, secured: SecuredLoad
    ) -> None:
        """Give back a secured load that will never be copied (its request ended first)."""
        local = self._local_worker()
        if local is not None:
            local.commit_secured(session_id, token_ids, start, end, salt, secured.segment)

    def park_load(self, request_id: int, llm_request: object, blocks: frozenset[int]) -> None:
        """A parked request's asynchronous load writes ``blocks`` (the worker lands it if TensorRT-LLM cancels the request)."""
        self._process.parked_loads(self._url).track(request_id, llm_request, blocks)

    def unpark_load(self, request_id: int) -> None:
        """The request is back from its load, or gone."""
        self._process.parked_loads(self._url).untrack(request_id)

    def note_saving(self, request_id: int, llm_request: object) -> None:
        """The request has saves planned (the worker ends them if TensorRT-LLM cancels the request)."""
        self._process.saving_requests(self._url).track(request_id, llm_request)

    def forget_saving(self, request_id: int) -> None:
        """The request ended through ``request_finished``, or its state went."""
        self._process.saving_requests(self._url).untrack(request_id)
