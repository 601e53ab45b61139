"""GPU store/retrieve throughput through the kvoffload sidecar, next to the raw copy ceiling.

Runs on a CUDA machine (the lent H200): starts the real sidecar (``python -m
kvoffload.sidecar``, which runs LMCache's server), registers a TensorRT-LLM-shaped
pool (Llama-3-8B: 32 layers, 8 KV heads, head_dim 128, bf16, 32 tokens/block,
128 KiB per token) through the connector's sidecar backend, and for each size:

* baseline, same run: raw pinned ``copy_`` H2D and D2H of the same bytes;
* kvoffload fast path: the connector's own block<->chunk copies inside LMCache's
  PREPARE/COMMIT protocol into the server's (pinned) shared-memory L1;
* LMCache 0.5.6 as shipped: the same protocol with LMCache's own gather/scatter
  (``use_fast_copies=False``), at the smallest size only (it is slow);
* optionally other LMCache chunk sizes (``--chunk-sizes``: fewer, larger chunks mean fewer
  per-chunk steps in PREPARE/COMMIT) and the in-process backend (``--inprocess``: LMCache's
  engine inside this process instead of the sidecar).

Per operation the connector logs PREPARE, copy and COMMIT times; their medians are reported.

Every retrieve lands in different block ids and is checked bit-exact.

    python -m benchmarks.gpu_transfer --tokens 4096 16384 32768 --out results.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import types
import urllib.request
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import scattered_block_ids, standin_on_path
from hack.ports import free_port

LAYERS, KV_HEADS, HEAD_DIM, TOKENS_PER_BLOCK = 32, 8, 128, 32
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 2  # bf16
DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def write_json(results: dict[str, Any], out: str) -> None:
    """The whole result as JSON: to stdout for ``-``, else to the file ``out``."""
    text = json.dumps(results, indent=1)
    if out == "-":
        print(text)
    else:
        Path(out).write_text(text)


def _cuda_ops_loads() -> str:
    """Whether LMCache's compiled ``cuda_ops`` loads here (its own copies use it; ours do not)."""
    try:
        import lmcache.cuda_ops  # noqa: F401
    except Exception as exc:  # an ImportError, or an undefined symbol against this torch
        return f"no: {exc!r}"[:300]
    return "yes"


def _median_gbps(nbytes: int, seconds: list[float]) -> tuple[float, float]:
    med = statistics.median(seconds)
    return nbytes / med / 1e9, med * 1000


def raw_copy_baseline(nbytes: int, reps: int = 5) -> dict[str, float]:
    """Pinned host <-> device copy_ of ``nbytes``: the ceiling for CPU offload."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=DEVICE == "cuda")
    out: dict[str, float] = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            times.append(time.perf_counter() - t0)
        out[f"{name}_gbps"], out[f"{name}_ms"] = _median_gbps(nbytes, times[1:])
    del dev, host
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return out


class TransferTimings(logging.Handler):
    """Collects the connector's ``event=transfer_timing`` debug lines (PREPARE / copy / COMMIT)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.rows: list[dict[str, float | str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "event=transfer_timing" in text:
            fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
            self.rows.append({k: (v if k == "op" else float(v)) for k, v in fields.items() if k != "event"})

    def medians(self) -> dict[str, dict[str, float]]:
        """Median prepare/copy/commit ms per op since the last call (then forgets them)."""
        out: dict[str, dict[str, float]] = {}
        for op in ("store", "retrieve"):
            rows = [r for r in self.rows if r["op"] == op]
            if rows:
                out[op] = {k: statistics.median(float(r[k]) for r in rows)
                           for k in ("prepare_ms", "copy_ms", "commit_ms", "blocks")}  # fmt: skip
        self.rows.clear()
        return out


def start_sidecar(l1: str, workdir: Path, chunk_size: int = 256) -> tuple[subprocess.Popen[bytes], str, int]:
    port, http_port, health_port = free_port(), free_port(), free_port()
    env = dict(os.environ)
    env.update(
        {
            "KVOFFLOAD_L1_SIZE": l1,
            "KVOFFLOAD_CHUNK_SIZE": str(chunk_size),
            "KVOFFLOAD_REQUEST_PORT": str(port),
            "KVOFFLOAD_LMCACHE_HTTP_PORT": str(http_port),
            "KVOFFLOAD_SIDECAR_HTTP_PORT": str(health_port),
            "KVOFFLOAD_INSTANCE_ID": f"gpubench{os.getpid()}",
            "PROMETHEUS_MULTIPROC_DIR": str(workdir / "metrics"),
            "LMCACHE_TRACK_USAGE": "false",
        }
    )
    (workdir / "metrics").mkdir(exist_ok=True)
    log = open(workdir / "sidecar.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "kvoffload.sidecar"], env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sidecar exited {proc.returncode}: {(workdir / 'sidecar.log').read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz", timeout=2) as r:
                if r.status == 200:
                    return proc, f"tcp://127.0.0.1:{port}", health_port
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError("sidecar not ready in 300 s")


def make_backend(
    url: str,
    pool: torch.Tensor | None,
    fast: bool,
    workdir: Path,
    role: str = "worker",
    world_size: int = 1,
    rank: int = 0,
) -> Any:
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", str(workdir / "metrics"))
    standin_on_path()  # the connector's package imports TensorRT-LLM's connector base classes
    from kvoffload.connector.backends.base import kv_geometry
    from kvoffload.connector.backends.scheduler_client import SchedulerClient
    from kvoffload.connector.backends.worker_backend import WorkerBackend
    from kvoffload.connector.metrics import ConnectorMetrics
    from kvoffload.connector.runtime import engine_process
    from kvoffload.connector.settings import parse_settings

    llm_args = types.SimpleNamespace(
        model="meta-llama/Llama-3.1-8B-Instruct",
        kv_cache_config=types.SimpleNamespace(tokens_per_block=TOKENS_PER_BLOCK),
        kv_connector_config=types.SimpleNamespace(server_url=url),
        tensor_parallel_size=world_size,
        pipeline_parallel_size=1,
    )
    env = {
        "KVOFFLOAD_STORE_TIMEOUT_MS": "600000",
        "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "600000",
        "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "60000",
    }
    settings = parse_settings(env, llm_args)
    metrics = ConnectorMetrics(settings.model_name, "sidecar")
    if role == "scheduler":  # lookups only
        scheduler = SchedulerClient(settings, metrics=metrics, process=engine_process())
        deadline = time.monotonic() + 30
        while not scheduler.is_up() and time.monotonic() < deadline:
            time.sleep(0.1)
        return scheduler
    assert pool is not None, "a worker registers a pool"
    backend = WorkerBackend(settings, rank=rank, metrics=metrics, process=engine_process(), use_fast_copies=fast)
    geometry = kv_geometry(
        pool.shape[-1], TOKENS_PER_BLOCK, {"num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM}, world_size
    )
    backend.register(pool, geometry)
    if not backend.is_up():
        raise RuntimeError("backend did not register")
    return backend


def request_block_ids(nblocks: int, order: str, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Source and destination block ids of one round: ``contiguous`` ranges or ``scattered`` (shuffled)."""
    if order == "contiguous":
        return tuple(range(nblocks)), tuple(range(nblocks, 2 * nblocks))
    return scattered_block_ids(nblocks, seed)


def round_inputs(
    tokens: int, order: str, seed: int
) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """One round's source and destination block ids (also as device tensors) and its prompt tokens."""
    src, dst = request_block_ids(tokens // TOKENS_PER_BLOCK, order, seed)
    gen = torch.Generator().manual_seed(seed)
    token_ids = tuple(int(t) for t in torch.randint(1, 120000, (tokens,), generator=gen))
    return src, dst, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE), token_ids


def transfer_round(
    backend: Any,
    scheduler: Any,
    pool: torch.Tensor,
    tokens: int,
    rep: int,
    salt: str,
    order: str = "scattered",
    sync_after: bool = True,
    engine_path: bool = False,
    forward: EngineLoad | None = None,
) -> dict[str, Any]:
    """One store, lookup and retrieve (and with ``engine_path``, the same load and, on CUDA with a
    ``forward``, the same store as the engine runs them); ``sync_after=False`` times each call alone (the backend returns once its copies are done)
    instead of adding a device-wide synchronize, which under load would wait for the stand-in
    engine's work too."""
    from kvoffload.connector.wire import TransferOp

    nblocks = tokens // TOKENS_PER_BLOCK
    src, dst, src_idx, dst_idx, token_ids = round_inputs(tokens, order, seed=1000 * rep + tokens)
    # fresh KV in the source blocks for this round, poison in the destination
    pool[: 2 * nblocks].copy_(torch.randn(pool[: 2 * nblocks].shape, dtype=torch.float32, device=DEVICE).to(pool.dtype))
    pool.index_fill_(0, dst_idx, float("nan"))
    sync()
    store = TransferOp(0, f"s{rep}-{tokens}-{salt}", token_ids, 0, tokens, src, 0, salt)
    t0 = time.perf_counter()
    backend.copies.store(store)
    if sync_after:
        sync()
    t_store = time.perf_counter() - t0
    load = TransferOp(0, f"r{rep}-{tokens}-{salt}", token_ids, 0, tokens, dst, 0, salt)
    hit = scheduler.lookup(load.session_id, token_ids, tokens, salt)  # TensorRT-LLM looks up first
    t0 = time.perf_counter()
    backend.copies.retrieve(load)
    if sync_after:
        sync()
    t_retrieve = time.perf_counter() - t0
    exact = bool(torch.equal(pool[src_idx].view(torch.int16), pool[dst_idx].view(torch.int16)))
    scheduler.end_session(load.session_id)
    result = {"store_s": t_store, "retrieve_s": t_retrieve, "bit_exact": exact, "hit_tokens": hit}
    if engine_path:
        result.update(
            engine_path_load(
                backend, scheduler, pool, token_ids, dst, src_idx, dst_idx, f"e{rep}-{tokens}-{salt}", salt
            )
        )
        if forward is not None:
            result.update(engine_path_store(backend, scheduler, pool, tokens, rep, salt, forward))
    return result


def engine_path_store(
    backend: Any, scheduler: Any, pool: torch.Tensor, tokens: int, rep: int, salt: str, forward: EngineLoad
) -> dict[str, Any]:
    """The same store as the engine's saver runs it: handed over at ``wait_for_save`` while the
    forward pass that writes the KV still runs on the engine's stream (stand-in: ``forward``'s
    matmuls, then the KV written into the blocks); the saver's stream waits for the pass's event on
    the device and calls ``store``. Timed from the pass's end to the store's return (CUDA events);
    then retrieved into other blocks and checked against what the pass wrote."""
    from kvoffload.connector.wire import TransferOp

    salt = f"{salt}-engine-store"  # keys of their own: LMCache would skip chunks the round's store holds
    nblocks = tokens // TOKENS_PER_BLOCK
    src, dst, src_idx, dst_idx, token_ids = round_inputs(tokens, "scattered", seed=7919 * rep + tokens)
    kv = torch.randn((nblocks, *pool.shape[1:]), dtype=torch.float32, device=DEVICE).to(pool.dtype)
    pool.index_fill_(0, src_idx, float("nan"))
    pool.index_fill_(0, dst_idx, float("nan"))
    sync()
    engine, saver = torch.cuda.Stream(), torch.cuda.Stream()
    pass_end, stored = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(engine):
        forward.queue_forward()
        pool.index_copy_(0, src_idx, kv)  # the pass writes the KV last
        pass_end.record(engine)
    with torch.cuda.stream(saver):
        saver.wait_event(pass_end)
        backend.copies.store(TransferOp(0, f"w{rep}-{tokens}-{salt}", token_ids, 0, tokens, src, 0, salt))
        stored.record(saver)
    stored.synchronize()
    store_s = pass_end.elapsed_time(stored) / 1e3
    load = TransferOp(0, f"v{rep}-{tokens}-{salt}", token_ids, 0, tokens, dst, 0, salt)
    hit = scheduler.lookup(load.session_id, token_ids, tokens, salt)
    backend.copies.retrieve(load)
    sync()
    exact = hit == tokens and bool(torch.equal(kv.view(torch.int16), pool[dst_idx].view(torch.int16)))
    scheduler.end_session(load.session_id)
    return {"engine_store_s": store_s, "engine_store_bit_exact": exact}


def engine_path_load(
    backend: Any, scheduler: Any, pool: torch.Tensor, token_ids: tuple[int, ...], dst: tuple[int, ...],
    src_idx: torch.Tensor, dst_idx: torch.Tensor, session: str, salt: str,
) -> dict[str, Any]:  # fmt: skip
    """The same load as the engine runs it: looked up and secured (the PREPAREs, on the scheduling
    path before the promise; in one server call where the server has secured lookups, as the
    sidecar's does) and copied by ``start_load_kv`` (``load_secured``), each timed alone."""
    from kvoffload.connector.wire import TransferOp

    tokens = len(token_ids)
    pool.index_fill_(0, dst_idx, float("nan"))
    sync()
    t0 = time.perf_counter()
    found = scheduler.lookup_and_secure(session, token_ids, tokens, salt, 0, tokens)
    if found is not None:
        secured, t_secure = found.load, found.prepare_s
    else:
        scheduler.lookup(session, token_ids, tokens, salt)
        t1 = time.perf_counter()
        secured = backend.prepare_secured(session, token_ids, 0, tokens, salt)
        t_secure = time.perf_counter() - t1
    t_lookup_and_secure = time.perf_counter() - t0
    assert secured is not None, "load not secured"
    t0 = time.perf_counter()
    (loaded,) = backend.copies.load_secured(
        [TransferOp(0, session, token_ids, 0, tokens, dst, 0, salt, secured=secured)]
    )
    sync()
    t_load = time.perf_counter() - t0
    backend.copies.release_loaded()
    assert loaded.error is None, loaded.error
    exact = bool(torch.equal(pool[src_idx].view(torch.int16), pool[dst_idx].view(torch.int16)))
    scheduler.end_session(session)
    return {"secure_s": t_secure, "lookup_and_secure_s": t_lookup_and_secure, "one_call": found is not None,
            "secured_load_s": t_load, "secured_bit_exact": exact}  # fmt: skip


def measure(
    backend: Any,
    scheduler: Any,
    pool: torch.Tensor,
    tokens: int,
    reps: int,
    salt: str,
    order: str = "scattered",
    sync_after: bool = True,
    engine_path: bool = False,
    forward: EngineLoad | None = None,
) -> dict[str, Any]:
    rounds = [transfer_round(backend, scheduler, pool, tokens, r, salt, order, sync_after, engine_path, forward)
              for r in range(reps + 1)]  # fmt: skip
    nbytes = tokens * BYTES_PER_TOKEN
    warm = rounds[1:] if reps > 0 else rounds
    store_gbps, store_ms = _median_gbps(nbytes, [r["store_s"] for r in warm])
    retr_gbps, retr_ms = _median_gbps(nbytes, [r["retrieve_s"] for r in warm])
    engine_path: dict[str, Any] = {}
    if all("secured_load_s" in r for r in rounds):
        load_gbps, load_ms = _median_gbps(nbytes, [r["secured_load_s"] for r in warm])
        seen_gbps, seen_ms = _median_gbps(nbytes, [r["lookup_and_secure_s"] + r["secured_load_s"] for r in warm])
        engine_path = {"secured_load_gbps": load_gbps, "secured_load_ms": load_ms,
                       "secure_ms": statistics.median(r["secure_s"] for r in warm) * 1e3,
                       "lookup_and_secure_ms": statistics.median(r["lookup_and_secure_s"] for r in warm) * 1e3,
                       "secured_in_one_call": all(r["one_call"] for r in warm),
                       "load_as_seen_gbps": seen_gbps, "load_as_seen_ms": seen_ms}  # fmt: skip
    if all("engine_store_s" in r for r in rounds):
        store_gbps_e, store_ms_e = _median_gbps(nbytes, [r["engine_store_s"] for r in warm])
        engine_path.update(engine_store_gbps=store_gbps_e, engine_store_ms=store_ms_e,
                           engine_store_bit_exact=all(r["engine_store_bit_exact"] for r in rounds))  # fmt: skip
    return {
        "store_gbps": store_gbps,
        "store_ms": store_ms,
        "retrieve_gbps": retr_gbps,
        "retrieve_ms": retr_ms,
        **engine_path,
        "bit_exact": all(r["bit_exact"] and r.get("secured_bit_exact", True) for r in rounds),
        "all_hit": all(r["hit_tokens"] == tokens for r in rounds),
        "hit_tokens": [r["hit_tokens"] for r in rounds],
        "rounds": len(warm),
    }


class EngineLoad:
    """A stand-in engine keeping the GPU busy on its own stream: bf16 matmuls queued in
    ``forward_ms`` batches ("forward passes"), one after another, until stopped."""

    def __init__(self, forward_ms: float = 20.0, n: int = 8192) -> None:
        import threading

        self._stop = threading.Event()
        self._a = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
        self._b = torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16)
        self._stream = torch.cuda.Stream()
        with torch.cuda.stream(self._stream):
            self._a @ self._b  # warm-up
        self._stream.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            for _ in range(10):
                self._a @ self._b
        self._stream.synchronize()
        per_matmul_ms = (time.perf_counter() - t0) * 100
        self.matmuls_per_forward = max(1, round(forward_ms / per_matmul_ms))
        self.forward_ms = self.matmuls_per_forward * per_matmul_ms
        self._thread = threading.Thread(target=self._run, daemon=True)

    def queue_forward(self) -> None:
        """Queue one stand-in forward pass (``forward_ms`` of matmuls) on the current stream."""
        for _ in range(self.matmuls_per_forward):
            self._a @ self._b

    def _run(self) -> None:
        with torch.cuda.stream(self._stream):
            while not self._stop.is_set():
                for _ in range(self.matmuls_per_forward):
                    self._a @ self._b
                self._stream.synchronize()

    def __enter__(self) -> EngineLoad:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class DeviceWideSync:
    """The connector's copies as before the dedicated transfer stream: on the caller's stream,
    with a device-wide synchronize (also before the copies for stores), for a same-run comparison."""

    def __init__(self, before_copies: bool) -> None:
        self._before = before_copies

    def after_caller(self) -> Any:
        import contextlib

        if self._before:
            torch.cuda.synchronize()
        return contextlib.nullcontext()

    def synchronize(self) -> None:
        torch.cuda.synchronize()


def measure_under_load(backend: Any, scheduler: Any, pool: torch.Tensor, tokens: int, reps: int) -> dict[str, Any]:
    """Store/retrieve idle (baseline), then while ``EngineLoad`` runs: with the shipped transfer stream
    and with device-wide synchronisation (the previous behaviour), same tokens size and block order."""
    row: dict[str, Any] = {
        "tokens": tokens,
        "bytes": tokens * BYTES_PER_TOKEN,
        "raw": raw_copy_baseline(tokens * BYTES_PER_TOKEN),
    }
    row["idle"] = measure(backend, scheduler, pool, tokens, reps, salt="idle", sync_after=False)
    transfers = backend.transfers
    shipped = transfers.load_copies, transfers.store_copies
    with EngineLoad() as load:
        row["forward_ms"] = load.forward_ms
        row["under_load_transfer_stream"] = measure(
            backend, scheduler, pool, tokens, reps, salt="load-stream", sync_after=False
        )
        real_store, real_retrieve = transfers._store_fast, transfers._retrieve_fast

        def store_old(edc: Any, key: Any, op: Any) -> bool:
            transfers.store_copies = DeviceWideSync(before_copies=True)
            return bool(real_store(edc, key, op))

        def retrieve_old(edc: Any, key: Any, op: Any) -> bool:
            transfers.load_copies = DeviceWideSync(before_copies=False)
            return bool(real_retrieve(edc, key, op))

        transfers._store_fast, transfers._retrieve_fast = store_old, retrieve_old
        try:
            row["under_load_device_sync"] = measure(
                backend, scheduler, pool, tokens, reps, salt="load-device", sync_after=False
            )
        finally:
            transfers._store_fast, transfers._retrieve_fast = real_store, real_retrieve
            transfers.load_copies, transfers.store_copies = shipped
    return row


def measure_batched_loads(
    backend: Any, scheduler: Any, pool: torch.Tensor, tokens: int, count: int, reps: int
) -> dict[str, Any]:
    """``count`` loads of ``tokens`` each in one iteration: one ``retrieve`` after another (baseline)
    against the shipped path (PREPAREs at lookup, then ``load_secured`` copies them all), same run,
    alternating, every block checked."""
    from kvoffload.connector.wire import TransferOp

    nblocks = tokens // TOKENS_PER_BLOCK
    assert 2 * count * nblocks <= pool.shape[0], "pool too small for the batch"
    ids = list(range(2 * count * nblocks))
    random.Random(tokens).shuffle(ids)
    src = [tuple(ids[i * nblocks : (i + 1) * nblocks]) for i in range(count)]
    dst = [tuple(ids[(count + i) * nblocks : (count + i + 1) * nblocks]) for i in range(count)]
    prompts = []
    for i in range(count):
        gen = torch.Generator().manual_seed(777 + i)
        prompts.append(tuple(int(t) for t in torch.randint(1, 120000, (tokens,), generator=gen)))
    pool.copy_(torch.randn(pool.shape, dtype=torch.float32, device=DEVICE).to(pool.dtype))
    sync()
    for i in range(count):
        backend.copies.store(TransferOp(i, f"batch-store-{i}", prompts[i], 0, tokens, src[i], 0, "batch"))
    sync()
    src_idx = torch.tensor([b for s in src for b in s], device=DEVICE)
    dst_idx = torch.tensor([b for d in dst for b in d], device=DEVICE)
    times: dict[str, list[float]] = {"one_by_one": [], "secured": [], "secure_at_lookup": []}
    exact = True
    for rep in range(reps + 1):
        for name in ("one_by_one", "secured"):
            ops = []
            secure_s = 0.0
            for i in range(count):
                session = f"batch-{name}-{rep}-{i}"
                hit = scheduler.lookup(session, prompts[i], tokens, "batch")
                assert hit == tokens, f"lookup hit {hit} of {tokens}"
                secured = None
                if name == "secured":  # the shipped path: PREPARE at lookup, the load a local copy
                    ts = time.perf_counter()
                    secured = backend.prepare_secured(session, prompts[i], 0, tokens, "batch")
                    secure_s += time.perf_counter() - ts
                    assert secured is not None, "load not secured"
                ops.append(TransferOp(i, session, prompts[i], 0, tokens, dst[i], 0, "batch", secured=secured))
            pool.index_fill_(0, dst_idx, float("nan"))
            sync()
            t0 = time.perf_counter()
            if name == "secured":
                results = backend.copies.load_secured(ops)
                assert all(r.error is None for r in results), results
            else:
                for op in ops:
                    backend.copies.retrieve(op)
            elapsed = time.perf_counter() - t0
            if name == "secured":
                backend.copies.release_loaded()
                if rep:
                    times["secure_at_lookup"].append(secure_s)
            exact &= bool(torch.equal(pool[src_idx].view(torch.int16), pool[dst_idx].view(torch.int16)))
            for op in ops:
                scheduler.end_session(op.session_id)
            if rep:
                times[name].append(elapsed)
    nbytes = count * tokens * BYTES_PER_TOKEN
    out: dict[str, Any] = {"tokens_per_load": tokens, "loads": count, "bytes": nbytes, "bit_exact": exact,
                           "raw": raw_copy_baseline(nbytes)}  # fmt: skip
    for name, samples in times.items():
        gbps, ms = _median_gbps(nbytes, samples)
        out[name] = {"gbps": gbps, "ms": ms} if name != "secure_at_lookup" else {"ms": ms}
    return out


def measure_inprocess(pool: torch.Tensor, args: argparse.Namespace, workdir: Path, timings: TransferTimings
                      ) -> list[dict[str, Any]]:  # fmt: skip
    """The in-process backend: LMCache's engine started inside this process, same data path."""
    standin_on_path()
    from kvoffload.connector.runtime import engine_process
    from kvoffload.quantity import parse_bytes

    settings = types.SimpleNamespace(
        world_size=1, chunk_size=args.chunk_sizes[0], l1_bytes=parse_bytes(args.l1, "--l1")
    )
    url = engine_process().inprocess.start(settings)  # type: ignore[arg-type]
    rows = []
    try:
        scheduler = make_backend(url, None, fast=True, workdir=workdir, role="scheduler")
        backend = make_backend(url, pool, fast=True, workdir=workdir)
        for tokens in args.inprocess_tokens:
            nbytes = tokens * BYTES_PER_TOKEN
            row = {"tokens": tokens, "bytes": nbytes, "chunk_size": args.chunk_sizes[0], "backend": "inprocess",
                   "raw": raw_copy_baseline(nbytes)}  # fmt: skip
            row["kvoffload"] = measure(backend, scheduler, pool, tokens, args.reps, salt="inproc")
            row["phases_ms"] = timings.medians()
            print(json.dumps(row), flush=True)
            rows.append(row)
        backend.close()
        scheduler.close()
    finally:
        engine_process().inprocess.stop()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--l1", default="64Gi")
    parser.add_argument("--shipped-tokens", type=int, default=4096, help="size for LMCache's own copies (0: skip)")
    parser.add_argument("--chunk-sizes", type=int, nargs="+", default=[256], help="LMCache chunk sizes to compare")
    parser.add_argument("--inprocess-tokens", type=int, nargs="*", default=[],
                        help="sizes for the in-process backend (LMCache's engine in this process; none: skip)")  # fmt: skip
    parser.add_argument("--block-orders", nargs="+", default=["scattered"], choices=["scattered", "contiguous"],
                        help="block ids of each request: shuffled over the pool (worst case) or consecutive")  # fmt: skip
    parser.add_argument("--under-load-tokens", type=int, default=0,
                        help="also time this size while a stand-in engine keeps the GPU busy (0: skip)")  # fmt: skip
    parser.add_argument("--batch-loads", type=int, nargs=2, default=None, metavar=("COUNT", "TOKENS"),
                        help="also time COUNT loads of TOKENS each in one iteration: one by one vs secured at lookup")  # fmt: skip
    parser.add_argument("--store-forward-ms", type=float, default=10.0,
                        help="the stand-in forward pass the engine's store is handed over during (0: skip)")  # fmt: skip
    parser.add_argument("--out", default="-")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    args = parser.parse_args(argv)
    global DEVICE
    DEVICE = args.device
    assert DEVICE == "cpu" or torch.cuda.is_available(), "needs a CUDA device"
    import lmcache

    workdir = Path(tempfile.mkdtemp(prefix="kvo-gpubench-"))
    env_info = {
        "gpu": torch.cuda.get_device_name(0) if DEVICE == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "lmcache": getattr(lmcache, "__version__", "0.5.6"),
        "python": platform.python_version(),
        "lmcache_cuda_ops": _cuda_ops_loads(),
        "command": " ".join([sys.executable, "-m", "benchmarks.gpu_transfer", *(argv or sys.argv[1:])]),
    }
    print(json.dumps(env_info), flush=True)
    timings = TransferTimings()
    connector_log = logging.getLogger("kvoffload.connector")
    connector_log.setLevel(logging.DEBUG)
    connector_log.addHandler(timings)
    warnings_out = logging.StreamHandler()
    warnings_out.setLevel(logging.WARNING)
    connector_log.addHandler(warnings_out)  # backend_down, commit_refused, ... show in the log
    results: dict[str, Any] = {"env": env_info, "sizes": []}
    batch_tokens = [args.batch_loads[0] * args.batch_loads[1]] if args.batch_loads else []
    max_tokens = max([*args.tokens, *args.inprocess_tokens, *batch_tokens])
    pool = torch.empty(
        (2 * max_tokens // TOKENS_PER_BLOCK + 8, LAYERS, 2, KV_HEADS * TOKENS_PER_BLOCK * HEAD_DIM),
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    forward = EngineLoad(args.store_forward_ms) if DEVICE == "cuda" and args.store_forward_ms > 0 else None
    if forward is not None:
        results["store_forward_ms"] = forward.forward_ms
    for index, chunk_size in enumerate(args.chunk_sizes):
        sidecar, url, _ = start_sidecar(args.l1, workdir, chunk_size)
        try:
            scheduler = make_backend(url, None, fast=True, workdir=workdir, role="scheduler")
            fast = make_backend(url, pool, fast=True, workdir=workdir)
            for tokens in args.tokens:
                for order in args.block_orders:
                    nbytes = tokens * BYTES_PER_TOKEN
                    row = {"tokens": tokens, "bytes": nbytes, "chunk_size": chunk_size, "backend": "sidecar",
                           "block_order": order, "raw": raw_copy_baseline(nbytes)}  # fmt: skip
                    salt = f"fast{chunk_size}{order}"
                    timings.medians()  # forget phases logged by anything measured before this row
                    row["kvoffload"] = measure(
                        fast, scheduler, pool, tokens, args.reps, salt, order, engine_path=True, forward=forward
                    )
                    row["phases_ms"] = timings.medians()
                    print(json.dumps(row), flush=True)
                    results["sizes"].append(row)
            if args.batch_loads and index == 0:
                row = measure_batched_loads(fast, scheduler, pool, args.batch_loads[1], args.batch_loads[0], args.reps)
                print(json.dumps(row), flush=True)
                results["batched_loads"] = row
            if args.under_load_tokens and index == 0 and DEVICE == "cuda":
                row = measure_under_load(fast, scheduler, pool, args.under_load_tokens, args.reps)
                print(json.dumps(row), flush=True)
                results["under_load"] = row
            fast.close()
            if args.shipped_tokens and index == 0:
                shipped = make_backend(url, pool, fast=False, workdir=workdir)
                row = {
                    "tokens": args.shipped_tokens,
                    "bytes": args.shipped_tokens * BYTES_PER_TOKEN,
                    "chunk_size": chunk_size,
                    "raw": raw_copy_baseline(args.shipped_tokens * BYTES_PER_TOKEN),
                    "lmcache_shipped": measure(shipped, scheduler, pool, args.shipped_tokens, 0, salt="shipped"),
                }
                print(json.dumps(row), flush=True)
                results["shipped"] = row
                shipped.close()
            scheduler.close()
        finally:
            sidecar.terminate()
            sidecar.wait(timeout=60)
            results.setdefault("sidecar_log_tails", []).append(
                (workdir / "sidecar.log").read_text(errors="replace")[-2000:]
            )
    if args.inprocess_tokens:
        results["sizes"] += measure_inprocess(pool, args, workdir, timings)
    print("\n| backend | chunk | block ids | tokens | bytes | raw H2D | raw D2H | store | retrieve | store PREPARE/copy/COMMIT ms "
          "| retrieve PREPARE/copy/COMMIT ms | bit-exact |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in results["sizes"]:
        k, raw, ph = row["kvoffload"], row["raw"], row.get("phases_ms") or {}

        def phases(op: str, ph: dict[str, Any] = ph) -> str:
            p = ph.get(op)
            return f"{p['prepare_ms']:.1f} / {p['copy_ms']:.1f} / {p['commit_ms']:.1f}" if p else "-"

        print(
            f"| {row['backend']} | {row['chunk_size']} | {row.get('block_order', 'contiguous')} | {row['tokens']} | {row['bytes'] / 2**20:.0f} MiB "
            f"| {raw['h2d_gbps']:.1f} GB/s | {raw['d2h_gbps']:.1f} GB/s "
            f"| {k['store_gbps']:.1f} GB/s ({k['store_ms']:.0f} ms) | {k['retrieve_gbps']:.1f} GB/s "
            f"({k['retrieve_ms']:.0f} ms) | {phases('store')} | {phases('retrieve')} | {k['bit_exact']} |"
        )
    print("\nThe engine's load path (PREPAREs at lookup, then start_load_kv's copies):")
    for row in results["sizes"]:
        k = row["kvoffload"]
        if "secured_load_gbps" in k:
            print(f"  {row['tokens']} tokens: look up and secure {k['lookup_and_secure_ms']:.1f} ms (one call: "
                  f"{k['secured_in_one_call']}; its PREPAREs {k['secure_ms']:.1f} ms), then load "
                  f"{k['secured_load_gbps']:.1f} GB/s ({k['secured_load_ms']:.1f} ms; raw H2D {row['raw']['h2d_gbps']:.1f} GB/s); "
                  f"as the engine sees it {k['load_as_seen_gbps']:.1f} GB/s")  # fmt: skip
    if "store_forward_ms" in results:
        print(f"\nThe engine's store path (handed over during a {results['store_forward_ms']:.1f} ms forward pass, "
              "timed from its end):")  # fmt: skip
        for row in results["sizes"]:
            k = row["kvoffload"]
            if "engine_store_gbps" in k:
                print(f"  {row['tokens']} tokens: store {k['engine_store_gbps']:.1f} GB/s ({k['engine_store_ms']:.1f} ms; "
                      f"raw D2H {row['raw']['d2h_gbps']:.1f} GB/s), bit-exact {k['engine_store_bit_exact']}")  # fmt: skip
    if "shipped" in results:
        s = results["shipped"]["lmcache_shipped"]
        print(
            f"LMCache's own copies, {results['shipped']['tokens']} tokens: store {s['store_gbps']:.2f} GB/s, "
            f"retrieve {s['retrieve_gbps']:.2f} GB/s, bit-exact {s['bit_exact']}"
        )
    if "batched_loads" in results:
        b = results["batched_loads"]
        print(
            f"\n{b['loads']} loads of {b['tokens_per_load']} tokens in one iteration (raw H2D {b['raw']['h2d_gbps']:.1f} GB/s): "
            f"one by one {b['one_by_one']['ms']:.1f} ms ({b['one_by_one']['gbps']:.1f} GB/s), "
            f"secured {b['secured']['ms']:.1f} ms ({b['secured']['gbps']:.1f} GB/s, after "
            f"{b['secure_at_lookup']['ms']:.1f} ms of PREPAREs at lookup), bit-exact {b['bit_exact']}"
        )
    if "under_load" in results:
        u = results["under_load"]
        print(f"\nUnder load ({u['tokens']} tokens, a {u['forward_ms']:.0f} ms stand-in forward pass always queued):")
        for name in ("idle", "under_load_transfer_stream", "under_load_device_sync"):
            k = u[name]
            print(
                f"  {name}: store {k['store_ms']:.1f} ms ({k['store_gbps']:.1f} GB/s), "
                f"retrieve {k['retrieve_ms']:.1f} ms ({k['retrieve_gbps']:.1f} GB/s), bit-exact {k['bit_exact']}"
            )
    write_json(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
