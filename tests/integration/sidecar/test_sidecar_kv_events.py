"""The real sidecar with KV events on: its LMCache server, cold-started or forked by the warm
standby after a crash, publishes on the events port, and greets every subscriber with a clear."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

import msgspec
import pytest
import zmq

from hack.localpod import http_get
from hack.ports import free_port
from kvoffload import contract
from tests.support.sidecar_harness import Sidecar, metric_value, wait_for

pytestmark = pytest.mark.sidecar


def first_batch(endpoint: str, timeout_s: float = 30.0) -> tuple[int, list[list[object]]]:
    """(sequence, events) of the first batch a fresh subscriber receives from ``endpoint``."""
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        assert sub.poll(int(timeout_s * 1000)), f"no KV-event batch from {endpoint} within {timeout_s:.0f}s"
        _topic, sequence, payload = sub.recv_multipart()
        return int.from_bytes(sequence, "big"), msgspec.msgpack.decode(payload)[1]
    finally:
        sub.close(0)
        context.term()


def test_every_subscriber_is_told_the_cache_is_empty_by_a_cold_server_and_by_one_the_standby_forked(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    port = free_port()
    sidecar = make_sidecar(**{contract.ENV_KV_EVENTS_PORT: str(port)})
    sidecar.wait_ready()
    endpoint = f"tcp://127.0.0.1:{port}"
    before, events = first_batch(endpoint)
    assert events == [["AllBlocksCleared"]]

    wait_for(sidecar.standby_is_warm, 120, "a warm standby beside the ready server")
    old = sidecar.server_pid()
    os.kill(old, signal.SIGKILL)

    def restarted() -> bool:
        body = http_get(sidecar.url(contract.PATH_METRICS))[1]
        return metric_value(body, contract.M_SIDECAR_SERVER_RESTARTS + "_total") == 1 and sidecar.ready()

    wait_for(restarted, 180, "the standby's server ready")
    assert sidecar.server_pid() != old
    after, events = first_batch(endpoint)
    assert events == [["AllBlocksCleared"]]
    assert after > before, "a restarted server's sequence continues above its predecessor's"
