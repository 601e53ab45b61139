"""Small measurements for docs/connector.md (not collected by pytest).

    PYTHONHASHSEED=0 .venv/bin/python -m tests.integration.connector.bench_connector metrics
    PYTHONHASHSEED=0 .venv/bin/python -m tests.integration.connector.bench_connector saves
    PYTHONHASHSEED=0 .venv/bin/python -m tests.integration.connector.bench_connector transfer

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
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter_ns()
            for _ in range(n // 5):
                fn()
            best = min(best, (time.perf_counter_ns() - t0) / (n // 5))
            m.flush()
        print(f"{name}: {best:.0f} ns/op (best of 5)")
    t0 = time.perf_counter_ns()
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


def bench_transfer(tokens: int = 4096) -> None:
    """Store/retrieve GB/s of the sidecar path, CPU pool [NB, 8 layers, 2, 8 heads*16 tokens*128] fp16."""
    import torch

    from kvoffload.connector.backends.base import KvGeometry
    from kvoffload.connector.backends.sidecar import SidecarBackend
    from kvoffload.connector.metrics import ConnectorMetrics
    from kvoffload.connector.planning import TransferOp
    from kvoffload.connector.settings import parse_settings
    from tests.support.lmcache_server import LMCacheServer
    from tests.support.trtllm_executor import connector_llm_args, make_prompt

    block, chunk, layers, heads, hd = 16, 256, 8, 8, 128
    server = LMCacheServer(chunk_size=chunk, log_dir=Path(tempfile.mkdtemp(prefix="kvo-bench-")), l1_size_gb=2.0)
    server.start()
    try:
        settings = parse_settings({"KVOFFLOAD_STORE_TIMEOUT_MS": "60000", "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "60000"},
                                  connector_llm_args("xfer", server.url, block=block))  # fmt: skip
        nb = tokens // block * 2 + 1
        pool = torch.randint(-1000, 1000, (nb, layers, 2, heads * block * hd), dtype=torch.int16).view(torch.float16)
        off = ConnectorMetrics("x", "sidecar", enabled=False)
        sched = SidecarBackend(settings, rank=0, role="scheduler", metrics=off)
        toks = tuple(make_prompt(99, tokens))
        nbytes = tokens // block * pool[0].numel() * 2
        for rep, fast in enumerate((False, True, False, True, False, True)):
            backend = SidecarBackend(settings, rank=0, role="worker", metrics=off, use_fast_copies=fast)
            backend.register(pool, KvGeometry(heads, block, hd))
            sid = f"s{rep}"
            blocks = tuple(range(tokens // block))
            t0 = time.perf_counter()
            backend.store(TransferOp(rep, sid, toks, 0, tokens, blocks, 0, f"rep{rep}"))
            t_store = time.perf_counter() - t0
            hit = sched.lookup(sid + "r", toks, tokens, f"rep{rep}")
            dst = tuple(range(tokens // block, 2 * (tokens // block)))
            t0 = time.perf_counter()
            backend.retrieve(TransferOp(rep, sid + "r", toks, 0, hit, dst, 0, f"rep{rep}"))
            t_ret = time.perf_counter() - t0
            exact = torch.equal(pool[list(blocks)].view(torch.int16), pool[list(dst)].view(torch.int16))
            print(f"{'blockcopy' if fast else 'lmcache  '} {tokens} tokens = {nbytes / 2**20:.0f} MiB: store {t_store * 1e3:.1f} ms ({nbytes / t_store / 1e9:.2f} GB/s), "
                  f"retrieve {t_ret * 1e3:.1f} ms ({nbytes / t_ret / 1e9:.2f} GB/s), bit-exact={exact}")  # fmt: skip
            pool[list(dst)] = 0
            backend.close()
        sched.close()
    finally:
        server.stop()


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "tests" / "standin")]
    {"metrics": bench_metrics, "saves": bench_saves, "transfer": bench_transfer}[sys.argv[1]]()
