"""The sidecar's port (pod IP) under idle peers: bounded threads, and the kubelet's probe still answered."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from hack.ports import free_port
from kvoffload import contract
from kvoffload.httpreply import MAX_CONNECTIONS
from kvoffload.sidecar.endpoints import start_endpoints
from kvoffload.sidecar.lifecycle import HealthVerdict
from kvoffload.sidecar.metrics import SidecarMetricsState

pytestmark = pytest.mark.sidecar


class _Healthy:
    def verdict(self) -> HealthVerdict:
        return HealthVerdict(started=True, ready=True, live=True, reason="serving")

    def metrics_state(self) -> SidecarMetricsState:
        raise NotImplementedError

    def lmcache_metrics_text(self) -> str | None:
        return None


def test_a_probe_behind_many_idle_connections_is_answered_and_threads_stay_bounded() -> None:
    port = free_port()
    before = threading.active_count()
    server = start_endpoints(_Healthy(), port, None, host="127.0.0.1")
    held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        assert threading.active_count() - before <= MAX_CONNECTIONS + 2  # + the accept loop and the reaper
        started = time.monotonic()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{contract.PATH_LIVE}", timeout=3) as reply:
            assert reply.status == 200 and reply.read() == b"ok: serving\n"
        assert time.monotonic() - started < 1.5
    finally:
        for sock in held:
            sock.close()
        server.shutdown()
        server.server_close()
