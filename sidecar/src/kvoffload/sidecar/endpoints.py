"""The sidecar's HTTP port (pod IP): kubelet probes and the pod's one ``/metrics``.

Named ``endpoints`` rather than ``http`` so running a file from this folder can never
shadow the standard library's ``http`` package.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler
from typing import Protocol

from kvoffload import contract
from kvoffload.httpreply import BoundedHTTPServer, send_reply
from kvoffload.multiproc import CONTENT_TYPE

from .lifecycle import HealthVerdict
from .metrics import SidecarMetricsState, render_pod_metrics

log = logging.getLogger(__name__)


class HealthSource(Protocol):
    """What the endpoints need from the supervisor."""

    def verdict(self) -> HealthVerdict: ...

    def metrics_state(self) -> SidecarMetricsState: ...

    def lmcache_metrics_text(self) -> str | None: ...


class _Handler(BaseHTTPRequestHandler):
    server_version = "kvoffload-sidecar"
    source: HealthSource
    multiproc_dir: str | None

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == contract.PATH_METRICS:
            try:
                body = render_pod_metrics(
                    self.source.metrics_state, self.multiproc_dir, self.source.lmcache_metrics_text()
                )
            except Exception as exc:  # a broken metrics file must not take the endpoint down
                log.exception("event=metrics_render_failed")
                self._reply(500, f"metrics unavailable: {exc}\n".encode(), "text/plain")
                return
            self._reply(200, body, CONTENT_TYPE)
            return
        probes = {
            contract.PATH_STARTUP: lambda v: v.started,
            contract.PATH_READY: lambda v: v.ready,
            contract.PATH_LIVE: lambda v: v.live,
        }
        if path in probes:
            verdict = self.source.verdict()
            ok = probes[path](verdict)
            self._reply(200 if ok else 503, f"{'ok' if ok else 'fail'}: {verdict.reason}\n".encode(), "text/plain")
            return
        self._reply(404, b"not found\n", "text/plain")

    def _reply(self, status: int, body: bytes, content_type: str) -> None:
        send_reply(self, status, body, content_type)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("event=http_request " + format, *args)


def start_endpoints(
    source: HealthSource, port: int, multiproc_dir: str | None, host: str = "0.0.0.0"
) -> BoundedHTTPServer:
    """Serve probes and ``/metrics`` on ``host:port`` from a daemon thread; returns the server."""
    handler = type("SidecarHandler", (_Handler,), {"source": source, "multiproc_dir": multiproc_dir})
    server = BoundedHTTPServer((host, port), handler)
    threading.Thread(target=server.serve_forever, name="kvo-endpoints", daemon=True).start()
    return server
