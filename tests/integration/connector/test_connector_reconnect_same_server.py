"""A reconnect to the LMCache server that is still there loses nothing it prepared: a store's
COMMITs still go out, and a late failure from the replaced connection does not reconnect again.

Found in the warm-standby kill test under load (1 run in 5): a secure that failed on the dead
server's connection marked the backend down after the heartbeat had already reconnected, so it
reconnected a second time to the new server; the COMMITs of a store prepared in between were
dropped, the server kept their reservations for good, and that prompt never stored again.
"""

from __future__ import annotations

import pytest

from kvoffload.connector.wire import TransferOp
from tests.support.direct_backend import backend_pair, direct_worker, hold_store_commits, pool_for, stop_heartbeat
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import BLOCK, CHUNK, make_prompt

pytestmark = pytest.mark.connector

ENV = {
    "KVOFFLOAD_STORE_TIMEOUT_MS": "10000",
    "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "10000",
    "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "10000",
    "KVOFFLOAD_HEARTBEAT_INTERVAL_MS": "600000",
}


def test_a_store_prepared_before_a_reconnect_to_the_same_server_is_still_committed(
    lmcache_server: LMCacheServer,
) -> None:
    tokens = 2 * CHUNK
    blocks = tokens // BLOCK
    worker, scheduler = backend_pair(lmcache_server, "same-server", ENV, blocks)
    held, release = hold_store_commits(worker, 30)
    stop_heartbeat(worker)  # the test reconnects by hand
    prompt = tuple(make_prompt(61, tokens))
    try:
        worker.copies.store(TransferOp(0, "stored", prompt, 0, tokens, tuple(range(blocks)), 0, "t"))
        assert held.wait(10)
        segment = worker.segment
        worker.connection.fail("heartbeat", "unavailable", "a reconnect with the server still there")
        worker.heartbeat_once()  # a fresh socket, the pool registered again: the same server, the same segment
        assert worker.is_up() and worker.segment == segment
        release.set()
        assert worker.wait_commits(10)
        assert scheduler.lookup("found", prompt, tokens, "t") == tokens, "the store's COMMITs were dropped"
    finally:
        release.set()
        scheduler.end_session("found")
        scheduler.close()
        worker.close()


def test_a_late_failure_on_the_replaced_connection_does_not_take_the_new_one_down(
    lmcache_server: LMCacheServer,
) -> None:
    worker = direct_worker(lmcache_server, "late-failure", ENV, pool_for(CHUNK // BLOCK + 1))
    stop_heartbeat(worker)  # the test reconnects by hand
    try:
        dead = worker.connection.client
        worker.connection.fail("heartbeat", "unavailable", "the connection dropped", dead)
        worker.heartbeat_once()
        registered = worker.registration_generation
        assert worker.is_up() and worker.connection.client is not dead
        worker.connection.fail("retrieve", "unavailable", "a request on the dropped connection fails late", dead)
        assert worker.is_up() and not worker.connection.needs_reset
        worker.heartbeat_once()
        assert worker.registration_generation == registered, "reconnected and registered again for a stale failure"
    finally:
        worker.close()
