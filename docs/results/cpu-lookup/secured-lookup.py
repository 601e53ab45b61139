"""A hit's lookup and securing apart (LOOKUP, WAIT, PREPARE_RETRIEVE: three requests) and in one
secured lookup (``kvoffload.secured_lookup``), alternately, against the real LMCache MP server run
as the sidecar runs it (CPU only; no GPU is needed or used).

Per size it stores one prompt through the worker backend, then times, median of the warm reps, the
scheduler client's ``lookup`` + ``secure`` and its ``lookup_and_secure`` of the same prompt, each
followed by the load's release and its session's end (not timed); the secured slots must be equal.
``one_call_server_ms``: the part of the one call the server spent on it (the answer's ``server_s``);
the rest is the client's encoding and decoding and LMCache's transport. ``probe_ms``: a call the
server answers without doing anything (the module's probe), between repetitions, with a pause
on either side.
Run from a tree's root, the stand-in and the tree on the path:

    python docs/results/cpu-lookup/secured-lookup.py --tokens 4096 16384 32768 [--reps 40] [--chunk 256] [--pause-ms 0]

The server logs as the sidecar's does (LMCache's per-request INFO lines left out) unless
``LMCACHE_LOG_LEVEL`` says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, ".")

from benchmarks import connector_bench as cb
from benchmarks.common import standin_on_path


def probe_ms(sched: Any) -> float:
    """Milliseconds of one call that does nothing on the server (the secured lookup's probe): what
    LMCache's request path costs by itself."""
    from kvoffload import secured_lookup
    from kvoffload.connector.lmcache_seam import ServerModuleCallRequest

    request = ServerModuleCallRequest(method=secured_lookup.METHOD, payload=secured_lookup.PROBE)
    t0 = time.perf_counter()
    response = sched.connection.client.server_module_call(request).result(timeout=5)
    spent = (time.perf_counter() - t0) * 1e3
    assert response.payload == secured_lookup.PROBE_ANSWER
    return spent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--pause-ms", type=float, default=0.0,
                        help="wait after each release, so that the next call finds the server quiet")  # fmt: skip
    args = parser.parse_args()
    standin_on_path()
    from kvoffload.connector.backends.base import KvGeometry
    from kvoffload.connector.backends.scheduler_client import SchedulerClient
    from kvoffload.connector.backends.worker_backend import WorkerBackend
    from kvoffload.connector.metrics import ConnectorMetrics
    from kvoffload.connector.runtime import engine_process
    from kvoffload.connector.wire import TransferOp
    from tests.support.lmcache_server import LMCacheServer

    shape = dataclasses.replace(cb.OVERHEAD_SHAPE, chunk=args.chunk)
    pool = cb._pool(shape, num_blocks=max(args.tokens) // shape.tokens_per_block + 4)
    off = ConnectorMetrics(cb.MODEL, "sidecar", enabled=False)
    level = os.environ.get("LMCACHE_LOG_LEVEL", "INFO")
    server = LMCacheServer(chunk_size=shape.chunk, log_dir=Path(tempfile.mkdtemp(prefix="kvo-secured-")),
                           l1_size_gb=2.0, guarded=True, env={"LMCACHE_LOG_LEVEL": level})  # fmt: skip
    server.start()
    try:
        process = engine_process()
        worker = WorkerBackend(cb._settings(server.url, shape), rank=0, metrics=off, process=process)
        worker.register(pool, KvGeometry(shape.heads, shape.tokens_per_block, shape.head_dim))
        sched = SchedulerClient(cb._settings(server.url, shape), metrics=off, process=process)
        deadline = time.monotonic() + 10
        while not sched.looks_up_in_one_call:
            assert time.monotonic() < deadline, "the server has no secured lookups"
            time.sleep(0.05)
        ids = itertools.count()
        print(json.dumps({"pool": shape.describe(), "reps": args.reps, "server_log_level": level}), flush=True)
        for n in args.tokens:
            prompt = cb._prompt(n, n)
            blocks = tuple(range(n // shape.tokens_per_block))
            worker.copies.store(TransferOp(0, f"store-{n}", prompt, 0, n, blocks, 0, ""))
            assert worker.wait_commits(10.0)
            timed: dict[str, list[float]] = {"apart": [], "one_call": [], "one_call_server": [], "probe": []}
            for rep in range(args.reps + 2):
                sid = f"apart-{next(ids)}"
                t0 = time.perf_counter()
                hit = sched.lookup(sid, prompt, n, "")
                apart = sched.secure(sid, prompt, 0, n, "")
                t1 = time.perf_counter()
                assert hit == n and apart is not None
                sched.release_secured(sid, prompt, 0, n, "", apart)
                sched.end_session(sid)
                time.sleep(args.pause_ms / 1e3)
                sid = f"one-{next(ids)}"
                t2 = time.perf_counter()
                found = sched.lookup_and_secure(sid, prompt, n, "", 0, n)
                t3 = time.perf_counter()
                assert found is not None and found.hit == n and found.load is not None
                assert found.load.slots == apart.slots
                sched.release_secured(sid, prompt, 0, n, "", found.load)
                sched.end_session(sid)
                time.sleep(args.pause_ms / 1e3)
                probe = probe_ms(sched)
                time.sleep(args.pause_ms / 1e3)  # the next call finds the server quiet too, not just probed
                if rep >= 2:  # two warm-up reps
                    timed["apart"].append((t1 - t0) * 1e3)
                    timed["one_call"].append((t3 - t2) * 1e3)
                    timed["one_call_server"].append(found.server_s * 1e3)
                    timed["probe"].append(probe)
            summary = {f"{name}_ms": {"median": round(statistics.median(v), 2),
                                      "p90": round(statistics.quantiles(v, n=10)[-1], 2)}
                       for name, v in timed.items()}  # fmt: skip
            print(json.dumps({"tokens": n, "chunk": shape.chunk, **summary}), flush=True)
        worker.close()
        sched.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
