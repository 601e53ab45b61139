"""The GPU tier (issue 45 item 7): a router that reads TensorRT-LLM's own KV events (its GPU pool,
medium ``GPU``) and kvoffload's (host and storage tiers) for one worker, checked against Dynamo's
indexer 1.6.1. The engine's stream is a plain ZMQ publisher here, sending what a vLLM-format engine
sends; kvoffload's is the real publisher, restarted from its journal."""

from __future__ import annotations

import time
from pathlib import Path

import msgspec
import pytest
import zmq

from hack.ports import free_port
from tests.support import vllm_events as vllm
from tests.support.kv_router import DynamoIndexer
from tests.support.sidecar_harness import wait_for

pytestmark = pytest.mark.sidecar

BLOCK = 16
GPU_PREFIX = list(range(200, 264))
"""Four blocks the engine holds in its GPU pool, and kvoffload does not."""
HOST_PREFIX = list(range(64))
"""Four blocks kvoffload holds in host memory, and the engine's GPU pool does not."""


class EngineStream:
    """The engine's own KV events: ``BlockStored`` in medium ``GPU``, batches of data-parallel rank 0."""

    def __init__(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self._sock = context.socket(zmq.PUB)
        self._sock.bind(self.endpoint)
        self._sequence = 0

    def stored(self, ids: list[int], parent: int | None, tokens: list[int]) -> None:
        self._send(vllm.BlockStored(ids, parent, tokens, BLOCK, None, "GPU", None))

    def cleared(self) -> None:
        self._send(vllm.AllBlocksCleared())

    def _send(self, event: object) -> None:
        batch = vllm.KVEventBatch(time.time(), [event], 0)
        self._sock.send_multipart([b"", self._sequence.to_bytes(8, "big"), msgspec.msgpack.encode(batch)])
        self._sequence += 1


def test_a_kvoffload_restart_leaves_the_engines_gpu_view_of_the_worker_in_dynamo_1_6_1(tmp_path: Path) -> None:
    """Dynamo 1.6.1 takes one endpoint per (worker, data-parallel rank): kvoffload's stream joins the
    engine's as ``1:1``. kvoffload's batches leave the rank out (as vLLM's do without data
    parallelism), so the wiring's rank holds: an eviction and a restarted cache server's
    ``AllBlocksCleared`` touch kvoffload's blocks only, the engine's GPU blocks stay scored, and the
    engine's own clear leaves kvoffload's host blocks; the worker's score still counts both streams."""
    from kvoffload.sidecar.kv_events import ChunkTracker, StoredChunk
    from kvoffload.sidecar.kv_events_module import EventJournal, EventPublisher

    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engine = EngineStream(context)
    ours, journal = f"tcp://127.0.0.1:{free_port()}", str(tmp_path / "events.journal")
    indexer = DynamoIndexer({1: engine.endpoint, "1:1": ours}, BLOCK, tmp_path / "indexer.log")
    cache = EventPublisher(ours, "", ChunkTracker(), journal=EventJournal(journal))
    cache.start()
    try:
        indexer.start()

        def store_host_prefix(publisher: EventPublisher) -> None:
            chunk = StoredChunk(b"h", HOST_PREFIX, 0)
            publisher.submit(lambda tracker: tracker.stored("m", [chunk], None, BLOCK, ""))

        def engine_holds(tokens: list[int]) -> bool:
            engine.stored([901, 902, 903, 904], None, GPU_PREFIX)  # again until the indexer has joined
            return indexer.tier_matches(tokens, "gpu") == {1: len(tokens)}

        wait_for(lambda: engine_holds(GPU_PREFIX), 30, "the indexer scores the engine's GPU blocks")
        store_host_prefix(cache)
        wait_for(lambda: indexer.host_tier_matches(HOST_PREFIX) == {1: 64}, 30, "the indexer scores our host blocks")
        assert indexer.tier_matches(HOST_PREFIX, "gpu") == {}, "our blocks are never scored as GPU"

        cache.submit(lambda tracker: tracker.evicted([("m", b"h", "")]))
        wait_for(lambda: indexer.host_tier_matches(HOST_PREFIX) == {}, 30, "our eviction withdrawn")
        assert indexer.tier_matches(GPU_PREFIX, "gpu") == {1: 64}, "a removal of ours leaves the GPU blocks"

        store_host_prefix(cache)
        wait_for(lambda: indexer.host_tier_matches(HOST_PREFIX) == {1: 64}, 30, "our host blocks again")
        cache.close()
        cache = EventPublisher(ours, "", ChunkTracker(), journal=EventJournal(journal))
        cache.start()
        wait_for(lambda: indexer.host_tier_matches(HOST_PREFIX) == {}, 60, "the restart withdrew our blocks")
        assert indexer.tier_matches(GPU_PREFIX, "gpu") == {1: 64}, "our restart's clear left the GPU blocks"
        engine.stored([905], 904, list(range(264, 280)))
        wait_for(
            lambda: indexer.tier_matches([*GPU_PREFIX, *range(264, 280)], "gpu") == {1: 80},
            30,
            "the engine's next block indexed under its kept parent",
        )

        # and the other way: the engine's clear leaves our host blocks of the worker
        store_host_prefix(cache)
        wait_for(lambda: indexer.host_tier_matches(HOST_PREFIX) == {1: 64}, 30, "our host blocks after the restart")
        engine.cleared()
        wait_for(lambda: indexer.tier_matches(GPU_PREFIX, "gpu") == {}, 30, "the engine's clear took its GPU blocks")
        assert indexer.host_tier_matches(HOST_PREFIX) == {1: 64}, "the engine's clear left our host blocks"
    finally:
        cache.close()
        indexer.stop()
        context.destroy(0)
