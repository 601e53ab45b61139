"""Requests waiting on a server whose connection drops fail at the drop, not at their timeouts."""

from __future__ import annotations

import pytest
import zmq
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

from hack.ports import free_port
from kvoffload.connector.lmcache_seam import ServerDisconnected, fail_requests_on_disconnect

pytestmark = pytest.mark.connector


@pytest.mark.parametrize("hooked", [True, False], ids=["hooked", "lmcache-as-is"])
def test_a_request_waiting_on_a_server_that_goes_away_fails_at_the_disconnect(hooked: bool) -> None:
    """A server that accepted the connection and never answers (as a killed one) goes away: with
    the hook the waiting PING fails at the disconnect; without it, it waits out its timeout."""
    port = free_port()
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.bind(f"tcp://127.0.0.1:{port}")
    client = RequestClientFactory.create(f"tcp://127.0.0.1:{port}", context=zmq.Context())
    assert fail_requests_on_disconnect(client) if hooked else True
    try:
        future = client.ping(1)
        assert server.poll(5000), "the request reached the server"
        server.recv_multipart()
        server.close(linger=0)  # the process is gone: its socket closes, nobody answers
        with pytest.raises((ServerDisconnected, TimeoutError)) as caught:
            future.result(timeout=5.0)
        # Only the disconnect raises ServerDisconnected; without the hook the wait runs out.
        assert (caught.type is ServerDisconnected) is hooked, caught.type
    finally:
        client.close()
        ctx.term()
