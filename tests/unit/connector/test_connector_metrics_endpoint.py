"""Without a sidecar the connector serves the pod's /metrics: one process binds, others take over."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
import textwrap
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from hack.ports import free_port
from kvoffload import contract
from kvoffload.connector.metrics_endpoint import MetricsEndpoint, render_connector_metrics
from kvoffload.connector.settings import SettingsError, parse_settings
from kvoffload.httpreply import CONNECTION_DEADLINE_S, MAX_CONNECTIONS

pytestmark = pytest.mark.connector
REPO = Path(__file__).resolve().parents[3]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{contract.PATH_METRICS}", timeout=5) as r:
        return r.read().decode()


def test_one_process_binds_the_port_and_another_takes_over_when_it_goes() -> None:
    port = free_port()
    first = MetricsEndpoint(port, lambda: b"first 1\n", host="127.0.0.1")
    second = MetricsEndpoint(port, lambda: b"second 1\n", host="127.0.0.1")
    try:
        assert first.try_serve() and first.serving
        assert not second.try_serve() and not second.serving, "the port is taken: the second only writes files"
        assert scrape(port) == "first 1\n"
        first.close()
        assert second.try_serve()
        assert scrape(port) == "second 1\n"
    finally:
        first.close()
        second.close()


def test_a_failing_render_answers_500_and_keeps_serving() -> None:
    port = free_port()
    calls: list[int] = []

    def body() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return b"ok 1\n"

    endpoint = MetricsEndpoint(port, body, host="127.0.0.1")
    try:
        assert endpoint.try_serve()
        with pytest.raises(urllib.error.HTTPError, match="500"):
            scrape(port)
        assert scrape(port) == "ok 1\n"
    finally:
        endpoint.close()


WRITER = textwrap.dedent(
    """
    import os, sys
    from kvoffload.connector.metrics import ProcessMetrics
    process = ProcessMetrics()
    m = process.get("model-a", "inprocess", True, directory=os.environ["PROMETHEUS_MULTIPROC_DIR"])
    m.record_lookup(0.001, 256, 128)
    m.backend_up.set(1)
    process.flush_all()
    if sys.argv[1] == "hold":
        print("ready", flush=True)
        sys.stdin.readline()
    """
)


def test_every_writers_series_are_served_and_a_dead_writers_live_gauges_dropped(tmp_path: Path) -> None:
    pythonpath = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])  # the caller's tree too
    env = {**os.environ, contract.ENV_PROMETHEUS_MULTIPROC_DIR: str(tmp_path), "PYTHONPATH": pythonpath}
    subprocess.run([sys.executable, "-c", WRITER, "exit"], env=env, check=True, timeout=60)
    alive = subprocess.Popen([sys.executable, "-c", WRITER, "hold"], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert alive.stdout is not None and alive.stdout.readline().strip() == "ready"
        locks = sorted(p.name for p in tmp_path.glob("live_*.lock"))
        assert len(locks) == 2, "each writer takes its liveness lock"
        text = render_connector_metrics(str(tmp_path), []).decode()
        assert f'{contract.M_LOOKUP_REQUESTS}_total{{backend="inprocess",model="model-a"}} 2.0' in text
        assert f'{contract.M_BACKEND_UP}{{backend="inprocess",model="model-a"}} 1.0' in text
        live_gauges = sorted(p.name for p in tmp_path.glob("gauge_live*.db"))
        assert live_gauges == [f"gauge_livemin_{alive.pid}.db"], "the dead writer's live gauge file is removed"
        assert len(list(tmp_path.glob("counter_*.db"))) == 2, "its counters stay: they are part of the totals"
    finally:
        assert alive.stdin is not None
        alive.stdin.write("\n")
        alive.stdin.close()
        alive.wait(timeout=30)


@pytest.mark.parametrize("raw", ["0", "70000", "nine"])
def test_a_bad_metrics_port_is_refused_naming_the_variable(raw: str) -> None:
    env = {contract.ENV_MODEL_NAME: "m", contract.ENV_METRICS_PORT: raw}
    with pytest.raises(SettingsError, match=contract.ENV_METRICS_PORT):
        parse_settings(env, None)


def _hold_idle_connections(port: int, count: int) -> list[socket.socket]:
    held = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        held.append(sock)
    return held


def _open_ones(held: list[socket.socket]) -> list[socket.socket]:
    """The connections the server has not closed (a closed one reads as end of file at once). Polled,
    not ``select``ed: in a long test session these sockets' descriptors may lie past 1024."""
    poller = select.poll()
    by_fd = {s.fileno(): s for s in held}
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    readable = [by_fd[fd] for fd, _events in poller.poll(0)]
    closed = {s for s in readable if s.recv(1, socket.MSG_PEEK) == b""}
    return [s for s in held if s not in closed]


def test_idle_connections_cost_the_engine_a_bounded_number_of_threads_and_are_closed_after_the_deadline() -> None:
    port = free_port()
    endpoint = MetricsEndpoint(port, lambda: b"m 1\n", host="127.0.0.1")
    assert endpoint.try_serve()
    before = threading.active_count()
    held = _hold_idle_connections(port, 150)
    try:
        time.sleep(0.5)
        assert threading.active_count() - before <= MAX_CONNECTIONS, "one thread per idle connection"
        deadline = time.monotonic() + CONNECTION_DEADLINE_S + 3
        while _open_ones(held) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _open_ones(held), "idle connections outlive the deadline"
        assert scrape(port) == "m 1\n"
    finally:
        for sock in held:
            sock.close()
        endpoint.close()
