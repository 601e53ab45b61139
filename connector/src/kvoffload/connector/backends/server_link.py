"""What the scheduler's client and each worker's backend share: the connection to the LMCache MP
server, the chunk size it answered at first contact, and the heartbeat thread.

The heartbeat PINGs (which also keeps the server's reaper from dropping a worker) every
``ServerConnection.heartbeat_s``; what one beat does is the role's (the worker registers its pool
again after a restart). A beat may also run on the caller's thread (``beat_once``): a load
catching up with a restarted server's segment, a test; never two at once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvoffload.connector.backends.connection import ServerConnection, failure_reason
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.settings import ConnectorSettings

logger = logging.getLogger("kvoffload.connector")

STARTUP_WAIT_S = 30.0
"""How long the first contact waits for the server when no chunk size is configured."""


def first_contact(settings: ConnectorSettings, connection: ServerConnection) -> int:
    """The chunk size to key and copy with: the server's, or the configured one if the server does
    not answer in time (then the connection starts down). Raises if neither is known, or if the
    server's is not a whole number of blocks."""
    wait_s = 2.0 if settings.chunk_size else STARTUP_WAIT_S
    try:
        server_chunk = int(connection.client.get_chunk_size().result(timeout=wait_s))
    except Exception as exc:
        if settings.chunk_size is None:
            raise RuntimeError(
                f"kvoffload connector: LMCache server at {settings.server_url} did not answer "
                f"within {wait_s:.0f}s and KVOFFLOAD_CHUNK_SIZE is unset"
            ) from exc
        connection.fail("heartbeat", failure_reason(exc), "server not reachable at start")
        return settings.chunk_size
    if settings.chunk_size and settings.chunk_size != server_chunk:
        logger.warning(
            "event=chunk_size_mismatch configured=%d server=%d using=server", settings.chunk_size, server_chunk
        )
    if server_chunk % settings.tokens_per_block != 0:
        raise RuntimeError(
            f"kvoffload connector: LMCache chunk_size={server_chunk} is not a multiple of "
            f"tokens_per_block={settings.tokens_per_block}"
        )
    connection.mark_up()
    return server_chunk


class ServerLink:
    """One role's connection (``connection``), its chunk size (``chunk_size``) and heartbeat."""

    def __init__(self, settings: ConnectorSettings, role: str, metrics: ConnectorMetrics) -> None:
        self._role = role
        self.connection = ServerConnection(settings, role, metrics)
        """The request client, up or down, PINGs."""
        self.chunk_size = first_contact(settings, self.connection)
        """Tokens per chunk, as the server keys them."""
        self._tick: Callable[[], None] = lambda: None
        self._between: Callable[[], None] = lambda: None
        self._lock = threading.Lock()  # the heartbeat thread and a caller's beat, one at a time
        self._thread = threading.Thread(target=self._loop, name=f"kvoffload-heartbeat-{role}", daemon=True)

    def start_heartbeat(self, tick: Callable[[], None], between: Callable[[], None] | None = None) -> None:
        """Call ``tick`` (the owner's ``heartbeat_once``) every heartbeat interval on the heartbeat
        thread, ``between`` before each (that thread only), until ``stop_heartbeat``."""
        self._tick = tick
        if between is not None:
            self._between = between
        self._thread.start()

    def beat_once(self, beat: Callable[[], None]) -> None:
        """Run one ``beat`` on the caller's thread; never two at once."""
        with self._lock:
            beat()

    def stop_heartbeat(self, timeout_s: float) -> None:
        """Stop the connection's waits and the heartbeat thread (within ``timeout_s``)."""
        self.connection.stop()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while self.connection.wait_for_next_ping():
            try:
                self._between()
                self._tick()
            except Exception:  # the thread must survive anything
                logger.exception("event=heartbeat_error backend=sidecar role=%s", self._role)
