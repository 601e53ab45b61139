"""The connector's worker hooks (TensorRT-LLM's ``KvCacheConnectorWorker``): KV copies between the pool and the cache."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kvoffload.connector import wire
from kvoffload.connector.backends.base import BackendError, KvGeometry, LoadResult, kv_geometry, read_hf_config
from kvoffload.connector.backends.blockcopy import GroupedPages
from kvoffload.connector.backends.layer_copies import LayerwiseLoad
from kvoffload.connector.layer_hooks import LayerHooks
from kvoffload.connector.layout import PoolLayoutError, describe_layer_groups, describe_pool
from kvoffload.connector.load_cost import MIN_PREFILL_SAMPLE_TOKENS
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.pipeline import OpPipeline
from kvoffload.connector.runtime import (
    ConnectorRole,
    KvCacheConnectorWorker,
    KvoffloadLoadError,
    backend_settings,
    count_skip,
    on_stream,
    order_after,
    stream_event,
    timing_event,
    use_private_stream,
)

if TYPE_CHECKING:  # built after the bundle made LMCache loadable (``start_worker_backend``)
    from kvoffload.connector.backends.engine_process import EngineProcess
    from kvoffload.connector.backends.worker_backend import WorkerBackend
    from kvoffload.connector.settings import ConnectorSettings

logger = logging.getLogger("kvoffload.connector")


def start_worker_backend(settings: ConnectorSettings, rank: int, metrics: ConnectorMetrics,
                         process: EngineProcess) -> WorkerBackend:  # fmt: skip
    """Rank ``rank``'s worker backend over the pod's sidecar or ``process``'s own cache server."""
    settings = backend_settings(process, settings)
    from kvoffload.connector.backends.worker_backend import WorkerBackend

    return WorkerBackend(settings, rank=rank, metrics=metrics, process=process)


class KvoffloadConnectorWorker(ConnectorRole, KvCacheConnectorWorker):
    """Every rank: moves KV between TensorRT-LLM's pool and the store."""

    supports_attention_dp = True
    """Under attention DP each rank's worker serves only its own scheduler's loads and saves, with
    its own backend client, against the pod's one cache (docs/connector.md, "Attention DP")."""

    def __init__(self, llm_args: Any) -> None:
        super().__init__(llm_args)
        self._start_role(llm_args, "worker")
        self._backend = start_worker_backend(self._settings, self._rank, self._metrics, self._process)
        self._copies = self._backend.copies
        # Async saves: one saver thread; a request is done once its stores ran and were COMMITted.
        self._saves = OpPipeline("save", self._save_async)
        self._saver_on_private_stream = False  # touched by the saver thread alone
        self._session_of: dict[int, str] = {}
        """Requests whose saves are queued, copying or not yet COMMITted, and their LMCache sessions."""
        self._unloaded: list[int] = []  # requests whose promised KV did not arrive this iteration
        self._finished_waiting: set[int] = set()
        self._loading_started: set[int] = set()  # parked requests TensorRT-LLM told us about (get_finished)
        self._loaded_async: set[int] = set()  # parked requests whose KV is in the pool, not yet reported
        self._finished_prefix_loads: list[int] = []
        """Prefix reservations whose loads finished here, not yet reported (``get_finished_prefix_loads``)."""
        # Async loads: one loader thread issues parked requests' copies, off the engine's thread,
        # each after an event on the engine's stream.
        self._loads = OpPipeline("load", self._issue_async_load, on_thread_start=self._loader_stream)
        self._failures_lock = threading.Lock()
        self._load_failures: list[tuple[wire.TransferOp, BackendError]] = []
        self._kv_device: Any = None
        self._forward_start: tuple[int, Any] | None = None
        self._forwards: list[tuple[int, Any, Any]] = []
        """Forward passes timed on the device (prompt tokens, start, end) until their end has passed."""
        self._layer_hooks: LayerHooks | None = None
        """The hook calls of each forward pass (set once a pool is registered): layer-wise loads' safety."""
        self._layerwise: LayerwiseLoad | None = None
        """This forward pass's layer-wise load: each layer waits for its span's mark."""
        self._layerwise_copying: list[tuple[LayerwiseLoad, list[tuple[wire.TransferOp, LoadResult]]]] = []
        """Layer-wise loads whose copy time is not known yet (their retrieve metrics and cost samples wait)."""
        self._saves_in_forward = False
        """Saves copy inside ``wait_for_save`` whatever ``async_save`` says: with layer groups a sliding
        group's pages behind its window go back to the pool right after this forward."""
        if self._settings.async_save:
            self._saves.start()

    @property
    def backend(self) -> WorkerBackend:
        """The backend this worker registers its pool with; it copies through ``backend.copies``."""
        return self._backend

    @property
    def loading_request_ids(self) -> frozenset[int]:
        """Parked requests whose asynchronous loads TensorRT-LLM started or that landed, not yet reported."""
        return frozenset(self._loading_started | self._loaded_async)

    @property
    def saving_request_ids(self) -> frozenset[int]:
        """Requests with an asynchronous save queued or copying."""
        return self._saves.pending_requests()

    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """Step 0 (once): register TensorRT-LLM's pool ``[num_blocks, num_layers, kv_factor, block_elems]``:
        key/value halves (``kv_factor`` 2) or multi-head latent attention's one latent (``kv_factor`` 1,
        ``layout``); a pool it cannot move is refused here, before any request."""
        try:
            pool_layout = describe_pool(tuple(kv_cache_tensor.shape), self._block)
        except PoolLayoutError as exc:
            raise RuntimeError(f"kvoffload: model {self._settings.model_name!r}: {exc}") from None
        if pool_layout.kind == "mla":  # one latent "head" of token_width; the HF config's heads do not apply
            geometry = KvGeometry(1, self._block, pool_layout.token_width // 2)
        else:
            geometry = kv_geometry(
                int(kv_cache_tensor.shape[-1]),
                self._block,
                read_hf_config(self._settings.model_name),
                self._settings.world_size,
            )
        self._kv_device = kv_cache_tensor.device
        self._backend.register(kv_cache_tensor, geometry, pool_layout)
        self._layer_hooks = LayerHooks(int(kv_cache_tensor.shape[1]))

    def register_kv_cache_layout(self, layout: Any) -> None:
        """Step 0 on TensorRT-LLM main with KVCacheManagerV2 (``connectors/kv_cache_layout.py``
        @ae7a7216). One full-attention layer group of one region is one pool
        (``as_single_pool_tensor``) and goes to ``register_kv_caches``. Several groups, or a sliding
        window, are moved as a ``layout.GroupedLayout``: every group's pages of a block in one chunk.
        What cannot be moved is refused here, at start, by name."""
        groups = tuple(getattr(layout, "groups", ()))
        if len(groups) == 1 and getattr(groups[0], "window_size", None) is None:
            single = getattr(layout, "as_single_pool_tensor", None)
            pool = single() if single is not None else None
            if pool is None:
                regions = len(getattr(groups[0], "regions", ()))
                raise RuntimeError(
                    f"kvoffload: this model's KV cache layout is not one pool of uniform pages (1 layer group, "
                    f"{regions} region(s) per page: block scales, layers of differing size or a page expansion "
                    "factor); the connector moves one region per page"
                )
            self.register_kv_caches(pool)
            return
        try:
            grouped = describe_layer_groups([
                (g.layer_group_id, g.window_size, len(g.layer_ids), [r.size for r in g.regions],
                 [b.expansion for r in g.regions for b in r.buffers])
                for g in groups
            ])  # fmt: skip
        except PoolLayoutError as exc:
            raise RuntimeError(f"kvoffload: model {self._settings.model_name!r}: {exc}") from None
        latent = [g.layer_group_id for g in groups if not any(b.role == "value" for r in g.regions for b in r.buffers)]
        if latent:
            raise RuntimeError(
                f"kvoffload: model {self._settings.model_name!r}: layer group(s) {latent} hold a latent (no value "
                "buffer) beside other groups; the connector serves multi-head latent attention as one group"
            )
        by_id = {g.layer_group_id: g for g in groups}
        pages = GroupedPages([by_id[gid].regions[0].as_tensor() for gid in grouped.group_ids])
        self._kv_device = pages.device
        self._backend.register_grouped(pages, grouped, layout.dtype)
        # KVCacheManagerV2 releases a sliding group's pages behind the window after each forward and may
        # hand them out before a saver thread copied them: saves copy within the forward's own hook.
        self._saves_in_forward = True
        logger.info(
            "event=registered_layer_groups model=%s groups=%s saves=in_forward loads=synchronous",
            self._settings.model_name,
            grouped.tag(),
        )

    def start_load_kv(self, stream: Any) -> None:
        """Step 3: fence queued saves off blocks handed out again, land asynchronous loads into blocks
        this forward touches, then copy every promised load in.

        Never raises (TensorRT-LLM runs this outside any try: an exception stops the engine).
        Each load's chunks were secured at lookup, so the copies are local and cannot fail. Where
        the engine was seen calling every layer's hook, the copies go layer-wise and this returns
        while they run (``wait_for_layer_load`` orders each layer after its own); else they are
        waited for here.
        """
        if self._layer_hooks is not None:
            self._layer_hooks.forward_started()
        self._layerwise = None  # a forward that failed before wait_for_save left its load here
        meta = self._metadata
        if not isinstance(meta, wire.ConnectorMetadata):
            return
        with on_stream(stream):  # copies follow the engine's earlier work; its next pass follows them
            if meta.fresh_blocks and self._saves.started:
                self._fence_saves(meta.fresh_blocks)
            if meta.fresh_blocks or meta.reused_blocks:
                self._fence_async_loads(meta.fresh_blocks | meta.reused_blocks)
            if meta.loads and self._layerwise_allowed(meta.loads):
                self._layerwise = self._copies.load_secured_by_layer(meta.loads)
            if self._layerwise is not None:
                self._issued_layerwise(meta.loads, self._layerwise)
            elif meta.loads:
                results = self._copies.load_secured(meta.loads)
                for op, result in zip(meta.loads, results, strict=True):
                    self._loaded(op, result)
                copied = [(op.num_tokens, r.seconds) for op, r in zip(meta.loads, results, strict=True) if not r.error]
                if copied:  # one batch of copies, waited for together
                    self.load_costs.copied(sum(n for n, _ in copied), max(s for _, s in copied))
        self._finished_prefix_loads.extend(op.reservation_id for op in meta.loads if op.reservation_id is not None)
        self._finished_prefix_loads.extend(meta.settled_prefix_loads)
        if meta.async_loads:
            self._queue_async_loads(meta.async_loads, stream_event(stream))
        # A prefill worth timing, after the loads; not one whose layers wait for a layer-wise load's
        # copies (its device time would count the copy as prefill).
        if meta.computed_prompt_tokens >= MIN_PREFILL_SAMPLE_TOKENS and self._layerwise is None:
            self._forward_start = (meta.computed_prompt_tokens, timing_event(stream))

    def _layerwise_allowed(self, loads: tuple[wire.TransferOp, ...]) -> bool:
        """Whether ``loads`` may be copied layer-wise: on, one rank (a load's chunks go back after
        every rank copied, which only a whole copy waited for here shows under tensor parallelism),
        no prefix reservation (TensorRT-LLM finishes one once ``start_load_kv`` reported it), and the
        engine seen waiting for every layer (``layer_hooks``)."""
        settings = self._settings
        return (
            settings.layerwise_loads
            and settings.world_size == 1
            and not settings.attention_dp
            and self._layer_hooks is not None
            and self._layer_hooks.layerwise_ready
            and all(op.reservation_id is None for op in loads)
        )

    def _issued_layerwise(self, loads: tuple[wire.TransferOp, ...], layerwise: LayerwiseLoad) -> None:
        """A layer-wise load's copies are issued: a failed op is reported now (the forward must not
        run on it), the others' time once their copies are done (``_record_layerwise_copies``)."""
        copying = []
        for op, result in zip(loads, layerwise.results, strict=True):
            if result.error is not None:
                self._loaded(op, result)
            else:
                copying.append((op, result))
        if copying:
            self._layerwise_copying.append((layerwise, copying))

    def _land_layerwise_loads(self) -> None:
        """The layer-wise loads of the forward pass just queued land before this returns (host-side):
        the engine's next ``prepare_resources`` may copy one of their blocks into another request
        (partial reuse, on by default) on a stream of its own, before any hook of ours runs. The
        forward pass itself already overlapped them on the device."""
        for layerwise, _ in self._layerwise_copying:
            layerwise.last_mark.wait()

    def _record_layerwise_copies(self) -> None:
        """Retrieve metrics and the cost guard's copy samples of layer-wise loads whose copies are done."""
        pending = []
        for layerwise, copied in self._layerwise_copying:
            seconds = layerwise.copy_timer.seconds()
            if seconds is None:
                pending.append((layerwise, copied))
                continue
            for op, result in copied:
                self._loaded(op, LoadResult(result.nbytes, seconds))
            self.load_costs.copied(sum(op.num_tokens for op, _ in copied), seconds)
        self._layerwise_copying = pending

    def _forward_ended(self, stream: Any) -> None:
        """The forward pass started in ``start_load_kv`` is queued up to here: its end is marked on the
        device, and its time read once that has passed (``_record_forwards``). A layer it ran without
        waiting for its layer-wise load fails the batch (``KvoffloadLoadError``)."""
        layerwise, self._layerwise = self._layerwise, None
        missing = self._layer_hooks.forward_ended(layerwise is not None) if self._layer_hooks is not None else []
        if layerwise is not None and missing:
            with on_stream(stream):  # whatever the engine queues next runs after the whole copy
                layerwise.last_mark.order_current_stream_after()
            logger.error("event=layerwise_load_unwaited layers=%s loads=off", missing[:8])
            raise KvoffloadLoadError(
                f"kvoffload: layers {missing[:8]} ran without wait_for_layer_load while their KV was being "
                "loaded; this batch must be failed (loads are copied whole from now on)"
            )
        started, self._forward_start = self._forward_start, None
        if started is not None and started[1] is not None:
            self._forwards.append((started[0], started[1], timing_event(stream)))

    def _record_forwards(self) -> None:
        """Give the cost guard the device time of every timed forward pass that has finished."""
        pending = []
        for tokens, start, end in self._forwards:
            if end.query():
                self.load_costs.computed(tokens, start.elapsed_time(end) / 1e3)
            else:
                pending.append((tokens, start, end))
        self._forwards = pending

    def _queue_async_loads(self, ops: tuple[wire.TransferOp, ...], event: Any) -> None:
        """Hand parked requests' loads to the loader thread, which issues their copies after ``event``
        on the device: a fresh block may still be written by a forward pass the engine queued before
        it freed the block (the overlap scheduler's extra step)."""
        self._loads.start()
        for _ in ops:
            self._copies.expect_async_load()
        self._loads.submit((op, event) for op in ops)

    def _loader_stream(self) -> None:
        use_private_stream(self._kv_device)  # ordered after the engine's stream only by each load's event

    def _issue_async_load(self, op: wire.TransferOp, event: Any) -> None:
        """Issue one asynchronous load's copies (after ``event`` on the device, if any); a failure is
        reported with the load (the request's first forward then fails it)."""
        try:
            if event is not None:
                order_after(event)
            error = self._copies.start_async_load(op)
        except Exception as exc:  # the loader must survive anything, or parked requests would wait forever
            logger.exception("event=load_error request=%d", op.request_id)
            error = BackendError("retrieve", "error", repr(exc))
        if error is not None:
            with self._failures_lock:
                self._load_failures.append((op, error))

    def _fence_async_loads(self, touched: frozenset[int]) -> None:
        """Before a forward that reads or writes ``touched`` blocks: every asynchronous load into one
        of them lands first.

        Such a load belongs to a parked request that was cancelled: TensorRT-LLM freed its blocks at
        once and stored them for reuse under its prompt, so the load is never dropped (a later request
        may match those blocks and read them). A queued one is issued now on the engine's stream (made
        current by ``start_load_kv``), one being issued is waited for, and the forward is ordered after
        the copies of issued ones on the device.
        """
        now: list[tuple[wire.TransferOp, Any]] = []
        self._loads.fence(touched, lambda op, event: now.append((op, event)))
        for op, _event in now:  # the engine's stream is current: these copies follow its earlier work
            self._issue_async_load(op, None)
        self._copies.order_after_async_loads(touched)

    def _land_abandoned_loads(self, blocks: frozenset[int]) -> None:
        """Loads of parked requests TensorRT-LLM finished (cancelled) while they ran land now, before
        its next ``prepare_resources``: that frees and stores their blocks for reuse, and may copy one
        into another request (partial reuse, copy-on-partial-reuse: both on by default) or hand it
        out, all before ``start_load_kv``'s fence. Queued ones are issued now; the wait is host-side,
        as the engine's copy may run on a stream of its own. Loads are asynchronous with one rank only
        (``planning.load_is_async``), whose worker shares this process with the scheduler that knows
        of the cancel."""
        self._fence_async_loads(blocks)
        self._copies.wait_async_loads(blocks)

    def _loaded(self, op: wire.TransferOp, result: LoadResult) -> None:
        if result.error is not None:
            logger.error("event=retrieve_failed request=%d reason=%s", op.request_id, result.error.reason)
            self._unloaded.append(op.request_id)
            return
        self._metrics.record_retrieve(result.seconds, op.num_tokens, result.nbytes)

    def _fence_saves(self, fresh: frozenset[int]) -> None:
        """Before a forward that may write ``fresh`` blocks: no queued save may read them afterwards.

        Such a save belongs to a request that ended without ``request_finished`` (its blocks went
        back to the pool): a queued one is dropped (its KV may already be another request's), one
        being copied right now is waited for (it read the blocks before this forward runs).
        """
        self._saves.fence(fresh, self._save_dropped)

    def _end_saves(self, requests: frozenset[int]) -> None:
        """Saves of requests TensorRT-LLM finished without ``request_finished`` (cancelled) end now,
        before its next ``prepare_resources``: that one may copy into a block they read (partial
        reuse, copy-on-partial-reuse: both on by default), before ``start_load_kv``'s fence. Queued
        ones are dropped; the one being copied is waited for (its copy and its stream's end). The
        scheduler that knows of the cancel shares this process with rank 0's worker only: under
        tensor parallelism the other ranks' saves still rely on ``start_load_kv``'s fence."""
        self._saves.fence_requests(requests, self._save_dropped)

    def _save_dropped(self, op: wire.TransferOp, event: Any) -> None:
        self._metrics.error("store", "blocks_reused")
        logger.debug("event=save_dropped request=%d reason=blocks_reused", op.request_id)

    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Per layer, before it runs: with a layer-wise load, the layer's work on ``stream`` waits
        (on the device) for the copies of its span of layers; otherwise the loads already finished
        in ``start_load_kv``.

        Loads are secured at lookup, so a load cannot fail for the server's sake; if one still did
        (a bug, or its segment unmapped), the forward must not run on the missing KV: raising here
        makes TensorRT-LLM fail the active requests (``_forward_step``), where raising in
        ``start_load_kv`` would stop the executor.
        """
        if self._unloaded:
            failed, self._unloaded = self._unloaded, []
            raise KvoffloadLoadError(f"kvoffload: KV load failed for requests {failed}; they must be failed, not run")
        if self._layer_hooks is not None:
            self._layer_hooks.waited(layer_idx)
        mark = self._layerwise.mark_for_layer(layer_idx) if self._layerwise is not None else None
        if mark is not None:
            with on_stream(stream):
                mark.order_current_stream_after()

    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Per layer, after it ran: nothing (a block spans all layers; saves run in ``wait_for_save``)."""

    def wait_for_save(self, stream: Any) -> None:
        """Step 4 (end of forward): store this iteration's new full chunks (or queue them when async)."""
        self._forward_ended(stream)
        meta = self._metadata
        if not isinstance(meta, wire.ConnectorMetadata) or not meta.saves:
            return
        if self._saves.started and not self._saves_in_forward:
            # The saver must not copy before the forward pass wrote the KV: its copies wait on this
            # event on the device, while its PREPAREs already go to the server.
            event = stream_event(stream)
            for op in meta.saves:
                self._session_of[op.request_id] = op.session_id
            self._saves.submit((op, event) for op in meta.saves)
            return
        with on_stream(stream):  # the copies wait for the forward pass that writes the KV, on its stream
            for op in meta.saves:
                self._session_of[op.request_id] = op.session_id  # reported once its COMMITs are answered
                self._store(op)

    def _store(self, op: wire.TransferOp) -> None:
        t0 = time.perf_counter()
        try:
            nbytes = self._copies.store(op)
        except BackendError as exc:
            count_skip(self._metrics, exc)
            logger.warning("event=store_failed request=%d reason=%s", op.request_id, exc.reason)
            return
        self._metrics.record_store(time.perf_counter() - t0, op.end - op.start, nbytes)

    def _save_async(self, op: wire.TransferOp, event: Any) -> None:
        """One queued save, on the saver thread (which starts before the pool is registered, so it
        takes its own stream at its first save)."""
        if not self._saver_on_private_stream:
            use_private_stream(self._kv_device)
            self._saver_on_private_stream = True
        if event is not None:
            order_after(event)
        self._store(op)

    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """Step 6: requests whose saves are done (copied and COMMITted), and parked requests whose
        KV is in the pool (each id only after TensorRT-LLM passed it in)."""
        self._land_layerwise_loads()
        self._copies.release_loaded()
        self._record_forwards()
        self._record_layerwise_copies()
        abandoned = self._copies.abandoned_load_blocks()
        if abandoned:
            self._land_abandoned_loads(abandoned)
        ended = self._copies.ended_saving_requests()
        if ended and self._saves.started:
            self._end_saves(ended)
        with self._failures_lock:
            failures, self._load_failures = self._load_failures, []
        for op, error in failures:  # reported as loaded: the request's first forward then fails it
            self._loaded(op, LoadResult(0, 0.0, error))
            self._landed(op)
        for op, result in self._copies.finished_async_loads():
            self._loaded(op, result)
            self.load_costs.copied(op.num_tokens, result.seconds)
            self._landed(op)
        self._loading_started.update(started_loading_req_ids)
        done_loading = sorted(self._loading_started & self._loaded_async)
        self._loading_started.difference_update(done_loading)
        self._loaded_async.difference_update(done_loading)
        # A save is done once copied and its COMMITs answered: lookups find it then, on every rank
        # (TensorRT-LLM waits for all ranks' reports). Requests that ended without
        # request_finished leave here too, once their saves are done.
        saving = self._saves.pending_requests()
        self._session_of = {
            rid: session
            for rid, session in self._session_of.items()
            if rid in saving or self._copies.commits_pending(session)
        }
        self._finished_waiting.update(finished_gen_req_ids)
        done = [rid for rid in self._finished_waiting if rid not in self._session_of]
        self._finished_waiting.difference_update(done)
        return done, done_loading

    def _landed(self, op: wire.TransferOp) -> None:
        """An asynchronous load is done here: reported by its reservation, or else by its request."""
        if op.reservation_id is not None:
            self._finished_prefix_loads.append(op.reservation_id)
        else:
            self._loaded_async.add(op.request_id)

    def get_finished_prefix_loads(self) -> list[int]:
        """Prefix reservations (TensorRT-LLM main) whose loads are done on this rank since the last
        call: a synchronous one once ``start_load_kv`` copied it, a parked one once its copies landed
        (found by ``get_finished``). TensorRT-LLM finishes a reservation when every rank reported it."""
        finished, self._finished_prefix_loads = self._finished_prefix_loads, []
        return finished

    def shutdown(self) -> None:
        """Release the backend and flush metrics (newer TensorRT-LLM calls this; the stand-in does too)."""
        self._backend.close()
        self._metrics.flush()
