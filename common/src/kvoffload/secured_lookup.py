"""One server call that looks a prompt up and secures its hit: the request a connector's scheduler
sends its cache server, and the answer.

The connector (``connector.backends.securing``) encodes the request; the cache server's module
(``lmcache_guard.secured_lookups``) runs LMCache's own LOOKUP, WAIT and PREPARE_RETRIEVE with it in
one call, hashing the prompt once, and answers. Through LMCache's opaque ``server_module_call``
envelope: a JSON header line, then the prompt's token ids as little-endian uint32 (LMCache's own
requests carry them as msgpack integers, which a 32k-token key takes 0.6-0.9 ms to decode, once per
request); standard library only.

The server secures ``[start, min(hit, cap))`` when that range is not empty, for each rank's key,
and frees the lookup locks of the hit outside it (``[0, start)`` and ``[min(hit, cap), hit)``); when
this worker instance still holds a secured load of the same key (LMCache keeps one pending read per
key and instance) it secures nothing and frees that range's lookup locks too (``held``).
"""

from __future__ import annotations

import json
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

METHOD = "kvoffload.secured_lookup"
"""The namespaced server-module method the request is sent to."""
MAX_TOKENS = 1 << 22
"""The longest prompt a request may carry (4 Mi tokens, 16 MiB)."""
PROBE = b""
"""A request asking only whether the server has this module; it answers ``PROBE_ANSWER``."""
PROBE_ANSWER = b"kvoffload.secured_lookup/1"
KEY_FIELDS = ("model_name", "world_size", "worker_id", "request_id", "cache_salt", "num_kv_readers")
"""The fields of an LMCache key a request carries (the tokens and the range travel apart)."""


class SecuredLookupError(ValueError):
    """A request or answer that cannot be used; the message names the field and the bad value."""


@dataclass(frozen=True)
class SecuredLookupRequest:
    """Look ``token_ids`` up (all of them: the lookup's end) and secure ``[start, min(hit, cap))``."""

    lookup_key: Mapping[str, Any]
    """The lookup key's ``KEY_FIELDS`` (``worker_id`` None)."""
    rank_keys: tuple[Mapping[str, Any], ...]
    """Rank by rank, the ``KEY_FIELDS`` of the keys PREPARE_RETRIEVE secures (what COMMIT releases)."""
    token_ids: tuple[int, ...]
    start: int
    cap: int
    instance_id: int
    """The worker instance the chunks are handed out to (rank 0's in the scheduler's process)."""
    wait_s: float
    """How long the server waits for the lookup's prefetch (a miss after that, its locks left to the lookup's TTL)."""
    budget_s: float
    """No PREPARE_RETRIEVE starts later than this after the request arrived."""
    give_back_s: float
    """A load secured later than this after the request arrived is given back at once (the caller
    stopped waiting for the answer by then)."""


class SlotDescription(NamedTuple):
    """Where one chunk of a secured load lies in the server's shared-memory segment."""

    offset: int
    length: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class SecuredLookupAnswer:
    """``hit`` (tokens; None: the prefetch outlived ``wait_s``), and the secured range's end with each
    rank's slots (None for a rank the server handed out nothing to: a miss)."""

    hit: int | None
    end: int = 0
    slots: tuple[tuple[SlotDescription, ...] | None, ...] = ()
    held: bool = False
    """The key is secured already by this instance (nothing handed out; the range's lookup locks freed)."""
    given_back: bool = False
    """Secured too late for the caller (after ``give_back_s``): the server gave it back itself."""
    prepare_s: float = 0.0
    """Seconds the server spent in PREPARE_RETRIEVE."""
    server_s: float = 0.0
    """Seconds the server spent on the whole request, from its arrival at the module to the answer
    (0 from a server before this field: the rest of the caller's wait is transport and queueing)."""


def _tokens_bytes(tokens: tuple[int, ...]) -> bytes:
    packed = array("I", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def tokens_from_bytes(raw: bytes) -> array[int]:
    """The token ids of a request's tail, as uint32 in this machine's byte order."""
    if len(raw) % 4:
        raise SecuredLookupError(f"token bytes: {len(raw)} is not a multiple of 4")
    tokens = array("I")
    tokens.frombytes(raw)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens


def _fields(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or set(value) != set(KEY_FIELDS):
        raise SecuredLookupError(f"{what}: expected an object with exactly {', '.join(KEY_FIELDS)}")
    return value


def _int(header: dict[str, Any], name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise SecuredLookupError(f"{name}: expected a non-negative integer, got {value!r}")
    return value


def _seconds(header: dict[str, Any], name: str) -> float:
    value = header.get(name)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 3600:
        raise SecuredLookupError(f"{name}: expected seconds in [0, 3600], got {value!r}")
    return float(value)


def encode_request(request: SecuredLookupRequest) -> bytes:
    """The request as bytes; raises ``OverflowError`` for a token id outside uint32."""
    header = {"lookup": dict(request.lookup_key), "ranks": [dict(k) for k in request.rank_keys],
              "start": request.start, "cap": request.cap, "instance": request.instance_id,
              "wait_s": request.wait_s, "budget_s": request.budget_s, "give_back_s": request.give_back_s}  # fmt: skip
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + _tokens_bytes(request.token_ids)


def decode_request(payload: bytes) -> tuple[SecuredLookupRequest, array[int]]:
    """The request in ``payload`` (its ``token_ids`` empty) and its tokens as an array; raises
    ``SecuredLookupError`` naming what is wrong."""
    newline = payload.find(b"\n")
    if newline < 0:
        raise SecuredLookupError("no header line")
    try:
        header = json.loads(payload[:newline])
    except ValueError as exc:
        raise SecuredLookupError(f"header: not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise SecuredLookupError("header: expected an object")
    ranks = header.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise SecuredLookupError("ranks: expected a non-empty list")
    tokens = tokens_from_bytes(payload[newline + 1 :])
    if len(tokens) > MAX_TOKENS:
        raise SecuredLookupError(f"tokens: {len(tokens)} is more than {MAX_TOKENS}")
    request = SecuredLookupRequest(
        lookup_key=_fields(header.get("lookup"), "lookup"),
        rank_keys=tuple(_fields(k, "ranks[]") for k in ranks),
        token_ids=(),
        start=_int(header, "start"),
        cap=_int(header, "cap"),
        instance_id=_int(header, "instance"),
        wait_s=_seconds(header, "wait_s"),
        budget_s=_seconds(header, "budget_s"),
        give_back_s=_seconds(header, "give_back_s"),
    )
    return request, tokens


def encode_answer(answer: SecuredLookupAnswer) -> bytes:
    """The answer as bytes: each slot ``[offset, length, layout]``, ``layout`` an index into the
    answer's ``layouts`` (``[shape, dtype]``; a load's chunks usually share one)."""
    layouts: dict[tuple[tuple[int, ...], str], int] = {}
    slots = [None if rank is None else [[s.offset, s.length, layouts.setdefault((tuple(s.shape), s.dtype), len(layouts))]
                                        for s in rank]
             for rank in answer.slots]  # fmt: skip
    body = {"hit": answer.hit, "end": answer.end, "slots": slots, "layouts": [[list(k), d] for k, d in layouts],
            "held": answer.held, "given_back": answer.given_back, "prepare_s": answer.prepare_s,
            "server_s": answer.server_s}  # fmt: skip
    return json.dumps(body, separators=(",", ":")).encode()


def decode_answer(payload: bytes) -> SecuredLookupAnswer:
    """The answer in ``payload``; raises ``SecuredLookupError`` naming what is wrong."""
    try:
        body = json.loads(payload)
        hit = body["hit"]
        layouts = [(tuple(int(d) for d in shape), str(dtype)) for shape, dtype in body["layouts"]]
        slots = tuple(
            None if rank is None else tuple(SlotDescription(int(o), int(n), *layouts[i]) for o, n, i in rank)
            for rank in body["slots"]
        )
        return SecuredLookupAnswer(
            hit=None if hit is None else int(hit),
            end=int(body["end"]),
            slots=slots,
            held=bool(body["held"]),
            given_back=bool(body["given_back"]),
            prepare_s=float(body["prepare_s"]),
            server_s=float(body.get("server_s", 0.0)),
        )
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise SecuredLookupError(f"answer: {exc!r}") from None
