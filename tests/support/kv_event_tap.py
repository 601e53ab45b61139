"""A KV-event subscriber for tests: every batch a server publishes, decoded with vLLM 0.34.0's own
schema (``tests.support.vllm_events``), and what a router that keys blocks by medium alone holds."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import zmq

from tests.support import vllm_events as vllm


class KvEventTap:
    """Subscribes to ``endpoint`` on its own thread (a context manager) and keeps every event in order."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._events: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-event-tap", daemon=True)

    def __enter__(self) -> KvEventTap:
        self._thread.start()
        return self

    def __exit__(self, *_exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def events(self) -> list[Any]:
        """Every event received so far (vLLM's ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``)."""
        with self._lock:
            return list(self._events)

    def _run(self) -> None:
        context = zmq.Context()
        sub = context.socket(zmq.SUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self._endpoint)
            while not self._stop.is_set():
                if sub.poll(100):
                    _topic, _sequence, payload = sub.recv_multipart()
                    batch = vllm.DECODER.decode(payload)
                    with self._lock:
                        self._events += batch.events
        finally:
            sub.close(0)
            context.term()


def held_by_medium(events: Sequence[Any]) -> dict[tuple[int, str], int]:
    """What a router keying blocks by medium alone holds after ``events`` (llm-d's index >= 0.9: the
    medium lowercased, ``locality`` ignored): (block id, medium) -> stores seen without a removal."""
    held: dict[tuple[int, str], int] = {}
    for event in events:
        if isinstance(event, vllm.AllBlocksCleared):
            held.clear()
            continue
        for block in event.block_hashes:
            if isinstance(event, vllm.BlockStored):
                held[(block, event.medium or "")] = held.get((block, event.medium or ""), 0) + 1
            else:
                held.pop((block, event.medium or ""), None)
    return held


def block_ids_of(events: Sequence[Any], tokens: Sequence[int], block_size: int) -> set[int]:
    """The ids announced for blocks of ``tokens``' prefix (matched by each block's tokens)."""
    wanted = {tuple(tokens[i : i + block_size]) for i in range(0, len(tokens) - block_size + 1, block_size)}
    found: set[int] = set()
    for event in events:
        if isinstance(event, vllm.BlockStored):
            for index, block in enumerate(event.block_hashes):
                if tuple(event.token_ids[index * block_size : (index + 1) * block_size]) in wanted:
                    found.add(block)
    return found
