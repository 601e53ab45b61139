"""The connection to an LMCache MP server: its request client, whether it is up, failures, PINGs.

One request client at a time. A failed call marks the connection down (calls then fail at once
and nothing waits); the heartbeat PINGs, and while down it replaces the client with a fresh socket
until the server answers again. A failure on a client already replaced is only counted: a late
error from a dead server must not take the new connection down.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from kvoffload import contract
from kvoffload.cache_keys import ClientKeys
from kvoffload.connector.backends.base import BackendError
from kvoffload.connector.lmcache_seam import RequestClientFactory, ServerDisconnected, fail_requests_on_disconnect
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.settings import ConnectorSettings

logger = logging.getLogger("kvoffload.connector")

MIN_PING_TIMEOUT_S = 2.0
RECONNECT_S = 0.25
"""While the server is down the heartbeat tries this often, each time on a fresh socket, so a
restarted server is found within about this long of its start (not a heartbeat interval or two)."""
PINGS_MISSED_FOR_DOWN = 2
"""PINGs in a row a live connection may leave unanswered before it is down: one missed PING is a
busy server (the next goes ``RECONNECT_S`` later); a dropped connection is down at once."""
RECONNECT_PING_TIMEOUT_S = 1.0
"""A PING to a server believed down: a restarted one answers a fresh socket in milliseconds."""


def failure_reason(exc: BaseException) -> str:
    """The bounded metric label of a failed call."""
    if isinstance(exc, ServerDisconnected):
        return "unavailable"
    return "timeout" if isinstance(exc, TimeoutError) else "server_error"


def authenticate_as_client(context: zmq.Context[Any], keys: ClientKeys) -> None:
    """Make every socket ``context`` creates from now on a CURVE client with ``keys`` (context-level
    options apply to each new socket, so every reconnect's fresh socket authenticates too)."""
    context.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public.encode("ascii"))
    context.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode("ascii"))
    context.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode("ascii"))


class ServerConnection:
    """One process's connection to an LMCache MP server, for one role (``scheduler`` or ``worker``)."""

    def __init__(self, settings: ConnectorSettings, role: str, metrics: ConnectorMetrics) -> None:
        self._url = settings.server_url
        self._role = role
        self._metrics = metrics
        # At least every MAX_PING_INTERVAL_S: the server reaps a worker silent for WORKER_SILENCE_LIMIT_S.
        self.heartbeat_s = min(settings.heartbeat_interval_ms / 1000.0, contract.MAX_PING_INTERVAL_S)
        # PINGs run on the heartbeat thread, never on the engine's path: a busy-but-alive server
        # gets a generous answer window before it is declared down.
        self.ping_timeout_s = max(MIN_PING_TIMEOUT_S, self.heartbeat_s)
        self._zmq = zmq.Context()
        # Drop queued requests when a socket closes: a restarted server must never
        # receive PREPARE/LOOKUP messages that were meant for its predecessor.
        self._zmq.setsockopt(zmq.LINGER, 0)
        if settings.cache_keys is not None:  # node mode: the policy's node cache admits only its client key
            authenticate_as_client(self._zmq, settings.cache_keys)
        self._stop = threading.Event()
        self._up = threading.Event()  # these before the client: its disconnect callback reads them
        self._pings_missed = 0  # in a row, while up (heartbeat thread)
        self._client_lock = threading.Lock()
        """Held while the client is replaced and while a failure marks it down."""
        self._wake = threading.Event()
        """Set when the connection goes down (or closes): reconnecting starts at once, not at the next tick."""
        self._needs_reset = False
        self.generation = 0
        """How many times the client was replaced (a new socket after the connection went down)."""
        self.client: Any = self._new_client()

    # --- state ----------------------------------------------------------------------
    def is_up(self) -> bool:
        """Whether the last contact with the server succeeded."""
        return self._up.is_set()

    @property
    def needs_reset(self) -> bool:
        """Whether the client must be replaced before the next PING (it went down)."""
        return self._needs_reset

    @property
    def steady(self) -> bool:
        """Up, and no PING missed: the heartbeat keeps its normal interval."""
        return self._up.is_set() and not self._pings_missed

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def mark_up(self) -> None:
        if not self._up.is_set():
            logger.info("event=backend_up backend=sidecar role=%s url=%s", self._role, self._url)
        self._up.set()
        self._metrics.backend_up.set(1)

    def fail(self, operation: str, reason: str, detail: str = "", client: Any = None) -> BackendError:
        """Record a failure, mark the connection down (unless it happened on ``client``, a client
        already replaced) and return the error to raise."""
        self._metrics.error(operation, reason)
        with self._client_lock:
            if client is not None and client is not self.client:
                logger.debug("event=failure_on_replaced_connection operation=%s reason=%s", operation, reason)
                return BackendError(operation, reason, detail)
            if self._up.is_set():
                self._wake.set()
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

    def slow(self, operation: str, detail: str) -> BackendError:
        """A request on the engine's path outlived its deadline: that request fails (counted), the
        connection stays up. Slow is not dead: a dropped connection marks it down at once, and the
        heartbeat, woken now, marks it down if the server does not answer a PING either."""
        self._metrics.error(operation, "timeout")
        self._wake.set()
        logger.debug(
            "event=request_timeout backend=sidecar role=%s operation=%s detail=%s", self._role, operation, detail
        )
        return BackendError(operation, "timeout", detail)

    def request_failed(self, operation: str, exc: BaseException, client: Any) -> BackendError:
        """A request on ``client`` that raised: a timeout fails this request only (``slow``); a
        dropped connection or a server error marks the connection down."""
        reason = failure_reason(exc)
        if reason == "timeout":
            return self.slow(operation, repr(exc))
        return self.fail(operation, reason, repr(exc), client)

    # --- heartbeat ------------------------------------------------------------------
    def wait_for_next_ping(self) -> bool:
        """Sleep until the next PING is due (sooner while down or after a missed PING, at once when
        woken); False once the connection is closing."""
        self._wake.wait(self.heartbeat_s if self.steady else min(self.heartbeat_s, RECONNECT_S))
        self._wake.clear()
        return not self._stop.is_set()

    def ping(self, instance_id: int | None) -> bool:
        """PING the server. A live connection's first missed PING only brings the next one forward
        (a busy server); the second in a row, or any other failure, marks it down (the caller then
        replaces the client). True: the server answered."""
        timeout_s = self.ping_timeout_s if self._up.is_set() else min(self.ping_timeout_s, RECONNECT_PING_TIMEOUT_S)
        try:
            self.client.ping(instance_id).result(timeout=timeout_s)
        except Exception as exc:
            reason = failure_reason(exc)
            if self._up.is_set():
                self._pings_missed += 1
                if reason == "timeout" and self._pings_missed < PINGS_MISSED_FOR_DOWN:
                    self._metrics.error("heartbeat", reason)
                    logger.info("event=ping_missed backend=sidecar role=%s missed=%d", self._role, self._pings_missed)
                    return False
                self.fail("heartbeat", reason, repr(exc))
            self._needs_reset = True
            return False
        self._pings_missed = 0
        return True

    def replace_client(self) -> Any:
        """A fresh socket for the next requests; returns the old client, for the caller to close once
        nothing can use it (its queued requests are dropped: LINGER 0)."""
        old, new = self.client, self._new_client()
        with self._client_lock:
            self.client = new
            self._needs_reset = False
            self.generation += 1
        return old

    def _new_client(self) -> Any:
        client = RequestClientFactory.create(self._url, context=self._zmq)
        fail_requests_on_disconnect(client, lambda: self._on_disconnect(client))
        return client

    def _on_disconnect(self, client: Any) -> None:
        """The server's connection dropped: down at once, so the next request fails fast instead of
        waiting out its timeout on a dead server, and reconnecting starts now."""
        if self._up.is_set() and not self._stop.is_set():  # not our own close; fail ignores a replaced client
            self.fail("heartbeat", "unavailable", "the LMCache server's connection dropped", client)

    def stop(self) -> None:
        """No more PINGs (the heartbeat thread ends at its next wake-up, which comes now)."""
        self._stop.set()
        self._wake.set()

    def close(self) -> None:
        """Close the client and the zmq context made for it (its descriptors and I/O thread go too)."""
        self.client.close()
        self._zmq.destroy(linger=0)
