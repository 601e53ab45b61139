"""The connector's scheduler hooks (TensorRT-LLM's ``KvCacheConnectorScheduler``): what to load, what to save.

Each hook gathers its inputs, calls a pure function in ``planning`` and acts through a backend.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from kvoffload.connector import planning, wire
from kvoffload.connector.backends.base import BackendError
from kvoffload.connector.identities import AdapterIdentities, prompt_table_digest
from kvoffload.connector.keys import key_salt, lora_scope
from kvoffload.connector.layout import GroupedLayout, page_key
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.runtime import (
    ConnectorRole,
    KvCacheConnectorScheduler,
    SchedulerOutput,
    backend_settings,
    count_skip,
    prompt_tokens,
)
from kvoffload.connector.scheduler_state import (
    BlockClaims,
    PrefixReservations,
    ReapedScopes,
    RequestScope,
    RequestState,
    StepPlan,
)

if TYPE_CHECKING:  # built after the bundle made LMCache loadable (``start_scheduler_client``)
    from kvoffload.connector.backends.engine_process import EngineProcess
    from kvoffload.connector.backends.scheduler_client import SchedulerClient
    from kvoffload.connector.backends.securing import SecuredHit
    from kvoffload.connector.settings import ConnectorSettings

logger = logging.getLogger("kvoffload.connector")


def start_scheduler_client(settings: ConnectorSettings, metrics: ConnectorMetrics,
                           process: EngineProcess) -> SchedulerClient:  # fmt: skip
    """The scheduler's client of the pod's sidecar or of ``process``'s own cache server."""
    settings = backend_settings(process, settings)
    from kvoffload.connector.backends.scheduler_client import SchedulerClient

    return SchedulerClient(settings, metrics=metrics, process=process)


class KvoffloadConnectorScheduler(ConnectorRole, KvCacheConnectorScheduler):
    """Rank 0 (every rank under attention DP): lookups, and which blocks to load and save each iteration."""

    supports_attention_dp = True
    """Under attention DP each rank has its own scheduler over its own requests and blocks; its
    loads are secured for the worker in its own process (world size 1, whole KV heads)."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._start_role(llm_args, "scheduler")
        self._backend = start_scheduler_client(self._settings, self._metrics, self._process)
        self._chunk = self._backend.chunk_size
        self._adapters = AdapterIdentities()
        """The LoRA adapters requests run under, identified by their weights (``identities``)."""
        # Session ids are unique per engine start: LMCache caches chunk hashes per session,
        # and TensorRT-LLM request ids repeat after a restart.
        self._session_prefix = uuid.uuid4().hex[:12]
        self._requests: dict[int, RequestState] = {}
        self._claims = BlockClaims()
        self._reaped_scopes = ReapedScopes()
        self._parking: list[int] = []  # answered (n, True) since the last build_connector_meta
        self._reservations = PrefixReservations()
        """Prefix reservations TensorRT-LLM holds open (main's KVCacheManagerV2, ``reserve_prefix``)."""
        self._copied_loads: dict[int, tuple[str, tuple[int, ...], int, int, str, wire.SecuredLoad]] = {}
        """Reservations whose load ops went to the workers: ``release_secured``'s arguments, given back
        when the reservation closes (every rank has copied by then), not by rank 0's worker."""
        self._groups: GroupedLayout | None = None
        """Several layer groups, as the worker of this process registered them (``_layer_groups``)."""
        logger.info(
            "event=scheduler_ready backend=%s url=%s model=%s chunk=%d block=%d",
            self._settings.backend,
            self._settings.server_url,
            self._settings.model_name,
            self._chunk,
            self._block,
        )

    @property
    def backend(self) -> SchedulerClient:
        """The client this scheduler looks up, secures and releases loads through."""
        return self._backend

    def session_id(self, request_id: int) -> str:
        """The LMCache session a request's loads and stores run in (unique per engine start)."""
        return f"{self._session_prefix}-{request_id}"

    @property
    def tracked_request_ids(self) -> frozenset[int]:
        """Requests whose state the scheduler holds (live ones, until they end or vanish)."""
        return frozenset(self._requests)

    @property
    def parked_request_ids(self) -> frozenset[int]:
        """Parked requests whose asynchronous loads were issued, not yet back in ``new_requests``."""
        return self._claims.parked_request_ids

    def _state_for(self, request: Any, num_prompt_tokens: int) -> RequestState:
        rid = int(request.request_id)
        state = self._requests.get(rid)
        if state is None:
            table = prompt_table_digest(request)
            salt = key_salt(request, self._adapters.of(request), table)
            state = RequestState(
                request_id=rid,
                session_id=self.session_id(rid),
                salt=salt or "",
                num_prompt_tokens=num_prompt_tokens,
                cacheable=salt is not None,
                lora=lora_scope(request, table) if salt else None,
            )
            self._requests[rid] = state
        return state

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Step 2 (first context chunk, after device prefix reuse): tokens loadable beyond the device's.

        Returns ``(n, False)`` for a load copied in ``start_load_kv`` before the forward, or
        ``(n, True)`` for a long one (``planning.load_is_async``): TensorRT-LLM parks the request
        while the load runs and the batch goes on. A failed or slow lookup answers 0, so the
        engine simply computes.
        """
        return self._lookup_and_secure(request, num_computed_tokens, finished_by_every_rank=False)

    def _lookup_and_secure(
        self, request: Any, num_computed_tokens: int, *, finished_by_every_rank: bool
    ) -> tuple[int, bool]:
        tokens = prompt_tokens(request)
        state = self._state_for(request, len(tokens))
        if state.block_ids or state.secured is not None:
            self._start_over(state)  # asked again: its allocation was destroyed (a replay)
        state.llm_request = request
        state.tokens = tokens
        state.load = planning.NO_LOAD  # only this call's promise may turn into a load
        state.device_tokens = num_computed_tokens
        state.lookup_hit, state.lookup_failure, state.declined_as = None, None, "declined"
        if not state.cacheable:
            state.lookup_failure = "uncacheable"
            return 0, False
        end = planning.lookup_end(len(tokens), num_computed_tokens, self._chunk)
        if end == 0:
            state.lookup_hit = 0  # nothing past the device's prefix fills a whole chunk
            return 0, False
        token_ids = tuple(tokens)
        t0 = time.perf_counter()
        start, cap = planning.retrieve_bounds(len(tokens), num_computed_tokens, self._block, self._chunk)
        try:
            found = self._backend.lookup_and_secure(state.session_id, token_ids, end, state.salt, start, cap)
            hit = found.hit if found is not None else self._backend.lookup(state.session_id, token_ids, end, state.salt)
        except BackendError as exc:
            state.lookup_failure = "lookup_timeout" if exc.reason == "timeout" else "cache_unavailable"
            count_skip(self._metrics, exc)
            logger.debug("event=lookup_failed request=%d reason=%s", state.request_id, exc.reason)
            return 0, False
        self._metrics.record_lookup(time.perf_counter() - t0 - (found.prepare_s if found else 0.0), end, hit)
        state.lookup_hit = hit
        decision = planning.decide_load(len(tokens), num_computed_tokens, hit, self._block, self._chunk)
        if decision.loads and not self._load_pays(decision.matched_tokens):
            logger.debug("event=load_declined request=%d reason=slower_to_load tokens=%d",
                         state.request_id, decision.matched_tokens)  # fmt: skip
            decision, state.declined_as = planning.compute_instead(decision), "slower_to_load"
        if found is not None:
            decision = self._take_secured(state, token_ids, decision, found)
        else:
            decision = self._secure_apart(state, token_ids, decision)
        state.load = decision
        state.stored_upto = max(state.stored_upto, hit)
        logger.debug(
            "event=lookup request=%d prompt=%d device=%d queried=%d hit=%d matched=%d",
            state.request_id,
            len(tokens),
            num_computed_tokens,
            end,
            hit,
            decision.matched_tokens,
        )
        asynchronous = (
            decision.loads
            and self._layer_groups() is None
            and planning.load_is_async(
                decision.matched_tokens,
                self._settings.async_load_min_tokens,
                self._settings.world_size,
                self._settings.attention_dp,
                finished_by_every_rank,
            )
        )
        if asynchronous:
            self._parking.append(state.request_id)
        return decision.matched_tokens, asynchronous

    def _take_secured(self, state: RequestState, token_ids: tuple[int, ...], decision: planning.LoadDecision,
                      found: SecuredHit) -> planning.LoadDecision:  # fmt: skip
        """The decision, given what the secured lookup secured (its lookup locks are settled): the
        load keeps its chunks; a load declined, or one whose range was not secured, gives them back."""
        secured = found.load if (found.start, found.end) == (decision.retrieve_start, decision.retrieve_end) else None
        if decision.loads and secured is not None:
            state.secured = secured
            self.load_costs.secured(decision.matched_tokens, found.prepare_s)
            return decision
        if found.load is not None:
            self._backend.release_secured(state.session_id, token_ids[: found.end], found.start, found.end,
                                          state.salt, found.load)  # fmt: skip
        return planning.decline(decision) if decision.loads else decision

    def _secure_apart(self, state: RequestState, token_ids: tuple[int, ...],
                      decision: planning.LoadDecision) -> planning.LoadDecision:  # fmt: skip
        """The decision, after securing its load through a server without secured lookups, and the
        lookup locks outside the load freed."""
        if decision.loads:
            # Promise only what is secured: once the server handed out and locked the chunks, the
            # load is a local copy nothing can fail (TensorRT-LLM has no way to fail one request).
            t_secure = time.perf_counter()
            state.secured = self._backend.secure(
                state.session_id,
                token_ids[: decision.retrieve_end],  # the key of the load op, exactly (COMMIT matches on it)
                decision.retrieve_start,
                decision.retrieve_end,
                state.salt,
            )
            if state.secured is None:
                decision = planning.decline(decision)
            else:
                self.load_costs.secured(decision.matched_tokens, time.perf_counter() - t_secure)
        if decision.free_ranges:
            self._backend.free_lookup_locks(state.session_id, token_ids, decision.free_ranges, state.salt)
        return decision

    def _load_pays(self, tokens: int) -> bool:
        """The cost guard (``load_cost``): off, or not measured slower than computing ``tokens``."""
        settings = self._settings
        return not settings.load_cost_guard or self.load_costs.load_pays(tokens, settings.recompute_tokens_per_s)

    def reserve_prefix(self, request: Any, num_computed_tokens: int, reservation_id: int) -> tuple[int, bool]:
        """KVCacheManagerV2's prefix path (TensorRT-LLM main) in place of ``get_num_new_matched_tokens``:
        the same lookup, the hit secured (the server hands out and read-locks its chunks, so the source
        stays until the load copied it), open under ``reservation_id`` until every range of it is released.
        TensorRT-LLM finishes such a load once every rank reported it, so under tensor parallelism a
        long one is asynchronous too; its chunks go back when the reservation closes."""
        matched, asynchronous = self._lookup_and_secure(request, num_computed_tokens, finished_by_every_rank=True)
        if matched:
            self._reservations.open(reservation_id, int(request.request_id), num_computed_tokens,
                                    num_computed_tokens + matched)  # fmt: skip
        return matched, asynchronous

    def release_prefix_reservation(self, request: Any, reservation_id: int, start: int, end: int) -> None:
        """Tokens ``[start, end)`` of a reservation are no longer needed: a trimmed tail (the accepted
        load, the rest, is planned from ``prefix_loads``), or the whole of it once its load finished on
        every rank or was never started. A promise whose load was never planned goes back then."""
        closed = self._reservations.release(reservation_id, start, end)
        if not closed:
            return
        copied = self._copied_loads.pop(reservation_id, None)
        if copied is not None:  # every rank copied it: its chunks go back to the server now
            self._backend.release_secured(*copied)
            return
        state = self._requests.get(int(request.request_id))
        if state is None or state.accepted_reservation is not None or state.secured is None:
            return  # ended, accepted (its op is planned next), or its chunks are the workers' already
        self._release_promise(state)
        state.load = planning.NO_LOAD
        self._parking = [rid for rid in self._parking if rid != state.request_id]

    def _accept_prefix_load(self, load: Any, step: StepPlan) -> None:
        """A reservation's load as KVCacheManagerV2 accepted it: the pages it writes (every layer
        group's) and the range it copies; its op is planned with its request (``_plan_new`` for a
        synchronous load, ``_plan_parked`` for a parked one) and carries the reservation's id."""
        request_id = self._reservations.request_of(load.reservation_id)
        state = self._requests.get(request_id) if request_id is not None else None
        if state is None or state.secured is None:
            logger.error("event=prefix_load_unknown reservation=%d request=%d", load.reservation_id, load.request_id)
            step.settled_prefix_loads.append(load.reservation_id)  # nothing secured, nothing to copy
            return
        by_group = [list(ids) for ids in load.block_ids_by_layer_group]
        if self._layer_groups() is None:
            self._allocated(state.llm_request, by_group[0], [])
        else:
            self._allocated(state.llm_request, *self._split_groups(by_group))
        state.load = planning.accept(state.load, state.device_tokens, load.start, load.end, self._block)
        state.device_tokens = load.start
        state.accepted_reservation = load.reservation_id

    def _state_without_lookup(self, req: Any) -> RequestState:
        """State for a request reported without a live lookup state: one reaped while TensorRT-LLM
        still ran it gets its scope back; one never looked up (a dummy request) has no scope the
        connector could read (``RequestData`` carries no adapter or multimodal items) and is never
        saved."""
        rid = int(req.request_id)
        scope = self._reaped_scopes.take(rid)
        state = RequestState(
            request_id=rid,
            session_id=self.session_id(rid),
            salt=scope.salt if scope else "",
            num_prompt_tokens=len(req.new_tokens),
            cacheable=scope.cacheable if scope else False,
            lookup_failure=None if scope else "uncacheable",
            llm_request=scope.llm_request if scope else None,
            lora=scope.lora if scope else None,
        )
        self._requests[rid] = state
        return state

    def _layer_groups(self) -> GroupedLayout | None:
        if self._groups is None:
            self._groups = self._backend.layer_groups()
        return self._groups

    def _split_groups(self, by_layer_group: list[list[int]]) -> tuple[list[int], list[list[int]]]:
        """A per-layer-group report as the anchor group's pages and the other groups' (chunk order)."""
        groups = self._layer_groups()
        assert groups is not None, "per-layer-group pages before the worker registered its layer groups"
        anchor, *others = (list(by_layer_group[gid]) for gid in groups.group_ids)
        return anchor, others

    def _reported(self, req: Any) -> tuple[list[int], list[list[int]]]:
        """The pages one ``RequestData`` reports: the flat list, or with several layer groups (the flat
        list is then empty) the anchor group's and the other groups'."""
        by_group = getattr(req, "new_block_ids_by_layer_group", None)
        if by_group and self._layer_groups() is not None:
            return self._split_groups(by_group)
        return list(req.new_block_ids), []

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Step 2, right after allocation: remember the request's blocks (loads target them)."""
        self._allocated(request, list(block_ids), [])

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        """Step 2 with several layer groups (TensorRT-LLM calls it instead of the flat form)."""
        groups = self._layer_groups()
        if groups is None:  # one group: the flat form
            self._allocated(request, list(block_ids_by_layer_group[0]), [])
            return
        self._allocated(request, *self._split_groups(block_ids_by_layer_group))

    def _allocated(self, request: Any, block_ids: list[int], group_block_ids: list[list[int]]) -> None:
        state = self._requests.get(int(request.request_id))
        if state is not None:
            self._claims.unhold(state.request_id, state.block_ids)  # a second allocation replaces the first
            state.block_ids = block_ids
            state.group_block_ids = group_block_ids
            self._claims.hold(state.request_id, block_ids)

    def _start_over(self, state: RequestState) -> None:
        """A request asked again after its allocation was destroyed (MAX_UTILIZATION replay,
        ``reset_request_state``): its old blocks are no longer its own, an unused promise goes back."""
        self._claims.unhold(state.request_id, state.block_ids)
        state.block_ids, state.group_block_ids, state.tokens_with_kv = [], [], 0
        self._release_promise(state)
        self._parking = [rid for rid in self._parking if rid != state.request_id]

    def _release_promise(self, state: RequestState) -> None:
        if state.secured is not None:  # promised, never loaded
            load = state.load
            token_ids = tuple(state.tokens[: load.retrieve_end])
            self._backend.release_secured(
                state.session_id, token_ids, load.retrieve_start, load.retrieve_end, state.salt, state.secured
            )
            state.secured = None

    def _unpark(self, request_id: int) -> None:
        self._claims.unpark(request_id)
        self._backend.unpark_load(request_id)

    def _forget(self, request_id: int, *, ended: bool = True) -> RequestState | None:
        """Drop a request's state and its claim on blocks; end its LMCache session. A request not
        known to have ended (``ended`` False: reaped because its blocks went to another) keeps its
        key scope until its ``LlmRequest`` is finished, should TensorRT-LLM still run it."""
        self._unpark(request_id)
        self._backend.forget_saving(request_id)
        state = self._requests.pop(request_id, None)
        if ended:
            self._reaped_scopes.take(request_id)
        if state is None:
            return None
        if not ended and getattr(state.llm_request, "is_finished", False) is not True:
            self._reaped_scopes.keep(
                request_id, RequestScope(state.salt, state.cacheable, state.llm_request, state.lora)
            )
        self._claims.unhold(request_id, state.block_ids)
        self._release_promise(state)  # promised, never loaded (the request ended first)
        self._backend.end_session(state.session_id)
        return state

    def _reap_vanished(self, fresh: list[int], reused: list[int], owner: int) -> None:
        for rid in self._claims.vanished(fresh, reused, owner):
            self._forget(rid, ended=False)
            logger.debug("event=request_vanished request=%d", rid)

    def _reap_finished(self) -> list[int]:
        """Requests TensorRT-LLM finished without ``request_finished`` (1.2 and main free a cancelled
        or failed request at once, a parked one included): their state goes, and their blocks are
        returned: free now, this iteration's forward may write them unseen (an idle attention-DP
        rank's dummy request), so no queued save of them may outlive it and a parked one's load lands
        first. A request that finished normally was forgotten in ``request_finished`` before this runs."""
        freed: list[int] = []
        self._reaped_scopes.drop_finished()
        for rid, state in list(self._requests.items()):
            if getattr(state.llm_request, "is_finished", False) is True:
                self._forget(rid)
                freed.extend(self._held_pages(state))
                logger.debug("event=request_vanished request=%d reason=finished", rid)
        return freed

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> wire.ConnectorMetadata:
        """Step 3 (rank 0, then broadcast): loads for new requests, saves for every request with new full chunks."""
        step = StepPlan()
        step.fresh.update(self._reap_finished())
        for load in getattr(scheduler_output, "prefix_loads", None) or ():
            self._accept_prefix_load(load, step)
        parking, self._parking = self._parking, []
        for parked in [self._requests[rid] for rid in parking if rid in self._requests]:
            self._plan_parked(parked, step)
        for req in scheduler_output.new_requests:
            self._plan_new(req, step)
        for req in scheduler_output.cached_requests:
            self._plan_cached(req, step)
        reported = len(scheduler_output.new_requests) + len(scheduler_output.cached_requests) + self._claims.num_parked
        if planning.unseen_forward_may_write(self._settings.attention_dp, reported):
            step.fresh.update(self._forget_all_on_idle_rank())
        return step.metadata()

    def _first_report(self, step: StepPlan, block_ids: list[int], computed: int, request_id: int) -> None:
        """A request's blocks as first reported: the fresh and the device-reused ones go into ``step``,
        and other requests still naming them have vanished."""
        new_fresh = planning.fresh_blocks(block_ids, computed, self._block, True)
        new_reused = planning.reused_blocks(block_ids, computed, self._block)
        self._reap_vanished(new_fresh, new_reused, request_id)
        step.fresh.update(new_fresh)
        step.reused.update(new_reused)

    def _plan_parked(self, parked: RequestState, step: StepPlan) -> None:
        """A request parked this iteration (TensorRT-LLM leaves it out of scheduler_output): its load starts now."""
        self._first_report(step, parked.block_ids, parked.device_tokens, parked.request_id)
        # Parked, it is reported finished only through this op: issued even when TensorRT-LLM
        # honoured nothing (its copies are then none, its chunks go back when it "lands").
        load = self._honoured(parked)
        op = self._op(parked, load.retrieve_start, load.retrieve_end, load.skip_tokens, parked.secured)
        step.async_loads.append(op)
        parked.secured = None
        parked.accepted_reservation = None
        written = planning.written_blocks(op.block_ids, op.skip_tokens, self._block)
        self._claims.park(parked.request_id, written)
        self._backend.park_load(parked.request_id, parked.llm_request, frozenset(written))
        self._count_sources(parked, parked.device_tokens)
        parked.load = planning.NO_LOAD  # back in new_requests, its computed_position counts the load

    def _plan_new(self, req: Any, step: StepPlan) -> None:
        """A request scheduled for the first time (or back from parking): its load, its first save."""
        rid = int(req.request_id)
        block_ids, group_block_ids = self._reported(req)
        self._first_report(step, block_ids, req.computed_position, rid)
        step.fresh.update(self._fresh_pages(group_block_ids, req.computed_position, True))
        state = self._requests.get(rid)
        if state is None:
            state = self._state_without_lookup(req)
        self._unpark(rid)  # back from an asynchronous load: computed_position counts it
        state.tokens = list(req.new_tokens) if len(req.new_tokens) >= len(state.tokens) else state.tokens
        if not state.block_ids:
            state.block_ids, state.group_block_ids = block_ids, group_block_ids
            self._claims.hold(rid, state.block_ids)
        load = self._honoured(state)
        before = req.computed_position + load.matched_tokens
        if load.loads:
            step.loads.append(self._op(state, load.retrieve_start, load.retrieve_end, load.skip_tokens, state.secured))
            state.secured = None  # the workers copy it; rank 0 releases it after the iteration
        else:
            self._release_promise(state)  # promised, honoured for nothing
            if state.accepted_reservation is not None:
                step.settled_prefix_loads.append(state.accepted_reservation)
        state.accepted_reservation = None
        self._count_sources(state, req.computed_position)
        state.computed_why = planning.computed_reasons(
            state.num_prompt_tokens,
            before,
            state.lookup_hit,
            self._block,
            self._chunk,
            state.lookup_failure,
            state.declined_as,
        )
        self._step_computed(state, before, req.num_scheduled_tokens, step)
        self._plan_save(state, step.saves, before)

    def _held_pages(self, state: RequestState) -> list[int]:
        """Every page a request held, as page keys: the anchor group's blocks and the other groups'
        pages (an idle attention-DP rank's dummy request takes a page in every layer group)."""
        return [*state.block_ids, *self._fresh_pages(state.group_block_ids, 0, False)]

    def _fresh_pages(self, group_block_ids: list[list[int]], computed: int, first_report: bool) -> list[int]:
        """Other layer groups' pages of one report that were free before this iteration, as page keys."""
        return [
            page_key(g, slot)
            for g, ids in enumerate(group_block_ids, 1)
            for slot in planning.fresh_blocks(ids, computed, self._block, first_report)
            if slot >= 0
        ]

    def _plan_cached(self, req: Any, step: StepPlan) -> None:
        """A running request: its new tokens and blocks, and a save when they fill new chunks."""
        rid = int(req.request_id)
        block_ids, group_block_ids = self._reported(req)
        self._reap_vanished(block_ids, [], rid)
        step.fresh.update(block_ids)
        step.fresh.update(self._fresh_pages(group_block_ids, 0, False))
        state = self._requests.get(rid)
        if state is None:
            return
        state.tokens.extend(req.new_tokens)
        if group_block_ids and len(state.group_block_ids) != len(group_block_ids):
            # Its earlier pages in the other groups were never reported to this state: unknown, so
            # none of those blocks is ever saved (-1), never a guess.
            state.group_block_ids = [[-1] * len(state.block_ids) for _ in group_block_ids]
        state.block_ids.extend(block_ids)
        for ids, new in zip(state.group_block_ids, group_block_ids, strict=False):
            ids.extend(new)
        self._claims.hold(rid, block_ids)
        before = state.tokens_with_kv
        self._step_computed(state, before, req.num_scheduled_tokens, step)
        self._plan_save(state, step.saves, before)

    def _forget_all_on_idle_rank(self) -> list[int]:
        """An idle attention-DP rank's forward may write any free page unseen, in every layer group:
        every request still tracked ended without ``request_finished``; forget them all and return
        their pages."""
        freed: list[int] = []
        for rid in list(self._requests):
            vanished = self._forget(rid)
            if vanished is not None:
                freed.extend(self._held_pages(vanished))
                logger.debug("event=request_vanished request=%d reason=idle_dp_rank", rid)
        return freed

    def _honoured(self, state: RequestState) -> planning.LoadDecision:
        """The request's load as TensorRT-LLM took it: ``commit_new_matched_tokens`` records the
        honoured count on the ``LlmRequest`` (main; KVCacheManagerV2 may honour less than offered);
        TensorRT-LLM 1.2 has no such record and honours the whole offer."""
        honoured = getattr(state.llm_request, "py_num_connector_matched_tokens", None)
        if state.load.loads and isinstance(honoured, int) and honoured < state.load.matched_tokens:
            logger.debug(
                "event=load_honoured request=%d offered=%d honoured=%d",
                state.request_id,
                state.load.matched_tokens,
                honoured,
            )
            state.load = planning.honour(state.load, honoured, state.device_tokens)
        return state.load

    def _count_sources(self, state: RequestState, device_tokens: int) -> None:
        """Count a request's prompt tokens from the device and from the cache, once."""
        if state.sources_counted:
            return
        state.sources_counted = True
        self._metrics.record_prompt_tokens("device", "none", device_tokens)
        self._metrics.record_prompt_tokens("cache", "none", state.load.matched_tokens)

    def _step_computed(self, state: RequestState, before: int, num_scheduled_tokens: int, step: StepPlan) -> None:
        """Advance the request's KV by this step's forward pass; count the prompt tokens it computes."""
        state.tokens_with_kv = planning.tokens_with_kv_after_step(before, num_scheduled_tokens, len(state.tokens))
        if before < state.num_prompt_tokens:
            end = min(state.tokens_with_kv, state.num_prompt_tokens)
            step.computed_prompt_tokens += max(0, end - before)
            for reason, tokens in planning.split_computed(state.computed_why, before, end):
                self._metrics.record_prompt_tokens("computed", reason, tokens)

    def _plan_save(self, state: RequestState, saves: list[wire.TransferOp], history: int) -> None:
        """Store the request's new whole chunks; with several layer groups only those every group still
        holds a page for in this forward (``history``: tokens with KV before it)."""
        if not state.cacheable:
            return
        span = planning.plan_save(
            state.stored_upto,
            state.tokens_with_kv,
            len(state.block_ids) * self._block,
            state.num_prompt_tokens,
            self._chunk,
            self._settings.save_decode_tokens,
        )
        if span is None:
            return
        groups = self._layer_groups()
        if groups is not None and state.group_block_ids:
            live = [planning.first_live_block(history, g.window_size, self._block) for g in groups.groups[1:]]
            end = planning.grouped_save_end(span[0], span[1], state.group_block_ids, live, self._block, self._chunk)
            if end <= span[0]:
                return
            span = (span[0], end)
        saves.append(self._op(state, span[0], span[1], 0))
        state.stored_upto = span[1]
        if not state.saves_issued and state.llm_request is not None:
            self._backend.note_saving(state.request_id, state.llm_request)
        state.saves_issued += 1

    def _op(
        self,
        state: RequestState,
        start: int,
        end: int,
        skip: int,
        secured: wire.SecuredLoad | None = None,
    ) -> wire.TransferOp:
        copy_end = state.load.copy_end if secured is not None else None
        if secured is not None and state.accepted_reservation is not None:
            self._copied_loads[state.accepted_reservation] = (
                state.session_id,
                tuple(state.tokens[:end]),
                start,
                end,
                state.salt,
                secured,
            )
        last = end if copy_end is None else copy_end
        return wire.TransferOp(
            request_id=state.request_id,
            session_id=state.session_id,
            token_ids=tuple(state.tokens[:end]),
            start=start,
            end=end,
            block_ids=planning.block_slice(state.block_ids, start, last, self._block),
            skip_tokens=skip,
            salt=state.salt,
            lora=state.lora,
            secured=secured,
            copy_end=copy_end,
            reservation_id=state.accepted_reservation if secured is not None else None,
            group_block_ids=tuple(planning.block_slice(ids, start, last, self._block) for ids in state.group_block_ids),
        )

    def request_reset(self, request: Any) -> None:
        """KVCacheManagerV2 destroyed the request's allocation (MAX_UTILIZATION) and will replay it:
        its blocks are no longer its own and an unused promise goes back; it is asked again."""
        state = self._requests.get(int(request.request_id))
        if state is not None:
            self._start_over(state)

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        """Step 5 with several layer groups: as ``request_finished`` (the anchor group's pages)."""
        if self._layer_groups() is None:
            return self.request_finished(request, list(cache_block_ids_by_layer_group[0]))
        return self.request_finished(request, self._split_groups(cache_block_ids_by_layer_group)[0])

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Step 5: forget the request; True (hold its blocks) when it had saves: ``get_finished``
        reports it once they are copied and their COMMITs answered, on every rank (async or not)."""
        state = self._forget(int(request.request_id))
        if state is None:
            return False
        return state.saves_issued > 0
