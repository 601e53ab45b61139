"""KV events on the wire, decided (pure): the tracker's typed events as vLLM's msgpack, in the format
a policy picks, and the journal that lets a restarted server withdraw what its predecessor announced.

Formats (``kvEvents.format``, ``KVOFFLOAD_KV_EVENTS_FORMAT``):

- ``vllm`` (default): vLLM >= 0.24 (vllm-project/vllm#42892; read in vLLM 0.34.0, commit 62d4bc3c7,
  ``vllm/distributed/kv_events.py``): the batch stays a positional array ``[ts, events, dp_rank]`` (the rank nil)
  (``EventBatch``: ``array_like=True``); each event is a map tagged ``"type"`` (``KVCacheEvent``:
  ``tag=True, omit_defaults=True``), fields without a default always present. Media as vLLM names
  them (``MEDIUM_CPU``, ``MEDIUM_STORAGE`` with ``locality`` ``LOCAL``/``REMOTE``): L1 ``CPU``, a
  filesystem L2 ``STORAGE``+``LOCAL``, a Redis (shared) L2 ``STORAGE``+``REMOTE``.
- ``vllm-positional``: vLLM <= 0.23's positional arrays, with the media Dynamo names (``CPU``,
  ``DISK``, ``EXTERNAL``): for consumers that read only arrays (llm-d's kv-cache index <= 0.8.1).

Both carry a LoRA adapter's chunks with ``lora_id`` and ``lora_name`` (``BlockStored.lora``), which
Dynamo 1.6.1 and llm-d 0.8.1 key by; ``extra_keys`` is never sent (docs/routing.md, "Tenants").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, Literal

import msgspec

from kvoffload.chunk_report import LoraScope

FORMAT_VLLM: Final = "vllm"
FORMAT_VLLM_POSITIONAL: Final = "vllm-positional"
FORMATS = (FORMAT_VLLM, FORMAT_VLLM_POSITIONAL)
"""The policy's choices (``policy_values.KV_EVENTS_FORMATS``, checked equal by a test)."""
WireFormat = Literal["vllm", "vllm-positional"]


class Tier(str, Enum):
    """Where the cache holds a chunk; each format names it its own way (``medium``)."""

    HOST = "host"
    """LMCache's L1 (host memory)."""
    L2_LOCAL = "l2-local"
    """A filesystem L2 of this cache server."""
    L2_SHARED = "l2-shared"
    """An L2 other cache servers may share (Redis)."""


_MEDIA: dict[str, dict[Tier, tuple[str, str | None]]] = {
    FORMAT_VLLM: {Tier.HOST: ("CPU", None), Tier.L2_LOCAL: ("STORAGE", "LOCAL"), Tier.L2_SHARED: ("STORAGE", "REMOTE")},
    FORMAT_VLLM_POSITIONAL: {
        Tier.HOST: ("CPU", None),
        Tier.L2_LOCAL: ("DISK", None),
        Tier.L2_SHARED: ("EXTERNAL", None),
    },
}


@dataclass(frozen=True)
class BlockStored:
    ids: Sequence[int]
    parent: int | None
    tokens: Sequence[int]
    block_size: int
    tier: Tier
    lora: LoraScope | None = None
    """The adapter a router must be asked under to match these blocks (``lora_id``, ``lora_name``)."""


@dataclass(frozen=True)
class BlockRemoved:
    ids: Sequence[int]
    tier: Tier


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


def read_format(raw: str) -> WireFormat | None:
    """The format named ``raw``; None when it names none (the caller's error names the setting)."""
    return FORMAT_VLLM if raw == FORMAT_VLLM else FORMAT_VLLM_POSITIONAL if raw == FORMAT_VLLM_POSITIONAL else None


def medium(tier: Tier, wire: WireFormat) -> tuple[str, str | None]:
    """(medium, locality) of ``tier`` in ``wire``; locality None where the format has none."""
    return _MEDIA[wire][tier]


def wire_event(event: Event, wire: WireFormat) -> Any:
    """One event as the msgpack-ready value vLLM's classes would encode."""
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"} if wire == FORMAT_VLLM else ["AllBlocksCleared"]
    name, locality = medium(event.tier, wire)
    if isinstance(event, BlockRemoved):
        if wire == FORMAT_VLLM_POSITIONAL:
            return ["BlockRemoved", list(event.ids), name]
        removed: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": list(event.ids), "medium": name}
        return removed if locality is None else {**removed, "locality": locality}
    lora_id, lora_name = (None, None) if event.lora is None else (event.lora.lora_id, event.lora.lora_name)
    if wire == FORMAT_VLLM_POSITIONAL:
        return ["BlockStored", list(event.ids), event.parent, list(event.tokens), event.block_size, lora_id, name,
                lora_name]  # fmt: skip
    stored: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": list(event.ids),
        "parent_block_hash": event.parent,
        "token_ids": list(event.tokens),
        "block_size": event.block_size,
        "lora_id": lora_id,
        "medium": name,
        "lora_name": lora_name,
    }
    return stored if locality is None else {**stored, "locality": locality}


def encode_batch(ts: float, events: Iterable[Event], wire: WireFormat) -> bytes:
    """A batch ``[ts, events, data_parallel_rank]`` with the rank nil (``EventBatch``'s default, no
    rank): a consumer then takes the rank its wiring gives the stream, so a cache server's clear is
    never read as the engine's rank 0 (docs/routing.md, "The GPU tier"). The nil is sent, not left
    out as vLLM's ``omit_defaults`` would: Dynamo 1.6.1 refuses a batch of two elements."""
    return msgspec.msgpack.encode([ts, [wire_event(e, wire) for e in events], None])


# The journal: what a server announced, so that its successor can withdraw it and go on numbering.


@dataclass(frozen=True)
class JournalState:
    """What a journal says was announced and not withdrawn (per tier, oldest first), and the last
    sequence number sent (-1: none)."""

    announced: dict[Tier, dict[int, None]]
    last_sequence: int


JOURNAL_LIMIT_IDS = 1 << 20
"""At most this many block ids are carried from one server to the next (the newest are kept)."""


def journal_record(sequence: int, events: Sequence[Event]) -> bytes:
    """The journal record of one sent batch: its sequence and, per event, what it announced or withdrew."""
    changes: list[Any] = []
    for e in events:
        if isinstance(e, BlockStored):
            changes.append(["S", e.tier.value, list(e.ids)])
        elif isinstance(e, BlockRemoved):
            changes.append(["R", e.tier.value, list(e.ids)])
        else:
            changes.append(["C"])
    body = msgspec.msgpack.encode([sequence, changes])
    return len(body).to_bytes(4, "big") + body


def fold_journal(data: bytes, limit_ids: int = JOURNAL_LIMIT_IDS) -> JournalState:
    """The state a journal's records leave; a torn or unreadable tail (a crash mid-write) ends it."""
    announced: dict[Tier, dict[int, None]] = {tier: {} for tier in Tier}
    last, offset = -1, 0
    while offset + 4 <= len(data):
        size = int.from_bytes(data[offset : offset + 4], "big")
        if offset + 4 + size > len(data):
            break
        try:
            sequence, changes = msgspec.msgpack.decode(data[offset + 4 : offset + 4 + size])
            for change in changes:
                if change[0] == "C":
                    for ids in announced.values():
                        ids.clear()
                    continue
                ids = announced[Tier(change[1])]
                for block in change[2]:
                    if change[0] == "S":
                        ids.pop(block, None)  # re-announced: newest again
                        ids[int(block)] = None
                    else:
                        ids.pop(block, None)
            last = max(last, int(sequence))
        except (msgspec.DecodeError, ValueError, TypeError, IndexError, KeyError):
            break
        offset += 4 + size
    excess = sum(len(ids) for ids in announced.values()) - limit_ids
    for ids in announced.values():
        while excess > 0 and ids:
            del ids[next(iter(ids))]
            excess -= 1
    return JournalState(announced, last)


def withdrawals(state: JournalState) -> list[Event]:
    """What a successor sends before anything else: every block its predecessor left announced,
    removed in its tier (llm-d's index <= 0.8.1 applies only these), then a clear (Dynamo, llm-d >= 0.9)."""
    removed: list[Event] = [BlockRemoved(list(ids), tier) for tier, ids in state.announced.items() if ids]
    return [*removed, AllBlocksCleared()]


def compacted_journal(state: JournalState) -> bytes:
    """A journal holding just ``state``: what a server writes over its predecessor's when it starts."""
    events: list[Event] = [BlockStored(list(ids), None, (), 0, tier) for tier, ids in state.announced.items() if ids]
    return journal_record(state.last_sequence, events)
