"""The pod's connector ``/metrics`` where no sidecar serves them (node mode, in-process backend).

TensorRT-LLM runs one process per rank; each writes its series to ``PROMETHEUS_MULTIPROC_DIR``.
Whichever process binds ``KVOFFLOAD_METRICS_PORT`` first serves every process's files; the
others retry now and then, so another takes over when the serving one exits.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from http.server import BaseHTTPRequestHandler
from typing import Any

from kvoffload import contract
from kvoffload.httpreply import BoundedHTTPServer, send_reply

log = logging.getLogger(__name__)


def render_connector_metrics(directory: str | None, registries: Iterable[Any]) -> bytes:
    """Every writer's files in ``directory`` (multiprocess mode), else this process's registries."""
    from prometheus_client import generate_latest

    from kvoffload.multiproc import render_multiprocess

    if directory:
        return render_multiprocess(directory)
    return b"".join(generate_latest(registry) for registry in registries)


class MetricsEndpoint:
    """An HTTP server on ``port`` answering ``GET /metrics``, if this process can bind it (a bounded
    one: it runs inside the engine process)."""

    def __init__(self, port: int, body: Callable[[], bytes], host: str = "0.0.0.0") -> None:
        self.port = port
        self._host = host
        self._body = body
        self._server: BoundedHTTPServer | None = None
        self._lock = threading.Lock()

    @property
    def serving(self) -> bool:
        return self._server is not None

    def try_serve(self) -> bool:
        """Bind and serve in a daemon thread; False while another process holds the port."""
        with self._lock:
            if self._server is not None:
                return True
            from kvoffload.multiproc import CONTENT_TYPE

            body = self._body

            class Handler(BaseHTTPRequestHandler):
                def do_GET(self) -> None:
                    if self.path.split("?")[0] != contract.PATH_METRICS:
                        self.send_error(404)
                        return
                    try:
                        payload, status = body(), 200
                    except Exception as exc:  # a scrape must never take the engine down
                        log.warning("event=metrics_render_failed error=%r", exc)
                        payload, status = b"", 500
                    send_reply(self, status, payload, CONTENT_TYPE)

                def log_message(self, format: str, *args: Any) -> None:
                    return

            try:
                server = BoundedHTTPServer((self._host, self.port), Handler)
            except OSError:
                return False
            threading.Thread(target=server.serve_forever, name="kvoffload-metrics-http", daemon=True).start()
            self._server = server
            log.info("event=metrics_endpoint_serving port=%d pid=%d", self.port, os.getpid())
            return True

    def close(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.shutdown()
                self._server.server_close()
                self._server = None
