"""KV events for routers, decided: which chunks the cache announces and which events say so (pure).

Routers (Dynamo's KV router and indexer, llm-d's kv-cache index, AIBrix) read vLLM's KV-event
batches and recompute their own block keys from each event's ``token_ids``; the event's block
hashes only need to be stable 64-bit ids with the parent link. So a chunk of ``chunk_size`` tokens
is announced as its engine blocks (``tokens_per_block`` tokens each), with ids derived from the
cache's chunk hash, so that LMCache's eviction of that chunk (which names the chunk hash) removes
exactly those blocks.

Only unsalted chunks are announced: a salted chunk (a tenant's, a LoRA's, a multimodal prompt's,
``connector.keys.key_salt``) would let a router match another tenant's prompt to it by tokens alone.

Each chunk is announced once per tier that holds it, the tier named by the event's ``medium``:
``CPU`` for LMCache's L1 (host memory), ``DISK`` for a filesystem L2, ``EXTERNAL`` for a Redis L2
(Dynamo's indexer 1.6.1 scores ``CPU`` as its host tier and both others as its disk tier, below it;
a removal names its tier and leaves the others). A chunk L1 evicts while L2 keeps it stays
announced in L2.

Memory is bounded: at most ``capacity`` chunks are tracked (their tokens kept as 32-bit arrays, for
the snapshot a new subscriber gets); the least recently stored one past that is announced removed
from every tier, so a router may under-count what the cache holds, never over-count it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

MEDIUM_HOST: str = "CPU"
"""LMCache's L1 (host memory): Dynamo's host tier, llm-d's ``cpu``."""
MEDIUM_DISK: str = "DISK"
"""A filesystem L2 of this cache server: Dynamo's disk tier."""
MEDIUM_EXTERNAL: str = "EXTERNAL"
"""An L2 that other cache servers may share (Redis): Dynamo scores it with its disk tier."""
SHARED_L2_BACKENDS = ("resp",)
"""LMCache's L2 adapter types that reach a store other servers can share (``resp``: Redis)."""
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


def l2_medium(backend: str, shared: bool) -> str:
    """The medium of an L2 adapter LMCache names by its type (``fs_native``, ``resp``, ...)."""
    return MEDIUM_EXTERNAL if shared or backend in SHARED_L2_BACKENDS else MEDIUM_DISK


def block_stored(
    ids: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int, medium: str = MEDIUM_HOST
) -> Event:
    return ["BlockStored", list(ids), parent, list(tokens), block_size, None, medium, None]


def block_removed(ids: Sequence[int], medium: str = MEDIUM_HOST) -> Event:
    return ["BlockRemoved", list(ids), medium]


def all_blocks_cleared() -> Event:
    return ["AllBlocksCleared"]


@dataclass(frozen=True)
class StoredChunk:
    """One chunk a store committed: its hash, its tokens, and where it sits in its prompt."""

    chunk_hash: bytes
    tokens: Sequence[int]
    depth: int
    """The chunk's index in its prompt (0: the first); parents sort before children by it."""


def _announced(keys: Iterable[tuple[str, bytes, str]]) -> Iterator[tuple[str, bytes]]:
    """(cache model, chunk hash) of the unsalted objects among (model, hash, salt): salted ones are never announced."""
    return ((model, chunk_hash) for model, chunk_hash, salt in keys if salt == "")


@dataclass
class _Tracked:
    ids: tuple[int, ...]
    parent: int | None
    tokens: array
    block_size: int
    depth: int
    media: set[str]
    """The tiers holding the chunk now (announced); never empty while tracked."""

    def stored_in(self, medium: str) -> Event:
        return block_stored(self.ids, self.parent, self.tokens.tolist(), self.block_size, medium)


class ChunkTracker:
    """The chunks announced to routers, least recently stored first; every method returns the events
    that bring a subscriber up to date with the change it made."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY_CHUNKS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity} is not allowed; use at least 1 chunk")
        self._capacity = capacity
        self._chunks: OrderedDict[tuple[str, bytes], _Tracked] = OrderedDict()
        self._early: OrderedDict[tuple[str, bytes], set[str]] = OrderedDict()
        """L2 tiers that took a chunk before its store was reported (LMCache writes L2 behind L1, and
        the connector reports after the COMMIT's answer): applied when the report comes."""

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
        """Chunks of one prompt, in order, committed to L1; ``parent_hash`` is the chunk before the first."""
        if salt != "" or not chunks:
            return []
        blocks = len(chunks[0].tokens) // tokens_per_block
        parent = block_ids(cache_model, parent_hash, blocks)[-1] if parent_hash is not None else None
        events: list[Event] = []
        for chunk in chunks:
            key = (cache_model, chunk.chunk_hash)
            ids = block_ids(cache_model, chunk.chunk_hash, len(chunk.tokens) // tokens_per_block)
            tracked = self._chunks.get(key)
            if tracked is None:
                media = {MEDIUM_HOST} | self._early.pop(key, set())
                tracked = _Tracked(ids, parent, array("I", chunk.tokens), tokens_per_block, chunk.depth, set())
                self._chunks[key] = tracked
            else:
                self._chunks.move_to_end(key)
                media = {MEDIUM_HOST}
            for medium in sorted(media - tracked.media):
                tracked.media.add(medium)
                events.append(tracked.stored_in(medium))
            parent = ids[-1]
        while len(self._chunks) > self._capacity:
            _, dropped = self._chunks.popitem(last=False)
            events += [block_removed(dropped.ids, medium) for medium in sorted(dropped.media)]
        return events

    def evicted(self, keys: Iterable[tuple[str, bytes, str]], medium: str = MEDIUM_HOST) -> list[Event]:
        """The tier ``medium`` dropped these (cache model, chunk hash, salt) objects; salted ones were
        never announced. A chunk no tier holds any more is forgotten."""
        events: list[Event] = []
        for key in _announced(keys):
            tracked = self._chunks.get(key)
            if tracked is None:
                if key in self._early:
                    self._early[key].discard(medium)
                continue
            if medium in tracked.media:
                tracked.media.discard(medium)
                events.append(block_removed(tracked.ids, medium))
            if not tracked.media:
                del self._chunks[key]
        return events

    def l2_stored(self, keys: Iterable[tuple[str, bytes, str]], medium: str) -> list[Event]:
        """An L2 tier (``medium``) took these objects; a chunk whose store is not reported yet is
        announced there when it is (bounded like the tracked chunks)."""
        events: list[Event] = []
        for key in _announced(keys):
            tracked = self._chunks.get(key)
            if tracked is None:
                self._early.setdefault(key, set()).add(medium)
                self._early.move_to_end(key)
                while len(self._early) > self._capacity:
                    self._early.popitem(last=False)
            elif medium not in tracked.media:
                tracked.media.add(medium)
                events.append(tracked.stored_in(medium))
        return events

    def clear(self) -> list[Event]:
        """Forget every chunk (an eviction may have been lost): routers forget them too."""
        self._chunks.clear()
        self._early.clear()
        return [all_blocks_cleared()]

    def snapshot(self) -> list[Event]:
        """Everything a subscriber needs from nothing: a clear, then every tracked chunk in each tier
        holding it, parents first."""
        ordered = sorted(self._chunks.values(), key=lambda t: t.depth)
        return [all_blocks_cleared()] + [t.stored_in(medium) for t in ordered for medium in sorted(t.media)]


def batches(events: Sequence[Event], per_batch: int = EVENTS_PER_BATCH) -> list[list[Event]]:
    """``events`` cut into batches of at most ``per_batch``, in order."""
    return [list(events[i : i + per_batch]) for i in range(0, len(events), per_batch)]
