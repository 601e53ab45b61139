"""Slow is not dead: a request that outlives its deadline on a stalled but live LMCache server
fails that request only; the backend stays up, keeps its connection and its registered pool."""

from __future__ import annotations

import threading
import time

import pytest

from kvoffload.connector.backends.base import BackendError
from kvoffload.connector.wire import TransferOp
from tests.support.connector_env import SHARED_CORES_LOOKUP_TIMEOUT_MS
from tests.support.direct_backend import backend_pair, direct_scheduler, direct_worker, pool_for, stop_heartbeat
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import BLOCK, CHUNK, make_prompt

pytestmark = pytest.mark.connector

LOOKUP_DEADLINE_S = SHARED_CORES_LOOKUP_TIMEOUT_MS / 1000
STALL_S = LOOKUP_DEADLINE_S + 0.5
"""How long the server answers nothing: past the lookup's deadline, well inside the PING's (10 s)."""
ENV = {
    "KVOFFLOAD_STORE_TIMEOUT_MS": "10000",
    "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "10000",
    "KVOFFLOAD_LOOKUP_TIMEOUT_MS": str(SHARED_CORES_LOOKUP_TIMEOUT_MS),
    "KVOFFLOAD_HEARTBEAT_INTERVAL_MS": "10000",
}


def test_a_lookup_that_outlives_its_deadline_on_a_stalled_server_misses_once_and_the_next_one_hits(
    lmcache_server: LMCacheServer,
) -> None:
    tokens = 2 * CHUNK
    blocks = tokens // BLOCK
    worker, scheduler = backend_pair(lmcache_server, "slow-server", ENV, blocks)
    prompt = tuple(make_prompt(51, tokens))
    try:
        worker.copies.store(TransferOp(0, "stored", prompt, 0, tokens, tuple(range(blocks)), 0, "t"))
        assert worker.wait_commits(10.0)
        connection, segment, stalled = scheduler.connection_generation, worker.segment, threading.Event()
        with lmcache_server.paused():
            with pytest.raises(BackendError) as timed_out:
                scheduler.lookup("stalled", prompt, tokens, "t")
            assert timed_out.value.reason == "timeout"
            assert scheduler.is_up(), "one slow answer took the backend down"
            stalled.wait(STALL_S - LOOKUP_DEADLINE_S)
        assert scheduler.lookup("after", prompt, tokens, "t") == tokens
        assert scheduler.connection_generation == connection and worker.segment == segment, (
            "reconnected or registered again"
        )
        assert scheduler.is_up() and worker.is_up()
    finally:
        for session in ("stalled", "after"):
            scheduler.end_session(session)
        scheduler.close()
        worker.close()


def test_a_transfer_that_waits_out_its_deadline_behind_another_leaves_the_backend_up(
    lmcache_server: LMCacheServer,
) -> None:
    """Another transfer holding the transfer context is local contention, not a sick server."""
    env = {**ENV, "KVOFFLOAD_STORE_TIMEOUT_MS": "200"}
    worker = direct_worker(lmcache_server, "busy-context", env, pool_for(CHUNK // BLOCK + 1))
    prompt = tuple(make_prompt(52, CHUNK))
    holding, release = threading.Event(), threading.Event()

    def hold_the_context() -> None:
        with worker.segments.lock:
            holding.set()
            release.wait(10.0)

    holder = threading.Thread(target=hold_the_context)
    holder.start()
    try:
        assert holding.wait(5.0)
        with pytest.raises(BackendError) as busy:
            worker.copies.store(TransferOp(0, "busy", prompt, 0, CHUNK, tuple(range(CHUNK // BLOCK)), 0, "t"))
        assert busy.value.reason == "timeout"
        assert worker.is_up(), "waiting behind another transfer took the backend down"
    finally:
        release.set()
        holder.join()
        worker.close()


def test_a_server_that_answers_no_ping_either_is_marked_down_and_found_again_once_it_answers(
    lmcache_server: LMCacheServer,
) -> None:
    """A lookup's timeout wakes the heartbeat at once: a server that misses two PINGs in a row is
    down (lookups answer at once instead of each waiting out its deadline) until it answers again."""
    env = {**ENV, "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "300", "KVOFFLOAD_HEARTBEAT_INTERVAL_MS": "1000"}
    worker, scheduler = backend_pair(lmcache_server, "hung-server", env, CHUNK // BLOCK)  # lookups key as its pool
    prompt = tuple(make_prompt(53, CHUNK))
    try:
        with lmcache_server.paused():
            with pytest.raises(BackendError):
                scheduler.lookup("hung", prompt, CHUNK, "t")
            deadline = time.monotonic() + 30
            while scheduler.is_up() and time.monotonic() < deadline:  # two PINGs of 2 s each
                time.sleep(0.05)
            assert not scheduler.is_up(), "a server answering no PING stayed up"
            with pytest.raises(BackendError) as down:
                scheduler.lookup("while-down", prompt, CHUNK, "t")
            assert down.value.reason == "unavailable"
        deadline = time.monotonic() + 30
        while not scheduler.is_up() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.is_up(), "the server answered again but the backend stayed down"
    finally:
        scheduler.close()
        worker.close()


def test_one_missed_ping_of_a_live_connection_is_not_down_and_two_in_a_row_are(lmcache_server: LMCacheServer) -> None:
    """A server too busy to answer one PING in time is not declared dead (that would drop the
    connection and register the pool again); one that misses the next PING too is."""
    scheduler = direct_scheduler(lmcache_server, "missed-ping", ENV)
    stop_heartbeat(scheduler)  # this test PINGs by hand
    scheduler.connection.ping_timeout_s = 0.5
    connection = scheduler.connection_generation
    try:
        with lmcache_server.paused():
            scheduler.heartbeat_once()
            assert scheduler.is_up(), "one missed PING took the backend down"
        scheduler.heartbeat_once()  # answered: the count starts again
        with lmcache_server.paused():
            scheduler.heartbeat_once()
            assert scheduler.is_up() and scheduler.connection_generation == connection
            scheduler.heartbeat_once()
            assert not scheduler.is_up(), (
                f"two missed PINGs in a row left the backend up (server {lmcache_server.process_state()})"
            )
        scheduler.heartbeat_once()  # a fresh socket; the server answers again
        assert scheduler.is_up() and scheduler.connection_generation > connection
    finally:
        scheduler.close()
