"""Small measurements for docs/connector.md (not collected by pytest).

    PYTHONHASHSEED=0 .venv/bin/python -m tests.integration.connector.bench_connector metrics
    PYTHONHASHSEED=0 .venv/bin/python -m tests.integration.connector.bench_connector saves
    PYTHONHASHSEED=0 .venv/bin/python -m tests.integration.connector.bench_connector transfer
    PYTHONHASHSEED=0 .venv/bin/python -m tests.integration.connector.bench_connector copies

``metrics``: cost of the instrumentation one connector operation records (prometheus_client
multiprocess mode, the mode the connector runs in). ``saves``: stand-in workload wall time with
synchronous vs asynchronous saves against a real lmcache server. ``transfer``: store/retrieve
throughput of the sidecar data path for a TensorRT-LLM-shaped CPU pool.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import best_ns_per_call

REPO = Path(__file__).resolve().parents[3]


def bench_metrics(n: int = 200_000) -> None:
    """ns per lookup/retrieve/store record (the calls a hook makes), multiprocess mode."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="kvo-metrics-")
    from importlib.metadata import version

    from kvoffload.connector.metrics import ConnectorMetrics

    m = ConnectorMetrics("bench-model", "sidecar")

    def direct_lookup() -> None:  # what a hook would cost calling prometheus_client directly
        m.lookup_seconds.observe(0.0012)
        m.lookup_requests.inc()
        m.lookup_queried_tokens.inc(256)
        m.lookup_hit_tokens.inc(256)

    def single_inc() -> None:
        m.lookup_requests.inc()

    def recorded_lookup() -> None:  # what the hooks do: one deque append, applied by the flusher
        m.record_lookup(0.0012, 256, 256)

    def recorded_with_clock() -> None:  # the same plus the two perf_counter() calls a hook makes
        t0 = time.perf_counter()
        m.record_retrieve(time.perf_counter() - t0, 256, 1 << 25)

    cases = (
        ("prometheus_client Counter.inc", single_inc),
        ("direct: Histogram.observe + 3 Counter.inc", direct_lookup),
        ("hook: record_lookup", recorded_lookup),
        ("hook: 2 x perf_counter + record_retrieve", recorded_with_clock),
    )
    for name, fn in cases:
        for _ in range(1000):
            fn()
        m.flush()
        best = best_ns_per_call(fn, n, m.flush)
        print(f"{name}: {best:.0f} ns/op (best of 5)")
    for _ in range(10000):
        recorded_lookup()
    t1 = time.perf_counter_ns()
    m.flush()
    print(f"flusher (background): {(time.perf_counter_ns() - t1) / 10000:.0f} ns per recorded op")
    print(
        f"prometheus_client {version('prometheus_client')}, multiprocess dir {os.environ['PROMETHEUS_MULTIPROC_DIR']}"
    )


def _workload(async_save: bool, url: str, n_requests: int) -> tuple[float, float]:
    os.environ["KVOFFLOAD_ASYNC_SAVE"] = "true" if async_save else "false"
    from tests.support.trtllm_executor import PromptRequest, StandinExecutor, connector_llm_args, make_prompt

    ex = StandinExecutor(
        connector_llm_args(f"bench-{async_save}-{time.time_ns()}", url),
        num_blocks=1024,
        num_layers=8,
        num_kv_heads=8,
        head_dim=64,
        context_chunk_size=128,
    )
    worker = ex.rank0.worker
    original = worker.wait_for_save
    blocked = [0.0]

    def timed_wait_for_save(stream: object) -> None:
        t = time.perf_counter()
        original(stream)
        blocked[0] += time.perf_counter() - t

    worker.wait_for_save = timed_wait_for_save
    try:
        prompts = [PromptRequest(i, make_prompt(1000 + i, 512), 4) for i in range(n_requests)]
        t0 = time.perf_counter()
        ex.run(prompts)
        return time.perf_counter() - t0, blocked[0]
    finally:
        ex.close()


def bench_saves() -> None:
    """Wall time of a chunked-prefill workload that stores everything, sync vs async saves."""
    from tests.support.lmcache_server import LMCacheServer

    server = LMCacheServer(chunk_size=64, log_dir=Path(tempfile.mkdtemp(prefix="kvo-bench-")), l1_size_gb=1.0)
    server.start()
    try:
        _workload(False, server.url, 2)  # warm-up
        for async_save in (False, True, False, True, False, True):
            wall, blocked = _workload(async_save, server.url, 8)
            print(f"async_save={async_save}: wall {wall:.2f} s, engine blocked in wait_for_save {blocked * 1e3:.0f} ms "
                  "(8 x 512-token prompts, chunked prefill 128)")  # fmt: skip
    finally:
        server.stop()


def bench_transfer(argv: list[str] | None = None) -> None:
    """Store/retrieve GB/s of the sidecar path (kvoffload blockcopy vs LMCache gather/scatter), any device."""
    import argparse

    import torch

    from kvoffload.connector.backends.base import KvGeometry
    from kvoffload.connector.backends.scheduler_client import SchedulerClient
    from kvoffload.connector.backends.worker_backend import WorkerBackend
    from kvoffload.connector.metrics import ConnectorMetrics
    from kvoffload.connector.runtime import engine_process
    from kvoffload.connector.settings import parse_settings
    from kvoffload.connector.wire import TransferOp
    from tests.support.lmcache_server import LMCacheServer
    from tests.support.trtllm_executor import connector_llm_args, make_prompt

    parser = argparse.ArgumentParser(prog="bench_connector transfer")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--l1-gb", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args(argv)
    block, chunk, layers, heads, hd, tokens = (
        args.block,
        args.chunk,
        args.layers,
        args.heads,
        args.head_dim,
        args.tokens,
    )
    dtype = getattr(torch, args.dtype)
    server = LMCacheServer(chunk_size=chunk, log_dir=Path(tempfile.mkdtemp(prefix="kvo-bench-")), l1_size_gb=args.l1_gb)
    server.start()
    try:
        settings = parse_settings({"KVOFFLOAD_STORE_TIMEOUT_MS": "120000", "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "120000",
                                   "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "10000"},
                                  connector_llm_args("xfer", server.url, block=block))  # fmt: skip
        nb = tokens // block * 2 + 1
        pool = torch.randint(-1000, 1000, (nb, layers, 2, heads * block * hd), dtype=torch.int16, device=args.device)
        pool = pool.view(dtype)
        off = ConnectorMetrics("x", "sidecar", enabled=False)
        sched = SchedulerClient(settings, metrics=off, process=engine_process())
        toks = tuple(make_prompt(99, tokens))
        nbytes = tokens // block * pool[0].numel() * pool.element_size()
        print(f"pool {tuple(pool.shape)} {dtype} on {pool.device}; block = {pool[0].numel() * pool.element_size() / 2**20:.1f} MiB; "
              f"moving {nbytes / 2**20:.0f} MiB per op; torch {torch.__version__}")  # fmt: skip
        if pool.is_cuda:  # the copy ceiling, measured in the same run
            host = torch.empty(nbytes // 2, dtype=torch.int16, pin_memory=True)
            dev = torch.empty(nbytes // 2, dtype=torch.int16, device=pool.device)
            for direction in ("H2D", "D2H", "H2D", "D2H"):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                (dev.copy_(host, non_blocking=True) if direction == "H2D" else host.copy_(dev, non_blocking=True))
                torch.cuda.synchronize()
                print(f"raw pinned {direction} {nbytes / (time.perf_counter() - t0) / 1e9:.1f} GB/s")
            del host, dev
        for rep in range(2 * args.reps):
            fast = rep % 2 == 1
            backend = WorkerBackend(settings, rank=0, metrics=off, process=engine_process(), use_fast_copies=fast)
            backend.register(pool, KvGeometry(heads, block, hd))
            sid = f"s{rep}"
            blocks = tuple(range(tokens // block))
            dst = tuple(range(tokens // block, 2 * (tokens // block)))
            try:
                t0 = time.perf_counter()
                backend.copies.store(TransferOp(rep, sid, toks, 0, tokens, blocks, 0, f"rep{rep}"))
                t_store = time.perf_counter() - t0
                while not sched.is_up():  # a slow server may have missed a heartbeat
                    time.sleep(0.1)
                hit = sched.lookup(sid + "r", toks, tokens, f"rep{rep}")
                t0 = time.perf_counter()
                backend.copies.retrieve(TransferOp(rep, sid + "r", toks, 0, hit, dst, 0, f"rep{rep}"))
                t_ret = time.perf_counter() - t0
            except Exception as exc:
                print(f"{'blockcopy' if fast else 'lmcache  '} FAILED: {exc!r}", flush=True)
                backend.close()
                continue
            exact = torch.equal(pool[list(blocks)].view(torch.int16), pool[list(dst)].view(torch.int16))
            print(f"{'blockcopy' if fast else 'lmcache  '} store {t_store * 1e3:.1f} ms ({nbytes / t_store / 1e9:.2f} GB/s), "
                  f"retrieve {t_ret * 1e3:.1f} ms ({nbytes / t_ret / 1e9:.2f} GB/s), hit={hit} bit-exact={exact}", flush=True)  # fmt: skip
            pool[list(dst)] = 0
            backend.close()
        sched.close()
    finally:
        server.stop()
        print("server log (transfer lines):")
        for line in server.log_text().splitlines():
            if "transfer strategy" in line or "Error" in line or "pinned" in line:
                print("  ", line[-200:])


def bench_copies(tokens: int = 4096) -> None:
    """Block->chunk copy alone: LMCache's gather_paged_kv_to_cpu (its layout) vs blockcopy.gather_chunk (block bytes)."""
    import torch
    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.transfer_context.base import compute_kv_layout, gather_paged_kv_to_cpu

    from kvoffload.connector.backends.blockcopy import gather_chunk

    block, layers, heads, hd, chunk = 16, 8, 8, 128, 256
    nb, bpc = tokens // block, chunk // block
    pool = torch.randint(-1000, 1000, (nb, layers, 2, heads * block * hd), dtype=torch.int16).view(torch.float16)
    hints = {"kv_layout": "HND", "num_kv_heads": heads, "tokens_per_block": block, "head_dim": hd}
    kv = {"kv": pool}
    fmt = compute_kv_layout(kv, layout_hints=hints, engine_type=EngineType.TRTLLM)[4]  # type: ignore[arg-type]
    nbytes = pool.numel() * 2
    for _ in range(3):
        t0 = time.perf_counter()
        theirs = gather_paged_kv_to_cpu(kv, list(range(nb)), bpc, layout_hints=hints, engine_kv_format=fmt,  # type: ignore[arg-type]
                                        engine_type=EngineType.TRTLLM)  # fmt: skip
        t1 = time.perf_counter()
        mine = [torch.empty_like(c) for c in theirs]
        t2 = time.perf_counter()
        for i, out in enumerate(mine):
            gather_chunk(pool, range(i * bpc, (i + 1) * bpc), out)
        t3 = time.perf_counter()
        same = all(
            torch.equal(c.reshape(-1).view(torch.int16), pool[i * bpc : (i + 1) * bpc].reshape(-1).view(torch.int16))
            for i, c in enumerate(mine)
        )
        print(f"{nbytes / 2**20:.0f} MiB: lmcache gather {(t1 - t0) * 1e3:.0f} ms ({nbytes / (t1 - t0) / 1e9:.2f} GB/s), "
              f"blockcopy {(t3 - t2) * 1e3:.0f} ms ({nbytes / (t3 - t2) / 1e9:.2f} GB/s), blocks intact={same}")  # fmt: skip


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("kvoffload").setLevel(logging.DEBUG if os.environ.get("KVO_BENCH_DEBUG") else logging.INFO)
    sys.path[:0] = [str(REPO), str(REPO / "tests" / "standin")]
    if sys.argv[1] == "transfer":
        bench_transfer(sys.argv[2:])
    else:
        {"metrics": bench_metrics, "saves": bench_saves, "copies": bench_copies}[sys.argv[1]]()
