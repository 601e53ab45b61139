"""The scheduler's bookkeeping: each live request from its lookup until it ends, who claims which
block, and what one ``build_connector_meta`` gathers for the workers."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from kvoffload.chunk_report import LoraScope
from kvoffload.connector.planning import NO_LOAD, LoadDecision, vanished_holders
from kvoffload.connector.wire import ConnectorMetadata, SecuredLoad, TransferOp


@dataclass
class RequestState:
    """Scheduler-side bookkeeping for one live request."""

    request_id: int
    session_id: str
    salt: str
    num_prompt_tokens: int
    cacheable: bool = True
    """False: its keys cannot name what its KV depends on (``keys.key_salt``); never looked up or saved."""
    lora: LoraScope | None = None
    """The adapter a router matches its salted chunks under (``keys.lora_scope``); None: unscoped
    (no salt) or a scope no router can match (its chunks are never announced)."""
    tokens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    """Its pages by block ordinal (several layer groups: the anchor group's)."""
    group_block_ids: list[list[int]] = field(default_factory=list)
    """Several layer groups: the other groups' pages, aligned with ``block_ids`` (-1: none)."""
    tokens_with_kv: int = 0
    stored_upto: int = 0
    load: LoadDecision = NO_LOAD
    secured: SecuredLoad | None = None
    """The promised load's chunks until ``build_connector_meta`` hands them to the workers."""
    saves_issued: int = 0
    device_tokens: int = 0
    """Tokens TensorRT-LLM had on the device at the lookup."""
    sources_counted: bool = False
    """Its device and cache prompt tokens were counted (once per request)."""
    lookup_hit: int | None = None
    """LMCache's hit at the lookup (None: not looked up, or the lookup failed)."""
    lookup_failure: str | None = None
    """Why the lookup failed (``lookup_timeout``, ``cache_unavailable``) or was not made
    (``uncacheable``), if so."""
    declined_as: str = "declined"
    """The reason counted for a hit this request computed (``slower_to_load``: the cost guard's)."""
    computed_why: tuple[tuple[int, int, str], ...] = ()
    """``planning.computed_reasons`` of the scheduled prompt, set when the engine first schedules it."""
    llm_request: Any = None
    """TensorRT-LLM's ``LlmRequest`` of the lookup (its ``is_finished`` tells a cancelled parked request)."""
    accepted_reservation: int | None = None
    """The prefix reservation whose load KVCacheManagerV2 accepted, until that load's op is planned."""


@dataclass(frozen=True)
class RequestScope:
    """What a request's keys are scoped by, read from its ``LlmRequest`` at its first lookup."""

    salt: str
    cacheable: bool
    llm_request: Any
    lora: LoraScope | None = None


class ReapedScopes:
    """Key scopes of requests whose state was reaped while TensorRT-LLM may still run them: a
    request that comes back (``new_requests`` carries only its tokens, blocks and salt, no adapter
    or multimodal items) gets its scope back, never one rebuilt from ``RequestData``. A scope goes
    once its ``LlmRequest`` is finished; beyond ``limit`` the oldest go (such a request then comes
    back unscoped, which the scheduler never saves)."""

    def __init__(self, limit: int = 4096) -> None:
        self._scopes: OrderedDict[int, RequestScope] = OrderedDict()
        self._limit = limit

    def keep(self, request_id: int, scope: RequestScope) -> None:
        self._scopes[request_id] = scope
        while len(self._scopes) > self._limit:
            self._scopes.popitem(last=False)

    def take(self, request_id: int) -> RequestScope | None:
        return self._scopes.pop(request_id, None)

    def drop_finished(self) -> None:
        """Forget the scopes of requests TensorRT-LLM finished (they never come back)."""
        for rid in [r for r, s in self._scopes.items() if getattr(s.llm_request, "is_finished", False) is True]:
            del self._scopes[rid]

    def __len__(self) -> int:
        return len(self._scopes)


class BlockClaims:
    """Which live requests list each block, and which parked request's load writes it: a block
    handed out again names requests that ended without ``request_finished`` (cancelled, errored,
    aborted), whose state is then reaped."""

    def __init__(self) -> None:
        self._holders: dict[int, set[int]] = {}  # block id -> live requests listing it
        self._parked: set[int] = set()  # their loads issued, not yet back in new_requests
        self._loading_into: dict[int, int] = {}  # block -> the parked request whose load writes it

    @property
    def parked_request_ids(self) -> frozenset[int]:
        """Parked requests whose loads were issued, not yet back in ``new_requests``."""
        return frozenset(self._parked)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def hold(self, request_id: int, block_ids: list[int]) -> None:
        for block in block_ids:
            self._holders.setdefault(block, set()).add(request_id)

    def unhold(self, request_id: int, block_ids: list[int]) -> None:
        for block in block_ids:
            holders = self._holders.get(block)
            if holders is not None:
                holders.discard(request_id)
                if not holders:
                    del self._holders[block]

    def park(self, request_id: int, load_block_ids: tuple[int, ...]) -> None:
        """``request_id``'s asynchronous load was issued into ``load_block_ids``."""
        self._parked.add(request_id)
        self._loading_into.update(dict.fromkeys(load_block_ids, request_id))

    def unpark(self, request_id: int) -> None:
        if request_id in self._parked:
            self._parked.discard(request_id)
            self._loading_into = {b: rid for b, rid in self._loading_into.items() if rid != request_id}

    def vanished(self, fresh: list[int], reused: list[int], owner: int) -> set[int]:
        """``planning.vanished_holders`` over these claims."""
        return vanished_holders(fresh, reused, self._holders, self._loading_into, owner)


class PrefixReservations:
    """Prefix reservations (TensorRT-LLM main): each one's request and the token ranges of it not
    released yet. TensorRT-LLM releases each range exactly once: the tail a trim cuts, the rest
    once the load finished everywhere (or was never started)."""

    def __init__(self) -> None:
        self._open: dict[int, tuple[int, list[tuple[int, int]]]] = {}

    def open(self, reservation_id: int, request_id: int, start: int, end: int) -> None:
        self._open[reservation_id] = (request_id, [(start, end)])

    def request_of(self, reservation_id: int) -> int | None:
        entry = self._open.get(reservation_id)
        return None if entry is None else entry[0]

    def release(self, reservation_id: int, start: int, end: int) -> bool | None:
        """Release ``[start, end)``: True when nothing of the reservation is left (it is closed), False
        when some is, None for an id not open."""
        entry = self._open.get(reservation_id)
        if entry is None:
            return None
        request_id, ranges = entry
        left: list[tuple[int, int]] = []
        for a, b in ranges:
            left.extend((x, y) for x, y in ((a, min(b, start)), (max(a, end), b)) if y > x)
        if left:
            self._open[reservation_id] = (request_id, left)
            return False
        del self._open[reservation_id]
        return True


@dataclass
class StepPlan:
    """What one ``build_connector_meta`` gathers, request by request, for the workers."""

    loads: list[TransferOp] = field(default_factory=list)
    async_loads: list[TransferOp] = field(default_factory=list)
    saves: list[TransferOp] = field(default_factory=list)
    fresh: set[int] = field(default_factory=set)
    reused: set[int] = field(default_factory=set)
    settled_prefix_loads: list[int] = field(default_factory=list)
    computed_prompt_tokens: int = 0

    def metadata(self) -> ConnectorMetadata:
        return ConnectorMetadata(
            loads=tuple(self.loads),
            async_loads=tuple(self.async_loads),
            saves=tuple(self.saves),
            fresh_blocks=frozenset(self.fresh),
            reused_blocks=frozenset(self.reused),
            settled_prefix_loads=tuple(self.settled_prefix_loads),
            computed_prompt_tokens=self.computed_prompt_tokens,
        )
