"""The components' small stdlib HTTP servers (probes, ``/metrics``): one reply with status, body,
its type and length, and a server no peer can exhaust."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MAX_CONNECTIONS = 16
"""Connections served at once; probes and scrapes need one or two."""
CONNECTION_DEADLINE_S = 5.0
"""A connection is closed this long after it was accepted, answered or not."""


def send_reply(handler: BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    """Answer the request ``handler`` serves with ``body``."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class BoundedHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` with at most ``max_connections`` handler threads: when all are
    taken the oldest connection is closed to make room for the new one, and every connection is
    closed ``deadline_s`` after it was accepted (an idle or dribbling peer holds a thread for that
    long at most)."""

    daemon_threads = True
    request_queue_size = 64  # a burst waits in the backlog, to be refused or served at once

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        max_connections: int = MAX_CONNECTIONS,
        deadline_s: float = CONNECTION_DEADLINE_S,
    ) -> None:
        self.deadline_s = deadline_s
        self.refused = 0
        """Connections closed unanswered because no slot came free even after closing the oldest."""
        self._slots = threading.BoundedSemaphore(max_connections)
        self._deadlines: dict[Any, float] = {}
        self._deadlines_lock = threading.Lock()
        self._closed = threading.Event()
        super().__init__(address, handler)  # closes the server (server_close) when it cannot bind
        threading.Thread(target=self._close_late_connections, name="kvo-http-deadlines", daemon=True).start()

    def process_request(self, request: Any, client_address: Any) -> None:
        # Full: the oldest connection makes room, so a probe arriving behind idle peers is served.
        if not self._slots.acquire(blocking=False):
            self._close_oldest()
            if not self._slots.acquire(timeout=1.0):
                self.refused += 1
                self.shutdown_request(request)
                return
        request.settimeout(self.deadline_s)
        with self._deadlines_lock:
            self._deadlines[request] = time.monotonic() + self.deadline_s
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: Any) -> None:
        with self._deadlines_lock:
            self._deadlines.pop(request, None)
        self._slots.release()

    def _close_oldest(self) -> None:
        with self._deadlines_lock:
            oldest = min(self._deadlines, key=self._deadlines.__getitem__, default=None)
        if oldest is not None:
            with contextlib.suppress(OSError):
                oldest.shutdown(socket.SHUT_RDWR)

    def _close_late_connections(self) -> None:
        while not self._closed.wait(min(0.5, self.deadline_s / 4)):
            now = time.monotonic()
            with self._deadlines_lock:
                late = [r for r, deadline in self._deadlines.items() if deadline <= now]
            for request in late:
                with contextlib.suppress(OSError):
                    request.shutdown(socket.SHUT_RDWR)

    def server_close(self) -> None:
        self._closed.set()
        super().server_close()
