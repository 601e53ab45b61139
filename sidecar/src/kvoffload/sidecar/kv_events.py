"""KV events for routers, decided: which chunks the cache announces and which events say so (pure).

Routers (Dynamo's KV router and indexer, llm-d's kv-cache index, AIBrix) read vLLM's KV-event
batches and recompute their own block keys from each event's ``token_ids``; the event's block
hashes only need to be stable 64-bit ids with the parent link. So a chunk of ``chunk_size`` tokens
is announced as its engine blocks (``tokens_per_block`` tokens each), with ids derived from the
cache's chunk hash, so that LMCache's eviction of that chunk (which names the chunk hash) removes
exactly those blocks.

Unsalted chunks are announced unscoped, and chunks whose salt is their LoRA adapter's alone under that
adapter (``chunk_report.LoraScope``: vLLM's ``lora_id`` and ``lora_name``, which Dynamo and llm-d
match only for requests of that adapter). Every other salted chunk (a tenant's ``cache_salt``, a
multimodal or prompt-tuning prompt's, ``connector.keys.key_salt``) is never announced: no router
can be asked under its scope, and unscoped it would rank a pod for prompts that cannot use it.

A chunk is announced at most once per medium (``announced_tiers``): each wire format names the
tiers its own way (``kv_event_wire.medium``), and where two tiers holding a chunk share a medium
(vLLM's maps name a filesystem and a Redis L2 both ``STORAGE``, apart only by ``locality``, which
llm-d's index ignores) it is announced in the nearest of them only, so that one tier dropping it
never withdraws what the other still holds. A removal names its tier and leaves the others; a chunk
L1 evicts while L2 keeps it stays announced in L2, and one LMCache loads back from L2 into L1 (a
prefetch) is announced in L1 again. A clear withdraws every block in each tier announcing it before
the bare clear, because llm-d's index (<= 0.8.1) only logs ``AllBlocksCleared``.

Memory is bounded: at most ``capacity`` chunks are tracked (their tokens kept as 32-bit arrays, for
the snapshot a new subscriber gets); the least recently stored (or loaded) one past that is announced removed
from every tier, so a router may under-count what the cache holds, never over-count it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvoffload.chunk_report import LoraScope
from kvoffload.lmcache_guard.cache_key_events import KeyTriple

from .kv_event_wire import FORMAT_VLLM, AllBlocksCleared, BlockRemoved, BlockStored, Event, Tier, WireFormat, medium

SHARED_L2_BACKENDS = ("resp",)
"""LMCache's L2 adapter types that reach a store other servers can share (``resp``: Redis)."""
DEFAULT_CAPACITY_CHUNKS = 16384
"""About 16 MiB of token arrays at 256-token chunks: 4 M tokens, more than most L1s hold."""
EVENTS_PER_BATCH = 256
MAX_SCOPED_SALTS = 4096
"""Salts of LoRA-scoped chunks remembered (one per adapter), for L2 stores that come before the report."""


def block_id(cache_model: str, chunk_hash: bytes, index: int, salt: str = "") -> int:
    """The stable 63-bit id of block ``index`` of a chunk (positive in both signed and unsigned readers);
    a salted chunk's differs from the unsalted one of the same tokens."""
    scope = cache_model.encode() + (b"\0" + salt.encode() if salt else b"")
    digest = hashlib.blake2b(scope + b"\0" + chunk_hash + index.to_bytes(4, "big"), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def block_ids(cache_model: str, chunk_hash: bytes, blocks: int, salt: str = "") -> tuple[int, ...]:
    return tuple(block_id(cache_model, chunk_hash, i, salt) for i in range(blocks))


NEAREST_FIRST = (Tier.HOST, Tier.L2_LOCAL, Tier.L2_SHARED)
"""The tiers from the one a load comes from fastest."""


def announced_tiers(held: Iterable[Tier], wire: WireFormat) -> tuple[Tier, ...]:
    """The tiers a chunk ``held`` in these tiers is announced in, nearest first: per medium as ``wire``
    names it (locality aside), the nearest tier holding it."""
    holding, seen, announced = set(held), set(), []
    for tier in NEAREST_FIRST:
        name = medium(tier, wire)[0]
        if tier in holding and name not in seen:
            seen.add(name)
            announced.append(tier)
    return tuple(announced)


def l2_tier(backend: str, shared: bool) -> Tier:
    """The tier of an L2 adapter LMCache names by its type (``fs_native``, ``resp``, ...)."""
    return Tier.L2_SHARED if shared or backend in SHARED_L2_BACKENDS else Tier.L2_LOCAL


@dataclass(frozen=True)
class StoredChunk:
    """One chunk a store committed: its hash, its tokens, and where it sits in its prompt."""

    chunk_hash: bytes
    tokens: Sequence[int]
    depth: int
    """The chunk's index in its prompt (0: the first); parents sort before children by it."""


@dataclass
class _Tracked:
    ids: tuple[int, ...]
    parent: int | None
    tokens: array
    block_size: int
    depth: int
    held: set[Tier]
    """The tiers holding the chunk now; never empty while tracked."""
    announced: tuple[Tier, ...]
    """The tiers it is announced in (``announced_tiers`` of ``held``), nearest first."""
    lora: LoraScope | None

    def stored_in(self, tier: Tier) -> Event:
        return BlockStored(self.ids, self.parent, self.tokens.tolist(), self.block_size, tier, self.lora)

    def withdrawn(self) -> list[Event]:
        return [BlockRemoved(self.ids, tier) for tier in self.announced]

    def settle(self, wire: WireFormat) -> list[Event]:
        """The events that bring the announcement in line with ``held``: removals first, so that a
        medium passing from one tier to another is withdrawn before it is announced again."""
        announced = announced_tiers(self.held, wire)
        events: list[Event] = [BlockRemoved(self.ids, tier) for tier in self.announced if tier not in announced]
        events += [self.stored_in(tier) for tier in announced if tier not in self.announced]
        self.announced = announced
        return events


class ChunkTracker:
    """The chunks announced to routers, least recently stored or loaded first; every method returns the events
    that bring a subscriber up to date with the change it made."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY_CHUNKS, wire: WireFormat = FORMAT_VLLM) -> None:
        if capacity < 1:
            raise ValueError(f"capacity: {capacity} is not allowed; use at least 1 chunk")
        self._capacity = capacity
        self._wire: WireFormat = wire
        """The format the events go out in: which tiers share a medium (``announced_tiers``)."""
        self._chunks: OrderedDict[KeyTriple, _Tracked] = OrderedDict()
        self._early: OrderedDict[KeyTriple, set[Tier]] = OrderedDict()
        """L2 tiers that took a chunk before its store was reported (LMCache writes L2 behind L1, and
        the connector reports after the COMMIT's answer): applied when the report comes."""
        self._scoped_salts: OrderedDict[str, None] = OrderedDict()
        """Salts a LoRA-scoped report came with: an L2 store under another salt is never announced."""

    def __len__(self) -> int:
        return len(self._chunks)

    def stored(
        self,
        cache_model: str,
        chunks: Sequence[StoredChunk],
        parent_hash: bytes | None,
        tokens_per_block: int,
        salt: str,
        lora: LoraScope | None = None,
    ) -> list[Event]:
        """Chunks of one prompt, in order, committed to L1; ``parent_hash`` is the chunk before the first.
        Salted ones are announced only under their LoRA scope (``lora``), never without one."""
        if (salt != "" and lora is None) or not chunks:
            return []
        if salt != "":
            self._scoped_salts[salt] = None
            self._scoped_salts.move_to_end(salt)
            while len(self._scoped_salts) > MAX_SCOPED_SALTS:
                self._scoped_salts.popitem(last=False)
        blocks = len(chunks[0].tokens) // tokens_per_block
        parent = block_ids(cache_model, parent_hash, blocks, salt)[-1] if parent_hash is not None else None
        events: list[Event] = []
        for chunk in chunks:
            key = (cache_model, chunk.chunk_hash, salt)
            ids = block_ids(cache_model, chunk.chunk_hash, len(chunk.tokens) // tokens_per_block, salt)
            tracked = self._chunks.get(key)
            if tracked is None:
                held = {Tier.HOST} | self._early.pop(key, set())
                tokens = array("I", chunk.tokens)
                tracked = _Tracked(ids, parent, tokens, tokens_per_block, chunk.depth, held, (), lora)
                self._chunks[key] = tracked
            else:
                self._chunks.move_to_end(key)
                tracked.held.add(Tier.HOST)
            events += tracked.settle(self._wire)
            parent = ids[-1]
        return events + self._past_capacity()

    def _past_capacity(self) -> list[Event]:
        events: list[Event] = []
        while len(self._chunks) > self._capacity:
            _, dropped = self._chunks.popitem(last=False)
            events += dropped.withdrawn()
        return events

    def loaded(self, keys: Iterable[KeyTriple]) -> list[Event]:
        """L1 took these objects back from an L2 (LMCache's prefetch): announced in L1 again. One never
        announced is ignored: its tokens are unknown here (another server's store in a shared L2, or
        a chunk past capacity)."""
        events: list[Event] = []
        for key in keys:
            tracked = self._chunks.get(key)
            if tracked is not None:
                self._chunks.move_to_end(key)
                tracked.held.add(Tier.HOST)
                events += tracked.settle(self._wire)
        return events

    def evicted(self, keys: Iterable[KeyTriple], tier: Tier = Tier.HOST) -> list[Event]:
        """The tier ``tier`` dropped these objects; ones never announced are ignored. A chunk no tier
        holds any more is forgotten."""
        events: list[Event] = []
        for key in keys:
            tracked = self._chunks.get(key)
            if tracked is None:
                if key in self._early:
                    self._early[key].discard(tier)
                continue
            tracked.held.discard(tier)
            events += tracked.settle(self._wire)
            if not tracked.held:
                del self._chunks[key]
        return events

    def l2_stored(self, keys: Iterable[KeyTriple], tier: Tier) -> list[Event]:
        """An L2 tier (``tier``) took these objects; a chunk whose store is not reported yet is
        announced there when it is (bounded like the tracked chunks), unless its salt is one no
        LoRA-scoped report came with (a tenant's: never announced)."""
        events: list[Event] = []
        for key in keys:
            if key[2] != "" and key[2] not in self._scoped_salts:
                continue
            tracked = self._chunks.get(key)
            if tracked is None:
                self._early.setdefault(key, set()).add(tier)
                self._early.move_to_end(key)
                while len(self._early) > self._capacity:
                    self._early.popitem(last=False)
            else:
                tracked.held.add(tier)
                events += tracked.settle(self._wire)
        return events

    def clear(self) -> list[Event]:
        """Forget every chunk (an eviction may have been lost): each block is withdrawn in each tier
        announcing it (routers that ignore a clear, llm-d's index <= 0.8.1, apply these), then cleared."""
        removed: list[Event] = [e for t in self._chunks.values() for e in t.withdrawn()]
        self._chunks.clear()
        self._early.clear()
        self._scoped_salts.clear()
        return [*removed, AllBlocksCleared()]

    def snapshot(self) -> list[Event]:
        """Everything a subscriber needs from nothing: a clear, then every tracked chunk in each tier
        announcing it, parents first."""
        ordered = sorted(self._chunks.values(), key=lambda t: t.depth)
        return [AllBlocksCleared(), *(t.stored_in(tier) for t in ordered for tier in t.announced)]


def batches(events: Sequence[Event], per_batch: int = EVENTS_PER_BATCH) -> list[list[Event]]:
    """``events`` cut into batches of at most ``per_batch``, in order."""
    return [list(events[i : i + per_batch]) for i in range(0, len(events), per_batch)]
