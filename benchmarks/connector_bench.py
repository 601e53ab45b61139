"""CPU benchmarks of the connector against a real ``lmcache server``: per-operation overhead and transfer.

``connector_overhead``: lookup / retrieve / store of one LMCache chunk, each at four levels, all
interleaved in the same run against the same server:

* ``raw``: the LMCache 0.5.6 client calls the sidecar backend wraps, called directly (LOOKUP +
  WAIT_PREFETCH_STATUS; PREPARE -> ``blockcopy`` -> COMMIT with a transfer context of our own);
* ``lmcache_copies``: the same protocol through LMCache's own ``submit_store``/``submit_retrieve``
  (its gather/scatter: what LMCache ships), for retrieve and store;
* ``backend``: ``SchedulerClient.lookup`` and ``WorkerBackend.copies.retrieve/store`` (the wrapper: timeouts, lock, keys);
* ``hook_metrics_off`` / ``hook_metrics_on``: the TensorRT-LLM hook that performs the operation
  (``get_num_new_matched_tokens``, ``start_load_kv``, synchronous ``wait_for_save``), with
  ``KVOFFLOAD_METRICS_ENABLED`` false / true (prometheus_client multiprocess mode).

``cpu_transfer``: store/retrieve GB/s of the sidecar shared-memory path for a TensorRT-LLM-layout
CPU pool at a few sizes, next to a plain ``copy_`` of the same bytes (the ceiling here), our block
copies alone (no server) and LMCache's own copies.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import best_ns_per_call, env_set, interleaved, scattered_block_ids, standin_on_path, summarize
from kvoffload.connector.keys import cache_model_name, chunk_layout

MODEL = "bench-model"
"""The model name in LMCache keys, as the connector writes it (the raw client must find its chunks)."""
KV_NAME = "trtllm_kv_pool"
QUEUED_COMMITS = 8
"""Unrelated store COMMITs queued when a lookup + secure is timed (``lookup_beside_commits``)."""


@dataclass(frozen=True)
class PoolShape:
    """A TensorRT-LLM KV pool ``[blocks, layers, 2, heads*tokens_per_block*head_dim]`` fp16 on CPU."""

    layers: int
    heads: int
    head_dim: int
    tokens_per_block: int
    chunk: int

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.heads * self.head_dim * 2

    @property
    def key_model(self) -> str:
        """The model name the connector keys this pool's chunks under."""
        return cache_model_name(
            MODEL, chunk_layout("float16", self.tokens_per_block, self.bytes_per_token * self.tokens_per_block)
        )

    def describe(self) -> str:
        return (
            f"{self.layers} layers, {self.heads} KV heads, head_dim {self.head_dim}, fp16, "
            f"{self.tokens_per_block} tokens/block, LMCache chunk {self.chunk} tokens "
            f"({self.bytes_per_token // 1024} KiB/token)"
        )


# One KV "head" of 256: the geometry the hooks derive for a pool without a model config, so every
# variant writes and reads chunks in the same layout (stores and retrieves are checked bit-exact).
OVERHEAD_SHAPE = PoolShape(layers=4, heads=1, head_dim=256, tokens_per_block=16, chunk=256)
TRANSFER_SHAPE = PoolShape(layers=8, heads=8, head_dim=128, tokens_per_block=16, chunk=256)


def _pool(shape: PoolShape, num_blocks: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(7)
    block_elems = shape.heads * shape.tokens_per_block * shape.head_dim
    raw = torch.randint(-1000, 1000, (num_blocks, shape.layers, 2, block_elems), dtype=torch.int16, generator=gen)
    return raw.view(torch.float16)


def _prompt(seed: int, length: int) -> tuple[int, ...]:
    from tests.support.trtllm_executor import make_prompt

    return tuple(make_prompt(seed, length))


@contextlib.contextmanager
def _server(chunk: int, l1_gb: float) -> Iterator[Any]:
    from tests.support.lmcache_server import LMCacheServer

    server = LMCacheServer(chunk_size=chunk, log_dir=Path(tempfile.mkdtemp(prefix="kvo-bench-")), l1_size_gb=l1_gb)
    server.start()
    try:
        yield server
    finally:
        server.stop()


class RawClient:
    """LMCache 0.5.6's client API used directly: the calls ``SchedulerClient`` and ``WorkerBackend`` wrap."""

    def __init__(self, url: str, shape: PoolShape, pool: Any | None) -> None:
        import zmq
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        from kvoffload.connector.backends.base import instance_id

        self.shape = shape
        self.pool: Any = pool
        self._zmq = zmq.Context()
        self._zmq.setsockopt(zmq.LINGER, 0)
        self.client: Any = RequestClientFactory.create(url, context=self._zmq)
        self.instance_id = instance_id()
        self.transfer: Any = None
        self.bpc = shape.chunk // shape.tokens_per_block
        if pool is not None:
            from lmcache.utils import EngineType
            from lmcache.v1.multiprocess.transfer_context import MPTransferMode, create_transfer_context

            kv = {KV_NAME: pool}
            self.transfer = create_transfer_context(
                kv, instance_id=self.instance_id, req_client=self.client, mode=MPTransferMode.ENGINE_DRIVEN
            )
            hints = {
                "kv_layout": "HND",
                "num_kv_heads": shape.heads,
                "tokens_per_block": shape.tokens_per_block,
                "head_dim": shape.head_dim,
            }
            self.transfer.register(
                kv, shape.key_model, 1, self.bpc, 60.0, layout_hints=hints, engine_type=EngineType.TRTLLM
            )
            self.transfer.engine_driven_context.mq_timeout = 60.0

    def key(self, session: str, tokens: tuple[int, ...], start: int, end: int, worker: bool, salt: str = "") -> Any:
        """The connector's own key for these tokens (``ChunkKeys``), so both sides name chunks alike."""
        from kvoffload.connector.backends.chunk_keys import ChunkKeys

        keys = ChunkKeys(world_size=1, rank=0)
        keys.model = self.shape.key_model
        return keys.key(session, tokens, start, end, salt, worker)

    def lookup(self, session: str, tokens: tuple[int, ...], end: int, salt: str = "") -> int:
        self.client.lookup(self.key(session, tokens, 0, end, False, salt), 1)
        return int(self.client.wait_prefetch_status(session, 5.0).result(timeout=6.0) or 0) * self.shape.chunk

    def free(self, session: str, tokens: tuple[int, ...], end: int, salt: str = "") -> None:
        self.client.free_lookup_locks(self.key(session, tokens, 0, end, False, salt), 1)
        self.client.end_session(session)

    def store_protocol(self, session: str, tokens: tuple[int, ...], blocks: tuple[int, ...]) -> bool:
        """PREPARE_STORE -> our block copies into the SHM slots -> COMMIT_STORE."""
        from kvoffload.connector.backends.blockcopy import gather_chunk

        edc = self.transfer.engine_driven_context
        key = self.key(session, tokens, 0, len(tokens), True)
        slots, indices = edc.prepare_store(key, self.instance_id)
        for slot, i in zip(slots, indices, strict=False):
            gather_chunk(self.pool, blocks[i * self.bpc : (i + 1) * self.bpc], slot)
        return bool(edc.commit_store(key, self.instance_id, []))

    def retrieve_protocol(self, session: str, tokens: tuple[int, ...], blocks: tuple[int, ...]) -> bool:
        """PREPARE_RETRIEVE -> our block copies out of the SHM slots -> COMMIT_RETRIEVE."""
        from kvoffload.connector.backends.blockcopy import scatter_chunk

        edc = self.transfer.engine_driven_context
        key = self.key(session, tokens, 0, len(tokens), True)
        chunks = edc.prepare_retrieve(key, self.instance_id)
        try:
            for i, chunk in enumerate(chunks or []):
                scatter_chunk(self.pool, blocks[i * self.bpc : (i + 1) * self.bpc], chunk, 0)
        finally:
            edc.commit_retrieve(key, self.instance_id)
        return chunks is not None

    def store_lmcache(self, session: str, tokens: tuple[int, ...], blocks: tuple[int, ...]) -> bool:
        """LMCache's own engine-driven store (its gather)."""
        key = self.key(session, tokens, 0, len(tokens), True)
        future = self.transfer.submit_store(session, key, {KV_NAME: self.pool}, [list(blocks)], None, self.bpc)
        return bool(future.result(timeout=60))

    def retrieve_lmcache(self, session: str, tokens: tuple[int, ...], blocks: tuple[int, ...]) -> bool:
        """LMCache's own engine-driven retrieve (its scatter)."""
        key = self.key(session, tokens, 0, len(tokens), True)
        future = self.transfer.submit_retrieve(
            session, key, {KV_NAME: self.pool}, [list(blocks)], None, self.bpc, skip_first_n_tokens=0
        )
        return bool(future.result(timeout=60))

    def close(self) -> None:
        if self.transfer is not None:
            with contextlib.suppress(Exception):
                future = self.transfer.unregister()
                if future is not None:
                    future.result(timeout=1.0)
            self.transfer.close()
        self.client.close()


def _settings(url: str, shape: PoolShape, env: dict[str, str] | None = None) -> Any:
    from kvoffload.connector.settings import parse_settings
    from tests.support.trtllm_executor import connector_llm_args

    base = {
        "KVOFFLOAD_MODEL_NAME": MODEL,
        "KVOFFLOAD_STORE_TIMEOUT_MS": "60000",
        "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "60000",
        "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "5000",
    }
    return parse_settings({**base, **(env or {})}, connector_llm_args(MODEL, url, block=shape.tokens_per_block))


def _hook_env(url: str, metrics: bool) -> dict[str, str]:
    return {
        "KVOFFLOAD_SERVER_URL": url,
        "KVOFFLOAD_MODEL_NAME": MODEL,
        "KVOFFLOAD_METRICS_ENABLED": "true" if metrics else "false",
        "KVOFFLOAD_ASYNC_SAVE": "false",  # the hook performs the store itself, so it can be timed
        "KVOFFLOAD_ASYNC_LOAD_MIN_TOKENS": "0",  # and start_load_kv the load
        "KVOFFLOAD_STORE_TIMEOUT_MS": "60000",
        "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "60000",
        "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "5000",
    }


def connector_overhead(reps: int, warmup: int = 3) -> dict[str, Any]:
    """Per-operation cost of one chunk at each level (raw client -> backend -> hook, metrics off/on)."""
    standin_on_path()
    import torch
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData, SchedulerOutput

    from kvoffload.connector.backends.base import KvGeometry
    from kvoffload.connector.backends.scheduler_client import SchedulerClient
    from kvoffload.connector.backends.worker_backend import WorkerBackend
    from kvoffload.connector.metrics import ConnectorMetrics
    from kvoffload.connector.runtime import KvoffloadLoadError, engine_process
    from kvoffload.connector.trtllm import KvoffloadConnectorScheduler, KvoffloadConnectorWorker
    from kvoffload.connector.wire import ConnectorMetadata, TransferOp
    from tests.support.trtllm_executor import PromptRequest, StandinLlmRequest, connector_llm_args

    shape = OVERHEAD_SHAPE
    chunk, bpc = shape.chunk, shape.chunk // shape.tokens_per_block
    geometry = KvGeometry(shape.heads, shape.tokens_per_block, shape.head_dim)
    pool = _pool(shape, num_blocks=4 * bpc)
    src, dst = tuple(range(bpc)), tuple(range(bpc, 2 * bpc))
    chunk_bytes = chunk * shape.bytes_per_token
    beside_reps = max(10, reps // 3)
    # Enough L1 for every stored chunk (no eviction during the run).
    stored_chunks = 5 * (reps + warmup) + QUEUED_COMMITS * (beside_reps + warmup) + 16
    l1_gb = max(0.5, round(stored_chunks * chunk_bytes / 2**30 * 1.3, 2))
    with _server(chunk, l1_gb) as server:
        url = server.url
        off = ConnectorMetrics(MODEL, "sidecar", enabled=False)
        raw = RawClient(url, shape, pool)
        backend = WorkerBackend(_settings(url, shape), rank=0, metrics=off, process=engine_process())
        backend.register(pool, geometry)
        sched_backend = SchedulerClient(_settings(url, shape), metrics=off, process=engine_process())
        llm_args = connector_llm_args(MODEL, url, block=shape.tokens_per_block)
        hooks: dict[bool, tuple[Any, Any]] = {}
        for metrics in (False, True):
            with env_set(**_hook_env(url, metrics)):
                scheduler = KvoffloadConnectorScheduler(llm_args)
                worker = KvoffloadConnectorWorker(llm_args)
                worker.register_kv_caches(pool)
            hooks[metrics] = (scheduler, worker)
        try:
            # One stored chunk that every lookup and retrieve hits.
            hot = _prompt(1, chunk + 1)
            hot_key = hot[:chunk]
            # LMCache's own copies write its layout, not block-native chunks: their retrieve reads a
            # chunk they stored (other tokens), never one of ours.
            hot_lmcache_key = _prompt(2, chunk)
            if not raw.store_lmcache("warm-store-lmcache", hot_lmcache_key, src):
                raise RuntimeError("warm-up store (LMCache's copies) failed")
            raw.client.end_session("warm-store-lmcache")
            if not raw.store_protocol("warm-store", hot_key, src):
                raise RuntimeError("could not store the benchmark chunk")
            raw.client.end_session("warm-store")
            ids = itertools.count(1000)

            # --- lookup ---------------------------------------------------------
            def lookup_raw(_: int) -> float:
                sid = f"lr{next(ids)}"
                t0 = time.perf_counter()
                hit = raw.lookup(sid, hot_key, chunk)
                dt = time.perf_counter() - t0
                raw.free(sid, hot_key, chunk)
                assert hit == chunk, hit
                return dt

            def lookup_backend(_: int) -> float:
                sid = f"lb{next(ids)}"
                t0 = time.perf_counter()
                hit = sched_backend.lookup(sid, hot_key, chunk, "")
                dt = time.perf_counter() - t0
                raw.free(sid, hot_key, chunk)
                assert hit == chunk, hit
                return dt

            def lookup_hook(metrics: bool) -> Any:
                scheduler = hooks[metrics][0]

                def run(_: int) -> float:
                    rid = next(ids)
                    request = StandinLlmRequest(PromptRequest(rid, list(hot)))
                    t0 = time.perf_counter()
                    matched, _async = scheduler.get_num_new_matched_tokens(request, 0)
                    dt = time.perf_counter() - t0
                    raw.free(scheduler.session_id(rid), hot_key, chunk)
                    scheduler.request_finished(request, [])
                    assert matched == chunk, matched
                    return dt

                return run

            lookup = interleaved(
                [
                    ("raw", lookup_raw),
                    ("backend", lookup_backend),
                    ("hook_metrics_off", lookup_hook(False)),
                    ("hook_metrics_on", lookup_hook(True)),
                ],
                reps,
                warmup,
            )

            # --- retrieve (each preceded by an untimed lookup, as TensorRT-LLM does) ---------
            exact: dict[str, bool] = {}

            def retrieve_with(
                name: str, fn: Any, key: tuple[int, ...] = hot_key, prepare: Any = None, finish: Any = None
            ) -> Any:
                """Time ``fn`` (its argument: ``prepare(sid)``, or the session id); ``finish`` untimed after."""

                def run(_: int) -> float:
                    sid = f"rr{next(ids)}"
                    assert raw.lookup(sid, key, chunk) == chunk
                    pool[list(dst)] = 0
                    arg = prepare(sid) if prepare is not None else sid
                    t0 = time.perf_counter()
                    ok = fn(arg)
                    dt = time.perf_counter() - t0
                    if finish is not None:
                        finish(arg)
                    raw.client.end_session(sid)
                    assert ok is not False, "retrieve failed"
                    same = bool(torch.equal(pool[list(src)].view(torch.int16), pool[list(dst)].view(torch.int16)))
                    exact[name] = exact.get(name, True) and same
                    return dt

                return run

            def op(sid: str, tokens: tuple[int, ...], blocks: tuple[int, ...]) -> Any:
                return TransferOp(0, sid, tokens, 0, len(tokens), blocks, 0, "")

            def hook_secure(metrics: bool) -> Any:
                """The scheduler hook's lookup + secure (untimed), and the load op it hands the worker."""
                scheduler = hooks[metrics][0]

                def prepare(_sid: str) -> tuple[Any, Any]:
                    request = StandinLlmRequest(PromptRequest(next(ids), list(hot)))
                    matched, _async = scheduler.get_num_new_matched_tokens(request, 0)
                    blocks = [*dst, 2 * bpc]  # and one for the prompt's last token
                    scheduler.update_state_after_alloc(request, blocks)
                    first = RequestData(request.request_id, list(hot), blocks, 0, len(hot) - matched)
                    meta = scheduler.build_connector_meta(SchedulerOutput(new_requests=[first]))
                    (load,) = meta.loads
                    assert matched == chunk and load.secured is not None, matched
                    return request, ConnectorMetadata(loads=meta.loads)

                return prepare

            def hook_load(metrics: bool) -> Any:
                worker = hooks[metrics][1]

                def run(prepared: tuple[Any, Any]) -> bool:
                    worker.bind_connector_meta(prepared[1])
                    worker.start_load_kv(None)
                    try:  # the forward's first layer: a load that failed raises there
                        worker.wait_for_layer_load(0, None)
                    except KvoffloadLoadError:
                        return False
                    finally:
                        worker._clear_connector_meta()
                    return True

                return run

            def hook_done(metrics: bool) -> Any:
                scheduler, worker = hooks[metrics]

                def finish(prepared: tuple[Any, Any]) -> None:
                    worker.get_finished([], [])  # rank 0 gives the loaded chunks back after the iteration
                    scheduler.request_finished(prepared[0], [])

                return finish

            retrieve = interleaved(
                [
                    ("raw", retrieve_with("raw", lambda sid: raw.retrieve_protocol(sid, hot_key, dst))),
                    (
                        "lmcache_copies",
                        retrieve_with(
                            "lmcache_copies",
                            lambda sid: raw.retrieve_lmcache(sid, hot_lmcache_key, dst),
                            hot_lmcache_key,
                        ),
                    ),
                    (
                        "backend",
                        retrieve_with("backend", lambda sid: backend.copies.retrieve(op(sid, hot_key, dst)) > 0),
                    ),
                    *[
                        (name, retrieve_with(name, hook_load(m), prepare=hook_secure(m), finish=hook_done(m)))
                        for name, m in (("hook_metrics_off", False), ("hook_metrics_on", True))
                    ],
                ],
                reps,
                warmup,
            )

            # --- store (a new chunk each time: LMCache skips chunks it holds) ----------------
            def store_with(fn: Any) -> Any:
                def run(_: int) -> float:
                    n = next(ids)
                    tokens = _prompt(n, chunk)
                    sid = f"st{n}"
                    t0 = time.perf_counter()
                    ok = fn(sid, tokens)
                    dt = time.perf_counter() - t0
                    raw.client.end_session(sid)
                    assert ok is not False, "store failed"
                    return dt

                return run

            def hook_save(metrics: bool) -> Any:
                worker = hooks[metrics][1]

                def run(sid: str, tokens: tuple[int, ...]) -> bool:
                    worker.bind_connector_meta(ConnectorMetadata(saves=(op(sid, tokens, src),)))
                    worker.wait_for_save(None)
                    worker._clear_connector_meta()
                    return bool(worker.backend.is_up())  # the hook logs and skips a failed store

                return run

            store = interleaved(
                [
                    ("raw", store_with(lambda sid, t: raw.store_protocol(sid, t, src))),
                    ("lmcache_copies", store_with(lambda sid, t: raw.store_lmcache(sid, t, src))),
                    ("backend", store_with(lambda sid, t: backend.copies.store(op(sid, t, src)) > 0)),
                    ("hook_metrics_off", store_with(hook_save(False))),
                    ("hook_metrics_on", store_with(hook_save(True))),
                ],
                reps,
                warmup,
            )

            # --- lookup + secure while other prompts' store COMMITs are still queued ----------
            securing = engine_process().worker(url)  # the worker the scheduler secures through
            assert securing is not None

            def lookup_secure(queued: int) -> Any:
                def run(_: int) -> float:
                    for _ in range(queued):  # other requests' stores just ended: COMMITs queued
                        n = next(ids)
                        securing.copies.store(op(f"bc{n}", _prompt(n, chunk), src))
                    sid = f"ls{next(ids)}"
                    t0 = time.perf_counter()
                    hit = sched_backend.lookup(sid, hot_key, chunk, "")
                    secured = sched_backend.secure(sid, hot_key, 0, chunk, "")
                    dt = time.perf_counter() - t0
                    assert hit == chunk and secured is not None, (hit, secured)
                    sched_backend.release_secured(sid, hot_key, 0, chunk, "", secured)
                    sched_backend.end_session(sid)
                    return dt

                return run

            beside = interleaved(
                [("idle", lookup_secure(0)), ("queued", lookup_secure(QUEUED_COMMITS))], beside_reps, warmup
            )
        finally:
            for scheduler, worker in hooks.values():
                worker.shutdown()
                scheduler.backend.close()
            backend.close()
            sched_backend.close()
            raw.close()
    ops = {"lookup": lookup, "retrieve": retrieve, "store": store}
    return {
        "shape": shape.describe(),
        "payload_bytes": chunk_bytes,
        "payload_tokens": chunk,
        "reps": reps,
        "warmup": warmup,
        "server": f"lmcache server (0.5.6), L1 {l1_gb} GB, chunk {chunk}, --max-workers 1, SHM, engine-driven",
        "retrieve_bit_exact": exact,
        "ops": {name: {variant: summarize(s) for variant, s in samples.items()} for name, samples in ops.items()},
        "samples_s": {name: samples for name, samples in ops.items()},
        "metrics_primitives": metrics_primitives(),
        "lookup_beside_commits": {
            "queued_commits": QUEUED_COMMITS,
            "reps": beside_reps,
            "latency": {name: summarize(v) for name, v in beside.items()},
            "samples_s": beside,
        },
    }


def metrics_primitives(n: int = 50_000) -> dict[str, float]:
    """ns per call of what a hook records, metrics on vs off, next to prometheus_client called directly."""
    from kvoffload.connector.metrics import ConnectorMetrics

    on = ConnectorMetrics("primitives", "sidecar", enabled=True)
    off = ConnectorMetrics("primitives", "sidecar", enabled=False)

    def direct() -> None:
        on.lookup_seconds.observe(0.0012)
        on.lookup_requests.inc()
        on.lookup_queried_tokens.inc(256)
        on.lookup_hit_tokens.inc(256)

    cases = {
        "record_lookup_metrics_on_ns": lambda: on.record_lookup(0.0012, 256, 256),
        "record_lookup_metrics_off_ns": lambda: off.record_lookup(0.0012, 256, 256),
        "record_prompt_tokens_metrics_on_ns": lambda: on.record_prompt_tokens("computed", "not_cached", 256),
        "direct_prometheus_observe_plus_3_inc_ns": direct,
    }
    out: dict[str, float] = {}
    for name, fn in cases.items():
        out[name] = best_ns_per_call(fn, n, on.flush)
    for _ in range(n // 5):
        on.record_lookup(0.0012, 256, 256)
    t0 = time.perf_counter_ns()
    on.flush()
    out["flush_per_recorded_op_ns"] = (time.perf_counter_ns() - t0) / (n // 5)
    out["multiprocess_mode"] = float(bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR")))
    return out


def cpu_transfer(sizes_tokens: list[int], reps: int, shipped_max_tokens: int, warmup: int = 1) -> dict[str, Any]:
    """Store/retrieve through the sidecar SHM path vs ``copy_`` of the same bytes, per size."""
    import torch

    from kvoffload.connector.backends.base import KvGeometry
    from kvoffload.connector.backends.blockcopy import gather_chunk, scatter_chunk
    from kvoffload.connector.backends.scheduler_client import SchedulerClient
    from kvoffload.connector.backends.worker_backend import WorkerBackend
    from kvoffload.connector.metrics import ConnectorMetrics
    from kvoffload.connector.runtime import engine_process
    from kvoffload.connector.wire import TransferOp

    shape = TRANSFER_SHAPE
    block, chunk = shape.tokens_per_block, shape.chunk
    geometry = KvGeometry(shape.heads, block, shape.head_dim)
    max_tokens = max(sizes_tokens)
    max_blocks = max_tokens // block
    pool = _pool(shape, num_blocks=2 * max_blocks)
    rows: list[dict[str, Any]] = []
    off = ConnectorMetrics(MODEL, "sidecar", enabled=False)
    seeds = itertools.count(10_000)
    l1_by_size: dict[int, float] = {}
    for tokens in sizes_tokens:
        # A server per size, with L1 for every round's (new) tokens: nothing is evicted mid-run.
        rounds = (warmup + reps) * (2 if tokens <= shipped_max_tokens else 1)
        l1_gb = l1_by_size[tokens] = round(max(0.5, 1.2 * rounds * tokens * shape.bytes_per_token / 2**30 + 0.25), 2)
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(_server(chunk, l1_gb))
            settings = _settings(server.url, shape)
            ours = WorkerBackend(settings, rank=0, metrics=off, process=engine_process(), use_fast_copies=True)
            stack.callback(ours.close)
            ours.register(pool, geometry)
            shipped = WorkerBackend(settings, rank=0, metrics=off, process=engine_process(), use_fast_copies=False)
            stack.callback(shipped.close)
            shipped.register(pool, geometry)
            scheduler = SchedulerClient(settings, metrics=off, process=engine_process())
            stack.callback(scheduler.close)
            nb = tokens // block
            nbytes = tokens * shape.bytes_per_token
            src, dst = scattered_block_ids(nb, seed=tokens)
            buf = torch.empty_like(pool[:nb])
            chunk_bufs = [
                torch.empty((2, shape.layers, chunk, shape.heads * shape.head_dim), dtype=pool.dtype)
                for _ in range(tokens // chunk)
            ]
            bpc = chunk // block
            exact: list[bool] = []

            def memcpy_store(_: int, nb: int = nb, buf: Any = buf) -> float:
                t0 = time.perf_counter()
                buf.copy_(pool[:nb])
                return time.perf_counter() - t0

            def memcpy_retrieve(_: int, nb: int = nb, buf: Any = buf) -> float:
                t0 = time.perf_counter()
                pool[nb : 2 * nb].copy_(buf)
                return time.perf_counter() - t0

            def blockcopy_store(
                _: int, src: tuple[int, ...] = src, bufs: list[Any] = chunk_bufs, bpc: int = bpc
            ) -> float:
                t0 = time.perf_counter()
                for i, out in enumerate(bufs):
                    gather_chunk(pool, src[i * bpc : (i + 1) * bpc], out)
                return time.perf_counter() - t0

            def blockcopy_retrieve(
                _: int, dst: tuple[int, ...] = dst, bufs: list[Any] = chunk_bufs, bpc: int = bpc
            ) -> float:
                t0 = time.perf_counter()
                for i, c in enumerate(bufs):
                    scatter_chunk(pool, dst[i * bpc : (i + 1) * bpc], c, 0)
                return time.perf_counter() - t0

            store_s: dict[str, list[float]] = {}
            retrieve_s: dict[str, list[float]] = {}

            def sidecar_round(
                name: str,
                backend: Any,
                keep: bool,
                tokens: int = tokens,
                src: tuple[int, ...] = src,
                dst: tuple[int, ...] = dst,
                exact: list[bool] = exact,
                store_s: dict[str, list[float]] = store_s,
                retrieve_s: dict[str, list[float]] = retrieve_s,
                scheduler: Any = scheduler,
            ) -> None:
                seed = next(seeds)
                toks = _prompt(seed, tokens)
                t0 = time.perf_counter()
                backend.copies.store(TransferOp(0, f"s{seed}", toks, 0, tokens, src, 0, ""))
                t_store = time.perf_counter() - t0
                hit = scheduler.lookup(f"r{seed}", toks, tokens, "")
                if hit != tokens:
                    raise RuntimeError(f"lookup after store hit {hit} of {tokens} tokens (L1 too small?)")
                pool[list(dst)] = 0
                t0 = time.perf_counter()
                backend.copies.retrieve(TransferOp(0, f"r{seed}", toks, 0, tokens, dst, 0, ""))
                t_ret = time.perf_counter() - t0
                scheduler.end_session(f"r{seed}")
                exact.append(bool(torch.equal(pool[list(src)].view(torch.int16), pool[list(dst)].view(torch.int16))))
                if keep:
                    store_s.setdefault(name, []).append(t_store)
                    retrieve_s.setdefault(name, []).append(t_ret)

            copies = interleaved(
                [
                    ("memcpy_store", memcpy_store),
                    ("memcpy_retrieve", memcpy_retrieve),
                    ("blockcopy_store", blockcopy_store),
                    ("blockcopy_retrieve", blockcopy_retrieve),
                ],
                reps,
                warmup,
            )
            with_shipped = tokens <= shipped_max_tokens
            for i in range(warmup + reps):
                sidecar_round("kvoffload", ours, keep=i >= warmup)
                if with_shipped:
                    sidecar_round("lmcache_copies", shipped, keep=i >= warmup)
            row: dict[str, Any] = {"tokens": tokens, "bytes": nbytes, "reps": reps, "bit_exact": all(exact)}
            for name, samples in copies.items():
                row[name] = _rate(nbytes, samples)
            for name, samples in store_s.items():
                row[f"{name}_store"] = _rate(nbytes, samples)
            for name, samples in retrieve_s.items():
                row[f"{name}_retrieve"] = _rate(nbytes, samples)
            rows.append(row)
            print(
                f"[transfer] {tokens} tokens ({nbytes / 2**20:.0f} MiB): "
                + ", ".join(f"{k} {v['gbps_p50']:.2f} GB/s" for k, v in row.items() if isinstance(v, dict)),
                flush=True,
            )
    return {
        "shape": shape.describe(),
        "server": f"lmcache server (0.5.6), one per size (L1 GB by tokens: {l1_by_size}), chunk {chunk}, "
        "--max-workers 1, SHM, engine-driven",
        "shipped_max_tokens": shipped_max_tokens,
        "sizes": rows,
    }


def _rate(nbytes: int, samples: list[float]) -> dict[str, float]:
    """Latency summary plus GB/s at the median and at the p99 latency."""
    s = summarize(samples)
    return {
        **{f"{k}_ms" if k != "n" else k: (v * 1e3 if k != "n" else v) for k, v in s.items()},
        "gbps_p50": nbytes / s["p50"] / 1e9 if s["p50"] else 0.0,
        "gbps_at_p99": nbytes / s["p99"] / 1e9 if s["p99"] else 0.0,
    }
