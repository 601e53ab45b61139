"""The real sidecar with KV events on: its LMCache server, cold-started or forked by the warm
standby after a crash, publishes on the events port, and greets every subscriber with a clear."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    assert events == [{"type": "AllBlocksCleared"}]  # vLLM >= 0.24's maps, the default

    wait_for(sidecar.standby_is_warm, 120, "a warm standby beside the ready server")
    old = sidecar.server_pid()
    os.kill(old, signal.SIGKILL)

    def restarted() -> bool:
        body = http_get(sidecar.url(contract.PATH_METRICS))[1]
        return metric_value(body, contract.M_SIDECAR_SERVER_RESTARTS + "_total") == 1 and sidecar.ready()

    wait_for(restarted, 180, "the standby's server ready")
    assert sidecar.server_pid() != old
    after, events = first_batch(endpoint)
    assert events == [{"type": "AllBlocksCleared"}]  # vLLM >= 0.24's maps, the default
    assert after == before + 1, "a restarted server numbers on from its predecessor's journal"


# The publisher alone, on loopback (no LMCache): whom the first batch goes to, and what a restart sends.


class Subscriber:
    """A ZMQ SUB as routers use one, decoding with vLLM 0.34.0's own schema."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        self.sock = context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)

    def next(self, timeout_s: float = 10.0) -> tuple[int, list[object]]:
        from tests.support.vllm_events import DECODER

        assert self.sock.poll(int(timeout_s * 1000)), "no batch within the timeout"
        _topic, sequence, payload = self.sock.recv_multipart()
        return int.from_bytes(sequence, "big"), list(DECODER.decode(payload).events)

    def pending(self) -> list[tuple[int, list[object]]]:
        """Every batch already delivered, without waiting for more."""
        got = []
        while self.sock.poll(0):
            got.append(self.next())
        return got


def stored(publisher: object, chunk: bytes) -> None:
    from kvoffload.sidecar.kv_events import StoredChunk

    publisher.submit(lambda tracker: tracker.stored("m", [StoredChunk(chunk, list(range(64)), 0)], None, 16, ""))  # type: ignore[attr-defined]


def test_a_new_subscribers_first_batch_goes_to_it_alone_and_the_others_see_no_gap(tmp_path: object) -> None:
    from kvoffload.sidecar.kv_events import ChunkTracker
    from kvoffload.sidecar.kv_events_module import EventPublisher
    from tests.support import vllm_events as vllm

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = EventPublisher(endpoint, "", ChunkTracker())
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    publisher.start()
    try:
        first = Subscriber(context, endpoint)
        sequence, events = first.next()
        assert [type(e) for e in events] == [vllm.AllBlocksCleared]
        stored(publisher, b"a")
        assert first.next()[0] == sequence + 1
        second = Subscriber(context, endpoint)
        joined, events = second.next()
        # under the last number sent: the others are sent nothing, and the joiner's next follows on
        assert [type(e) for e in events] == [vllm.AllBlocksCleared, vllm.BlockStored] and joined == sequence + 1
        stored(publisher, b"b")
        assert second.next()[0] == joined + 1
        # the first subscriber saw no snapshot of the second's and no gap: the next store, numbered on
        seen = first.next()
        assert seen[0] == joined + 1 and [type(e) for e in seen[1]] == [vllm.BlockStored]
        assert first.pending() == []
    finally:
        publisher.close()
        context.destroy(0)


def test_a_restarted_publisher_withdraws_its_predecessors_blocks_per_tier_and_numbers_on(tmp_path: Path) -> None:
    from kvoffload.sidecar.kv_event_wire import Tier
    from kvoffload.sidecar.kv_events import block_ids
    from tests.support import vllm_events as vllm

    endpoint, journal = f"tcp://127.0.0.1:{free_port()}", str(tmp_path / "events.journal")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        before = journaled_publisher(endpoint, journal)
        sub = Subscriber(context, endpoint)
        sub.next()
        stored(before, b"a")
        sub.next()  # one change, one batch: changes queued together go out as one
        stored(before, b"b")
        sub.next()
        before.submit(lambda tracker: tracker.l2_stored([("m", b"b", "")], Tier.L2_LOCAL))
        sub.next()
        before.submit(lambda tracker: tracker.evicted([("m", b"a", "")]))
        last = sub.next()[0]
        before.close()  # as a killed server: nothing is sent on the way out

        after = journaled_publisher(endpoint, journal)
        try:
            sequence, events = sub.next(30.0)  # the SUB reconnects and subscribes again
            assert sequence == last + 1, "numbered on from the predecessor's last batch"
            removed = [(e.block_hashes, e.medium, e.locality) for e in events if isinstance(e, vllm.BlockRemoved)]
            b = list(block_ids("m", b"b", 4))
            assert removed == [(b, "CPU", None), (b, "STORAGE", "LOCAL")]  # a was withdrawn already
            assert isinstance(events[-1], vllm.AllBlocksCleared)
        finally:
            after.close()
    finally:
        context.destroy(0)


def journaled_publisher(endpoint: str, journal: str) -> Any:
    """A started KV-event publisher on ``endpoint`` keeping its journal in ``journal``, as the
    sidecar's module runs one (a second one on the same journal is its restart)."""
    from kvoffload.sidecar.kv_events import ChunkTracker
    from kvoffload.sidecar.kv_events_module import EventJournal, EventPublisher

    publisher = EventPublisher(endpoint, "", ChunkTracker(), journal=EventJournal(journal))
    publisher.start()
    return publisher


def until_events(sub: Subscriber) -> list[int]:
    """The numbers of the batches ``sub`` receives up to and including the next one with events."""
    numbers = []
    while True:
        number, events = sub.next()
        numbers.append(number)
        if events:
            return numbers


def no_gap(numbers: list[int]) -> bool:
    """What Dynamo's indexer logs no gap for: each number the one before or the next."""
    return all(b - a in (0, 1) for a, b in itertools.pairwise(numbers))


def test_a_subscriber_that_stays_across_a_restart_sees_no_gap_when_another_is_greeted_first(tmp_path: Path) -> None:
    """A subscriber of the old server reconnects to the restarted one only after a newcomer was
    greeted (the order Dynamo's indexer met in the field): its next number is still the old server's
    last + 1, and both see consecutive numbers from there on."""
    from tests.support import vllm_events as vllm

    endpoint, journal = f"tcp://127.0.0.1:{free_port()}", str(tmp_path / "events.journal")
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        before = journaled_publisher(endpoint, journal)
        staying = Subscriber(context, endpoint)
        seen = until_events(staying)  # the greeting (a clear)
        stored(before, b"a")
        seen += until_events(staying)
        assert no_gap(seen), f"the subscriber saw {seen} from the first server"
        staying.sock.disconnect(endpoint)  # its reconnection comes after the newcomer's greeting
        before.close()

        after = journaled_publisher(endpoint, journal)
        try:
            newcomer = Subscriber(context, endpoint)
            greeted, events = newcomer.next()
            assert isinstance(events[-1], vllm.AllBlocksCleared)
            staying.sock.connect(endpoint)
            sequence, events = staying.next()
            assert sequence == seen[-1] + 1, f"the subscriber that stayed saw {seen}, then {sequence}"
            assert isinstance(events[-1], vllm.AllBlocksCleared)
            stored(after, b"b")
            assert no_gap([sequence, *until_events(staying)])
            numbers = [greeted, *until_events(newcomer)]
            assert no_gap(numbers), f"the newcomer saw {numbers}"
        finally:
            after.close()
    finally:
        context.destroy(0)


def test_dynamos_indexer_logs_no_gap_when_a_restarted_server_greets_another_subscriber_first(tmp_path: Path) -> None:
    """Dynamo's indexer 1.6.1 stays subscribed across a restart; the server is down long enough for
    a newcomer to be greeted by the new server before the indexer reconnects (the colleague's
    report): the indexer logs no gap, forgets the old server's blocks and follows the new one."""
    from kvoffload.sidecar.kv_events import ChunkTracker, StoredChunk
    from kvoffload.sidecar.kv_events_module import EventJournal, EventPublisher
    from tests.support.kv_router import DynamoIndexer

    endpoint, journal = f"tcp://127.0.0.1:{free_port()}", str(tmp_path / "events.journal")
    log = tmp_path / "indexer.log"
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    indexer = DynamoIndexer({1: endpoint}, 16, log)
    before = journaled_publisher(endpoint, journal)
    try:
        indexer.start()
        stored(before, b"a")
        wait_for(lambda: indexer.host_tier_matches(list(range(64))) == {1: 64}, 30, "the indexer holds a")
        before.close()
        time.sleep(3)  # not a timing under test: the indexer's reconnection backs off meanwhile
        after = EventPublisher(endpoint, "", ChunkTracker(), journal=EventJournal(journal))
        newcomer = Subscriber(context, endpoint)
        after.start()
        try:
            newcomer.next(30.0)
            wait_for(lambda: indexer.host_tier_matches(list(range(64))) == {}, 60, "the indexer forgot a")
            after.submit(
                lambda tracker: tracker.stored("m", [StoredChunk(b"b", list(range(100, 164)), 0)], None, 16, "")
            )
            wait_for(lambda: indexer.host_tier_matches(list(range(100, 164))) == {1: 64}, 30, "the indexer holds b")
            assert "Gap detected" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]
        finally:
            after.close()
    finally:
        before.close()
        indexer.stop()
        context.destroy(0)
