"""Lookup + secure of a stored chunk right after N other prompts' stores (COMMITs queued) vs none.

A standalone copy of ``connector_overhead``'s ``lookup_beside_commits`` that runs on older trees too
(their ``release_secured`` lacks the ``secured`` argument), up to the backend's split by role
(issue 47); on later trees the same figure is ``benchmarks.connector_bench``'s
``lookup_beside_commits`` (``make bench``). Run from a tree's root:

    python docs/results/cpu-lookup/lookup-beside-commits.py 60 8
"""

from __future__ import annotations

import inspect
import itertools
import json
import sys
import time
from typing import Any

sys.path.insert(0, ".")

from benchmarks import connector_bench as cb
from benchmarks.common import interleaved, summarize


def main(reps: int, queued: int, warmup: int = 5) -> None:
    cb._standin_on_path()
    from kvoffload.connector.backends.base import KvGeometry
    from kvoffload.connector.backends.cache_server import CacheServerBackend
    from kvoffload.connector.metrics import ConnectorMetrics
    from kvoffload.connector.wire import TransferOp

    shape = cb.OVERHEAD_SHAPE
    chunk, bpc = shape.chunk, shape.chunk // shape.tokens_per_block
    pool = cb._pool(shape, num_blocks=4 * bpc)
    src = tuple(range(bpc))
    l1_gb = round((queued + 2) * (reps + warmup) * chunk * shape.bytes_per_token / 2**30 * 1.3 + 0.5, 2)
    lookups: dict[int, list[float]] = {}
    secures: dict[int, list[float]] = {}
    with cb._server(chunk, l1_gb) as server:
        off = ConnectorMetrics(cb.MODEL, "sidecar", enabled=False)
        worker = CacheServerBackend(cb._settings(server.url, shape), rank=0, role="worker", metrics=off)
        worker.register(pool, KvGeometry(shape.heads, shape.tokens_per_block, shape.head_dim))
        sched = CacheServerBackend(cb._settings(server.url, shape), rank=0, role="scheduler", metrics=off)
        new_release = "secured" in inspect.signature(sched.release_secured).parameters
        ids = itertools.count(1000)

        def op(sid: str, tokens: tuple[int, ...]) -> Any:
            return TransferOp(0, sid, tokens, 0, len(tokens), src, 0, "")

        hot = cb._prompt(1, chunk)
        worker.store(op("warm", hot))
        time.sleep(0.5)  # its COMMIT answered

        def variant(n_queued: int) -> Any:
            def run(_: int) -> float:
                for _ in range(n_queued):
                    n = next(ids)
                    worker.store(op(f"bc{n}", cb._prompt(n, chunk)))
                sid = f"ls{next(ids)}"
                t0 = time.perf_counter()
                hit = sched.lookup(sid, hot, chunk, "")
                t1 = time.perf_counter()
                secured = sched.secure(sid, hot, 0, chunk, "")
                t2 = time.perf_counter()
                assert hit == chunk and secured is not None
                sched.release_secured(sid, hot, 0, chunk, "", *((secured,) if new_release else ()))
                sched.end_session(sid)
                lookups.setdefault(n_queued, []).append(t1 - t0)
                secures.setdefault(n_queued, []).append(t2 - t1)
                return t2 - t0

            return run

        res = interleaved([("idle", variant(0)), ("queued", variant(queued))], reps, warmup)
        worker.close()
        sched.close()
    total = {k: {q: round(v * 1e3, 2) for q, v in summarize(s).items() if q in ("p50", "p99")} for k, s in res.items()}
    parts = {
        f"{name}_{k}": round(summarize(v[warmup:])["p50"] * 1e3, 2)
        for name, d in (("lookup", lookups), ("secure", secures))
        for k, v in d.items()
    }
    print(json.dumps({"queued": queued, "reps": reps, "lookup_plus_secure_ms": total, "p50_parts_ms": parts}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
