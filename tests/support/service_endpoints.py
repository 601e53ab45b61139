"""A Service in front of several operator webhooks on 127.0.0.1, as kube-proxy spreads connections
over a Service's endpoints: each connection goes to the next backend, one that refuses (a stopped
pod, an endpoint gone) is skipped. TLS passes through untouched (the replicas share the Secret)."""

from __future__ import annotations

import contextlib
import socket
import threading
from dataclasses import dataclass, field

CONNECT_TIMEOUT_S = 2.0


@dataclass
class RoundRobinService:
    """Listens on 127.0.0.1:``port``; ``backends`` (ports) may change while it runs."""

    backends: list[int]
    port: int = 0
    _listener: socket.socket | None = None
    _next: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> RoundRobinService:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="service-accept", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()

    def _pick(self) -> socket.socket | None:
        with self._lock:
            backends = list(self.backends)
            start, self._next = self._next, self._next + 1
        for i in range(len(backends)):
            with contextlib.suppress(OSError):
                return socket.create_connection(("127.0.0.1", backends[(start + i) % len(backends)]),
                                                timeout=CONNECT_TIMEOUT_S)  # fmt: skip
        return None

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        backend = self._pick()
        if backend is None:
            client.close()
            return
        backend.settimeout(None)
        pairs = ((client, backend), (backend, client))
        pipes = [threading.Thread(target=_pipe, args=pair, daemon=True) for pair in pairs]
        for pipe in pipes:
            pipe.start()
        for pipe in pipes:
            pipe.join()
        client.close()
        backend.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy until ``source`` ends, then end ``sink``'s writing side."""
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
