"""The operator's own listeners (``/metrics`` and kopf's ``/healthz``, open to every address and in
the webhook's process) against idle peers: the real operator process (``tests/support/
operator_listeners.py``), 5,000 TCP connections that send nothing held on each port while both
still answer; the process's threads and memory as the kernel reports them."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvoffload import contract as c
from kvoffload.httpreply import CONNECTION_DEADLINE_S, MAX_CONNECTIONS
from tests.support.operator_listeners import OperatorListeners, idle_connections, operator_listeners

pytestmark = [pytest.mark.operator, pytest.mark.reliability]
IDLE = 5000
MAX_EXTRA_THREADS = MAX_CONNECTIONS + 2
"""The bounded server's handler threads (and slack for one finishing as another starts): nothing
per connection."""
MAX_RSS_GROWTH_KIB = 64 * 1024


@pytest.fixture(scope="module")
def operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorListeners]:
    with operator_listeners(tmp_path_factory.mktemp("operator-listeners")) as proc:
        yield proc


def _settled(operator: OperatorListeners, timeout: float = 20.0) -> int:
    """The process's thread count once it has not changed for a second (what an earlier case left
    closing is gone)."""
    deadline, last, since = time.monotonic() + timeout, operator.status("Threads"), time.monotonic()
    while time.monotonic() - since < 1.0 and time.monotonic() < deadline:
        time.sleep(0.2)
        if (now := operator.status("Threads")) != last:
            last, since = now, time.monotonic()
    return last


def _answers(operator: OperatorListeners) -> None:
    status, body = operator.get(operator.metrics_port, c.PATH_METRICS, timeout=CONNECTION_DEADLINE_S)
    assert status == 200 and c.M_OPERATOR_RECONCILES.encode() in body, body[:200]
    status, _ = operator.get(operator.health_port, "/healthz", timeout=CONNECTION_DEADLINE_S)
    assert status == 200


@pytest.mark.parametrize("port", ["metrics", "health"])
def test_5000_idle_connections_leave_threads_and_memory_bounded_and_both_ports_answering(
    operator: OperatorListeners, port: str
) -> None:
    target = operator.metrics_port if port == "metrics" else operator.health_port
    threads, rss = _settled(operator), operator.status("VmRSS")
    held = idle_connections(target, IDLE)
    try:
        time.sleep(1.0)  # every connection accepted and waiting
        threads_held, rss_held = operator.status("Threads"), operator.status("VmRSS")
        began = time.monotonic()
        _answers(operator)
        took = time.monotonic() - began
    finally:
        for sock in held:
            sock.close()
    print(f"\n{port} port, {IDLE} idle connections: threads {threads} -> {threads_held}, RSS {rss // 1024} -> "
          f"{rss_held // 1024} MiB; /metrics and /healthz answered in {took * 1000:.0f} ms")  # fmt: skip
    assert threads_held - threads <= MAX_EXTRA_THREADS, (threads, threads_held)
    assert rss_held - rss < MAX_RSS_GROWTH_KIB, (rss, rss_held)
