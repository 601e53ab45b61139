"""TensorRT-LLM KV connector: the thin hooks TensorRT-LLM calls every step.

Enable it in a trtllm-serve options file::

    kv_cache_config: {enable_block_reuse: true}
    kv_connector_config:
      connector_module: kvoffload.connector.trtllm
      connector_scheduler_class: KvoffloadConnectorScheduler
      connector_worker_class: KvoffloadConnectorWorker

Each hook gathers its inputs, calls a pure function in ``planning`` and performs
the effect through a backend (``sidecar``: LMCache MP server in the pod;
``inprocess``: LMCache engine in this process). Decisions and their reasons are
in docs/connector.md.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from typing import Any

from kvoffload import contract
from kvoffload.connector import bundle, planning
from kvoffload.connector.backends.base import BackendError, KVBackend, kv_geometry, read_hf_config
from kvoffload.connector.keys import salt_of
from kvoffload.connector.metrics import ConnectorMetrics, metrics_for
from kvoffload.connector.settings import ConnectorSettings, parse_settings

try:
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
        SchedulerOutput,
    )
except ImportError:  # TensorRT-LLM 1.1/1.2 module path
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
        SchedulerOutput,
    )

logger = logging.getLogger("kvoffload.connector")


class KvoffloadLoadError(RuntimeError):
    """KV promised to TensorRT-LLM could not be loaded; the affected requests must fail, never run on garbage."""


def _rank() -> int:
    try:
        import tensorrt_llm

        return int(tensorrt_llm.mpi_rank())
    except (ImportError, AttributeError):
        return 0


def _make_backend(settings: ConnectorSettings, role: str, rank: int, metrics: ConnectorMetrics) -> KVBackend:
    bundle.prepare()  # the bundle's deps on sys.path, lmcache loadable here, or one clear error
    from kvoffload.connector.backends.cache_server import CacheServerBackend

    if settings.backend == contract.BACKEND_INPROCESS:
        from kvoffload.connector.backends.inprocess import inprocess_settings

        settings = inprocess_settings(settings)

    return CacheServerBackend(settings, rank=rank, role=role, metrics=metrics)


def _count_skip(metrics: ConnectorMetrics, exc: BackendError) -> None:
    """Count operations skipped because the backend is down (failures themselves are counted where they happen)."""
    if exc.reason == "unavailable":
        metrics.error(exc.operation, "unavailable")


def _use_private_stream(device: Any) -> None:
    """Make this thread's current CUDA stream its own (no-op off CUDA).

    The saver waits for the forward pass's event on the CPU; a backend then orders its copies after
    this thread's current stream, which must not be one the engine keeps queueing work on.
    """
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.set_stream(torch.cuda.Stream(device=device))


def _prompt_tokens(request: Any) -> list[int]:
    tokens = request.get_tokens(0)
    return list(tokens)


class KvoffloadConnectorScheduler(KvCacheConnectorScheduler):
    """Rank-0 half: lookups, and which blocks to load and save each iteration."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._settings = parse_settings(os.environ, llm_args)
        self._metrics = metrics_for(self._settings)
        self._backend = _make_backend(self._settings, "scheduler", 0, self._metrics)
        self._block = self._settings.tokens_per_block
        self._chunk = self._backend.chunk_size
        # Session ids are unique per engine start: LMCache caches chunk hashes per session,
        # and TensorRT-LLM request ids repeat after a restart.
        self._session_prefix = uuid.uuid4().hex[:12]
        self._requests: dict[int, planning.RequestState] = {}
        # block id -> live requests listing it: a block handed out again names requests that ended
        # without request_finished (cancelled, errored, aborted), whose state is then reaped.
        self._holders: dict[int, set[int]] = {}
        logger.info(
            "event=scheduler_ready backend=%s url=%s model=%s chunk=%d block=%d",
            self._settings.backend,
            self._settings.server_url,
            self._settings.model_name,
            self._chunk,
            self._block,
        )

    def _state_for(self, request: Any, num_prompt_tokens: int) -> planning.RequestState:
        rid = int(request.request_id)
        state = self._requests.get(rid)
        if state is None:
            state = planning.RequestState(
                request_id=rid,
                session_id=f"{self._session_prefix}-{rid}",
                salt=salt_of(request),
                num_prompt_tokens=num_prompt_tokens,
            )
            self._requests[rid] = state
        return state

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Step 2 (first context chunk, after device prefix reuse): tokens loadable beyond the device's.

        Returns ``(n, False)``: the load is synchronous in ``start_load_kv``. A failed
        or slow lookup answers 0, so the engine simply computes.
        """
        tokens = _prompt_tokens(request)
        state = self._state_for(request, len(tokens))
        state.tokens = tokens
        state.load = planning.NO_LOAD  # only this call's promise may turn into a load
        end = planning.lookup_end(len(tokens), num_computed_tokens, self._chunk)
        if end == 0:
            return 0, False
        token_ids = tuple(tokens)
        m = self._metrics
        t0 = time.perf_counter()
        try:
            hit = self._backend.lookup(state.session_id, token_ids, end, state.salt)
        except BackendError as exc:
            _count_skip(self._metrics, exc)
            logger.debug("event=lookup_failed request=%d reason=%s", state.request_id, exc.reason)
            return 0, False
        m.record_lookup(time.perf_counter() - t0, end, hit)
        decision = planning.decide_load(len(tokens), num_computed_tokens, hit, self._block, self._chunk)
        if decision.loads:
            # Promise only what is secured: once the server handed out and locked the chunks, the
            # load is a local copy nothing can fail (TensorRT-LLM has no way to fail one request).
            state.secured = self._backend.secure(
                state.session_id,
                token_ids[: decision.retrieve_end],  # the key of the load op, exactly (COMMIT matches on it)
                decision.retrieve_start,
                decision.retrieve_end,
                state.salt,
            )
            if state.secured is None:
                decision = planning.decline(decision)
        if decision.free_ranges:
            self._backend.free_lookup_locks(state.session_id, token_ids, decision.free_ranges, state.salt)
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
        return decision.matched_tokens, False

    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Step 2, right after allocation: remember the request's blocks (loads target them)."""
        state = self._requests.get(int(request.request_id))
        if state is not None:
            state.block_ids = list(block_ids)
            self._hold(state.request_id, block_ids)

    def _hold(self, request_id: int, block_ids: list[int]) -> None:
        for block in block_ids:
            self._holders.setdefault(block, set()).add(request_id)

    def _forget(self, request_id: int) -> planning.RequestState | None:
        """Drop a request's state and its claim on blocks; end its LMCache session."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return None
        for block in state.block_ids:
            holders = self._holders.get(block)
            if holders is not None:
                holders.discard(request_id)
                if not holders:
                    del self._holders[block]
        if state.secured is not None:  # promised, never loaded (the request ended first)
            load = state.load
            token_ids = tuple(state.tokens[: load.retrieve_end])
            self._backend.release_secured(
                state.session_id, token_ids, load.retrieve_start, load.retrieve_end, state.salt
            )
        self._backend.end_session(state.session_id)
        return state

    def _reap_vanished(self, fresh: list[int], owner: int) -> None:
        for rid in planning.vanished_holders(fresh, self._holders, owner):
            self._forget(rid)
            logger.debug("event=request_vanished request=%d", rid)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> planning.ConnectorMetadata:
        """Step 3 (rank 0, then broadcast): loads for new requests, saves for every request with new full chunks."""
        loads: list[planning.TransferOp] = []
        saves: list[planning.TransferOp] = []
        fresh: set[int] = set()
        for req in scheduler_output.new_requests:
            rid = int(req.request_id)
            new_fresh = planning.fresh_blocks(req.new_block_ids, req.computed_position, self._block, True)
            self._reap_vanished(new_fresh, rid)
            fresh.update(new_fresh)
            state = self._requests.get(rid)
            if state is None:  # never looked up (e.g. dummy request): still save it
                state = self._state_for(req, len(req.new_tokens))
            state.tokens = list(req.new_tokens) if len(req.new_tokens) >= len(state.tokens) else state.tokens
            if not state.block_ids:
                state.block_ids = list(req.new_block_ids)
                self._hold(rid, state.block_ids)
            before = req.computed_position + state.load.matched_tokens
            if state.load.loads:
                load = state.load
                loads.append(self._op(state, load.retrieve_start, load.retrieve_end, load.skip_tokens, state.secured))
                state.secured = None  # the workers copy it; rank 0 releases it after the iteration
            state.tokens_with_kv = planning.tokens_with_kv_after_step(
                before, req.num_scheduled_tokens, len(state.tokens)
            )
            self._plan_save(state, saves)
        for req in scheduler_output.cached_requests:
            rid = int(req.request_id)
            self._reap_vanished(list(req.new_block_ids), rid)
            fresh.update(req.new_block_ids)
            state = self._requests.get(rid)
            if state is None:
                continue
            state.tokens.extend(req.new_tokens)
            state.block_ids.extend(req.new_block_ids)
            self._hold(rid, list(req.new_block_ids))
            state.tokens_with_kv = planning.tokens_with_kv_after_step(
                state.tokens_with_kv, req.num_scheduled_tokens, len(state.tokens)
            )
            self._plan_save(state, saves)
        return planning.ConnectorMetadata(loads=tuple(loads), saves=tuple(saves), fresh_blocks=frozenset(fresh))

    def _plan_save(self, state: planning.RequestState, saves: list[planning.TransferOp]) -> None:
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
        saves.append(self._op(state, span[0], span[1], 0))
        state.stored_upto = span[1]
        state.saves_issued += 1

    def _op(
        self,
        state: planning.RequestState,
        start: int,
        end: int,
        skip: int,
        secured: planning.SecuredLoad | None = None,
    ) -> planning.TransferOp:
        return planning.TransferOp(
            request_id=state.request_id,
            session_id=state.session_id,
            token_ids=tuple(state.tokens[:end]),
            start=start,
            end=end,
            block_ids=planning.block_slice(state.block_ids, start, end, self._block),
            skip_tokens=skip,
            salt=state.salt,
            secured=secured,
        )

    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """Step 5: forget the request; True (hold its blocks) only when async saves may still be running."""
        state = self._forget(int(request.request_id))
        if state is None:
            return False
        return self._settings.async_save and state.saves_issued > 0


class KvoffloadConnectorWorker(KvCacheConnectorWorker):
    """Every rank: moves KV between TensorRT-LLM's pool and the store."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._settings = parse_settings(os.environ, llm_args)
        self._rank = _rank()
        self._metrics = metrics_for(self._settings)
        self._backend = _make_backend(self._settings, "worker", self._rank, self._metrics)
        self._block = self._settings.tokens_per_block
        # Async saves: one background thread; request ids wait in _saving until their stores ran.
        self._save_queue: deque[tuple[planning.TransferOp, Any]] = deque()
        self._save_cv = threading.Condition()
        self._saving: dict[int, int] = {}
        self._storing: planning.TransferOp | None = None  # the op the saver is working on
        self._unloaded: list[int] = []  # requests whose promised KV did not arrive this iteration
        self._finished_waiting: set[int] = set()
        self._save_thread: threading.Thread | None = None
        self._kv_device: Any = None
        if self._settings.async_save:
            self._save_thread = threading.Thread(target=self._save_loop, name="kvoffload-save", daemon=True)
            self._save_thread.start()

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """Step 0 (once): register TensorRT-LLM's pool ``[num_blocks, num_layers, kv_factor, heads*block*head_dim]``."""
        geometry = kv_geometry(
            int(kv_cache_tensor.shape[-1]),
            self._block,
            read_hf_config(self._settings.model_name),
            self._settings.world_size,
        )
        self._kv_device = kv_cache_tensor.device
        self._backend.register(kv_cache_tensor, geometry)

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Step 0 on TensorRT-LLM main with KVCacheManagerV2: one layer group is one pool and goes to
        ``register_kv_caches`` (TensorRT-LLM's default); several are refused here, at start, by name."""
        groups = tuple(getattr(layout, "groups", ()))
        if len(groups) > 1:
            windows = sorted({str(getattr(g, "window_size", None) or "full") for g in groups})
            raise RuntimeError(
                f"kvoffload: this model's KV cache has {len(groups)} layer groups (attention windows: "
                f"{', '.join(windows)}), as variable sliding-window or hybrid attention models do; the "
                "connector moves one pool of uniform blocks: use it with models of one attention window"
            )
        default = getattr(super(), "register_kv_cache_layout", None)
        if default is None:
            raise RuntimeError("kvoffload: register_kv_cache_layout called by a TensorRT-LLM without layouts")
        default(layout)

    def start_load_kv(self, stream: Any) -> None:
        """Step 3: fence queued saves off blocks handed out again, then copy every promised load in.

        Never raises (TensorRT-LLM runs this outside any try: an exception stops the engine).
        Each load's chunks were secured at lookup, so the copies are local and cannot fail.
        """
        meta = self._metadata
        if not isinstance(meta, planning.ConnectorMetadata):
            return
        if meta.fresh_blocks and self._save_thread is not None:
            self._fence_saves(meta.fresh_blocks)
        if not meta.loads:
            return
        m = self._metrics
        for op, result in zip(meta.loads, self._backend.load_secured(meta.loads), strict=True):
            if result.error is not None:
                logger.error("event=retrieve_failed request=%d reason=%s", op.request_id, result.error.reason)
                self._unloaded.append(op.request_id)
                continue
            m.record_retrieve(result.seconds, op.num_tokens, result.nbytes)

    def _fence_saves(self, fresh: frozenset[int]) -> None:
        """Before a forward that may write ``fresh`` blocks: no queued save may read them afterwards.

        Such a save belongs to a request that ended without ``request_finished`` (its blocks went
        back to the pool): a queued one is dropped (its KV may already be another request's), one
        being copied right now is waited for (it read the blocks before this forward runs).
        """
        with self._save_cv:
            keep: deque[tuple[planning.TransferOp, Any]] = deque()
            for op, event in self._save_queue:
                if fresh.isdisjoint(op.block_ids):
                    keep.append((op, event))
                    continue
                self._metrics.error("store", "blocks_reused")
                self._save_done(op.request_id)
                logger.debug("event=save_dropped request=%d reason=blocks_reused", op.request_id)
            self._save_queue = keep
            self._save_cv.wait_for(lambda: self._storing is None or fresh.isdisjoint(self._storing.block_ids))

    def _save_done(self, request_id: int) -> None:
        """One save of ``request_id`` ran or was dropped (called with ``_save_cv`` held)."""
        left = self._saving.get(request_id, 1) - 1
        if left <= 0:
            self._saving.pop(request_id, None)
        else:
            self._saving[request_id] = left

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Per layer, before it runs: nothing to wait for (loads finished in ``start_load_kv``).

        Loads are secured at lookup, so a load cannot fail for the server's sake; if one still did
        (a bug, or its segment unmapped), the forward must not run on the missing KV: raising here
        makes TensorRT-LLM fail the active requests (``_forward_step``), where raising in
        ``start_load_kv`` would stop the executor.
        """
        if self._unloaded:
            failed, self._unloaded = self._unloaded, []
            raise KvoffloadLoadError(f"kvoffload: KV load failed for requests {failed}; they must be failed, not run")

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Per layer, after it ran: nothing (a block spans all layers; saves run in ``wait_for_save``)."""

    def wait_for_save(self, stream: Any) -> None:
        """Step 4 (end of forward): store this iteration's new full chunks (or queue them when async)."""
        meta = self._metadata
        if not isinstance(meta, planning.ConnectorMetadata) or not meta.saves:
            return
        if self._save_thread is not None:
            # The saver must not copy before the forward pass wrote the KV: it waits on this event.
            event = stream.record_event() if stream is not None and hasattr(stream, "record_event") else None
            with self._save_cv:
                for op in meta.saves:
                    self._saving[op.request_id] = self._saving.get(op.request_id, 0) + 1
                    self._save_queue.append((op, event))
                self._save_cv.notify_all()
            return
        for op in meta.saves:
            self._store(op)

    def _store(self, op: planning.TransferOp) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = self._backend.store(op)
        except BackendError as exc:
            _count_skip(self._metrics, exc)
            logger.warning("event=store_failed request=%d reason=%s", op.request_id, exc.reason)
            return
        self._metrics.record_store(time.perf_counter() - t0, op.end - op.start, nbytes)

    def _save_loop(self) -> None:
        on_private_stream = False
        while True:
            with self._save_cv:
                while not self._save_queue:
                    self._save_cv.wait()
                op, event = self._save_queue.popleft()
                self._storing = op
            try:
                if not on_private_stream:
                    _use_private_stream(self._kv_device)
                    on_private_stream = True
                if event is not None:
                    event.synchronize()
                self._store(op)
            except Exception:  # the saver must survive anything, or finished requests would wait forever
                logger.exception("event=save_error request=%d", op.request_id)
            finally:
                with self._save_cv:
                    self._storing = None
                    self._save_done(op.request_id)
                    self._save_cv.notify_all()

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """Step 6: requests whose async saves are done (loads are synchronous, never reported)."""
        self._backend.release_loaded()
        if self._save_thread is None:
            return [], []
        with self._save_cv:
            self._finished_waiting.update(finished_gen_req_ids)
            done = [rid for rid in self._finished_waiting if rid not in self._saving]
            self._finished_waiting.difference_update(done)
        return done, []

    def shutdown(self) -> None:
        """Release the backend and flush metrics (newer TensorRT-LLM calls this; the stand-in does too)."""
        self._backend.close()
        self._metrics.flush()
