"""Where a hit's lookup + secure time goes, by prompt size: each LMCache request of the scheduler's
path timed on its own against the real MP server (CPU only; no GPU is needed or used).

Per size it stores one prompt through the worker backend, then times, median of the warm reps:
``key`` (building the lookup key), ``LOOKUP`` and ``WAIT`` (the two round trips of
``SchedulerClient.lookup``), ``secure`` (PREPARE_RETRIEVE through rank 0's worker,
``SchedulerClient.secure``), ``hook_lookup`` (``SchedulerClient.lookup`` as the hook calls it),
and ``secure_last_chunk`` (PREPARE_RETRIEVE of the prompt's last chunk alone, its other lookup locks
freed first: what a request's cost owes to the tokens its key carries rather than to its chunks).
Run from a tree's root, the stand-in and the tree on the path:

    python docs/results/cpu-lookup/lookup-and-secure-parts.py --tokens 4096 16384 32768 [--chunk 256] [--guarded]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, ".")

from benchmarks import connector_bench as cb
from benchmarks.common import standin_on_path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--server-args", default="", help="extra LMCache MP server arguments")
    parser.add_argument(
        "--guarded", action="store_true", help="run the server as the sidecar does (kvoffload.lmcache_guard)"
    )
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
    server = LMCacheServer(chunk_size=shape.chunk, log_dir=Path(tempfile.mkdtemp(prefix="kvo-parts-")),
                           l1_size_gb=2.0, extra_args=tuple(args.server_args.split()), guarded=args.guarded)  # fmt: skip
    server.start()
    try:
        process = engine_process()
        worker = WorkerBackend(cb._settings(server.url, shape), rank=0, metrics=off, process=process)
        worker.register(pool, KvGeometry(shape.heads, shape.tokens_per_block, shape.head_dim))
        sched = SchedulerClient(cb._settings(server.url, shape), metrics=off, process=process)
        ids = itertools.count()
        print(json.dumps({"pool": shape.describe(), "reps": args.reps, "server_args": args.server_args,
                          "server": "sidecar's (guarded)" if args.guarded else "LMCache's own"}), flush=True)  # fmt: skip
        for n in args.tokens:
            prompt = cb._prompt(n, n)
            blocks = tuple(range(n // shape.tokens_per_block))
            worker.copies.store(TransferOp(0, f"store-{n}", prompt, 0, n, blocks, 0, ""))
            time.sleep(1.0)  # its COMMIT answered
            keys = sched._lookup_keys()
            client = sched.connection.client
            parts: dict[str, list[float]] = {}
            for rep in range(args.reps + 2):
                sid = f"parts-{next(ids)}"
                t0 = time.perf_counter()
                key = keys.key(sid, prompt, 0, n, "", worker=False)
                t1 = time.perf_counter()
                client.lookup(key, 1).result(timeout=5)
                t2 = time.perf_counter()
                hit_chunks = client.wait_prefetch_status(sid, 5.0).result(timeout=5)
                t3 = time.perf_counter()
                secured = sched.secure(sid, prompt, 0, n, "")
                t4 = time.perf_counter()
                assert hit_chunks * shape.chunk == n and secured is not None, (hit_chunks, secured)
                sched.release_secured(sid, prompt, 0, n, "", secured)
                sched.end_session(sid)
                t5 = time.perf_counter()
                hook_sid = f"parts-{next(ids)}"
                hook_hit = sched.lookup(hook_sid, prompt, n, "")
                t6 = time.perf_counter()
                assert hook_hit == n, hook_hit
                last = n - shape.chunk
                if last:
                    sched.free_lookup_locks(hook_sid, prompt, ((0, last),), "")
                t7 = time.perf_counter()
                tail = sched.secure(hook_sid, prompt, last, n, "")
                t8 = time.perf_counter()
                assert tail is not None
                sched.release_secured(hook_sid, prompt, last, n, "", tail)
                sched.end_session(hook_sid)
                if rep >= 2:  # two warm-up reps
                    timed = {"key": t1 - t0, "LOOKUP": t2 - t1, "WAIT": t3 - t2, "secure": t4 - t3,
                             "hook_lookup": t6 - t5, "secure_last_chunk": t8 - t7}  # fmt: skip
                    for name, seconds in timed.items():
                        parts.setdefault(name, []).append(seconds * 1e3)
            medians = {f"{name}_ms": round(statistics.median(v), 2) for name, v in parts.items()}
            print(json.dumps({"tokens": n, "chunk": shape.chunk, **medians}), flush=True)
        worker.close()
        sched.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
