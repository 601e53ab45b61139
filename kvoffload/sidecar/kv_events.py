"""KV events for routers, decided: which chunks the cache announces and which events say so (pure).

Routers (Dynamo's KV router and indexer, llm-d's kv-cache index, AIBrix) read vLLM's KV-event
batches and recompute their own block keys from each event's ``token_ids``; the event's block
hashes only need to be stable 64-bit ids with the parent link. So a chunk of ``chunk_size`` tokens
is announced as its engine blocks (``tokens_per_block`` tokens each), with ids derived from the
cache's chunk hash, so that LMCache's eviction of that chunk (which names the chunk hash) removes
exactly those blocks.

Only unsalted chunks are announced: a salted chunk (a tenant's, a LoRA's, a multimodal prompt's,
``connector.keys.key_salt``) would let a router match another tenant's prompt to it by tokens alone.

Memory is bounded: at most ``capacity`` chunks are tracked (their tokens kept as 32-bit arrays, for
the snapshot a new subscriber gets); the least recently stored one past that is announced removed,
so a router may under-count what the cache holds, never over-count it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MEDIUM_HOST: str = "CPU"
"""LMCache's L1 (host memory): Dynamo's host tier, llm-d's ``cpu``."""
DEFAULT_CAPACITY_CHUNKS = 16384
"""About 16 MiB of token arrays at 256-token chunks: 4 M tokens, more than most L1s hold."""
EVENTS_PER_BATCH = 256

Event = list[Any]
"""One vLLM KV event as its positional msgpack array."""


def block_id(cache_model: str, chunk_hash: bytes, index: int) -> int:
    """The stable 63-bit id of block ``index`` of a chunk (positive in both signed and unsigned readers)."""
    digest = hashlib.blake2b(
        cache_model.encode() + b"\0" + chunk_hash + index.to_bytes(4, "big"), digest_size=8
    ).digest()
    return int.from_bytes(digest, "big") >> 1


def block_ids(cache_model: str, chunk_hash: bytes, blocks: int) -> tuple[int, ...]:
    return tuple(block_id(cache_model, chunk_hash, i) for i in range(blocks))


def block_stored(ids: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int) -> Event:
    return ["BlockStored", list(ids), parent, list(tokens), block_size, None, MEDIUM_HOST, None]


def block_removed(ids: Sequence[int]) -> Event:
    return ["BlockRemoved", list(ids), MEDIUM_HOST]


def all_blocks_cleared() -> Event:
    return ["AllBlocksCleared"]


@dataclass(frozen=True)
class StoredChunk:
    """One chunk a store committed: its hash, its tokens, and where it sits in its prompt."""

    chunk_hash: bytes
    tokens: Sequence[int]
    depth: int
    """The chunk's index in its prompt (0: the first); parents sort before children by it."""


@dataclass(frozen=True)
class _Tracked:
    ids: tuple[int, ...]
    parent: int | None
    tokens: array
    block_size: int
    depth: int


class ChunkTracker:
    """The chunks announced to routers, least recently stored first; every method returns the events
    that bring a subscriber up to date with the change it made."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY_CHUNKS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity} is not allowed; use at least 1 chunk")
        self._capacity = capacity
        self._chunks: OrderedDict[tuple[str, bytes], _Tracked] = OrderedDict()

    def __len__(self) -> int:
        return len(self._chunks)

    def stored(
        self,
        cache_model: str,
        chunks: Sequence[StoredChunk],
        parent_hash: bytes | None,
        tokens_per_block: int,
        salt: str,
    ) -> list[Event]:
        """Chunks of one prompt, in order, committed; ``parent_hash`` is the chunk before the first."""
        if salt != "" or not chunks:
            return []
        blocks = len(chunks[0].tokens) // tokens_per_block
        parent = block_ids(cache_model, parent_hash, blocks)[-1] if parent_hash is not None else None
        events: list[Event] = []
        for chunk in chunks:
            key = (cache_model, chunk.chunk_hash)
            ids = block_ids(cache_model, chunk.chunk_hash, len(chunk.tokens) // tokens_per_block)
            if key in self._chunks:
                self._chunks.move_to_end(key)
            else:
                self._chunks[key] = _Tracked(ids, parent, array("I", chunk.tokens), tokens_per_block, chunk.depth)
                events.append(block_stored(ids, parent, chunk.tokens, tokens_per_block))
            parent = ids[-1]
        while len(self._chunks) > self._capacity:
            _, dropped = self._chunks.popitem(last=False)
            events.append(block_removed(dropped.ids))
        return events

    def evicted(self, keys: Iterable[tuple[str, bytes, str]]) -> list[Event]:
        """The cache dropped these (cache model, chunk hash, salt) objects; salted ones were never announced."""
        events: list[Event] = []
        for model, chunk_hash, salt in keys:
            if salt != "":
                continue
            tracked = self._chunks.pop((model, chunk_hash), None)
            if tracked is not None:
                events.append(block_removed(tracked.ids))
        return events

    def clear(self) -> list[Event]:
        """Forget every chunk (an eviction may have been lost): routers forget them too."""
        self._chunks.clear()
        return [all_blocks_cleared()]

    def snapshot(self) -> list[Event]:
        """Everything a subscriber needs from nothing: a clear, then every tracked chunk, parents first."""
        ordered = sorted(self._chunks.values(), key=lambda t: t.depth)
        return [all_blocks_cleared()] + [
            block_stored(t.ids, t.parent, t.tokens.tolist(), t.block_size) for t in ordered
        ]


def batches(events: Sequence[Event], per_batch: int = EVENTS_PER_BATCH) -> list[list[Event]]:
    """``events`` cut into batches of at most ``per_batch``, in order."""
    return [list(events[i : i + per_batch]) for i in range(0, len(events), per_batch)]
