"""Lookup + secure of a stored chunk right after N unrelated stores (COMMITs queued) vs none; any tree."""
import inspect, itertools, json, sys, time
sys.path.insert(0, ".")
from benchmarks import connector_bench as cb
from benchmarks.common import interleaved, summarize

def main(reps: int, queued: int) -> None:
    cb._standin_on_path()
    from kvoffload.connector.backends.base import KvGeometry
    from kvoffload.connector.backends.cache_server import CacheServerBackend
    from kvoffload.connector.metrics import ConnectorMetrics
    from kvoffload.connector.planning import TransferOp
    shape = cb.OVERHEAD_SHAPE
    chunk, bpc = shape.chunk, shape.chunk // shape.tokens_per_block
    pool = cb._pool(shape, num_blocks=4 * bpc)
    src = tuple(range(bpc))
    l1 = round((queued + 2) * (reps + 5) * chunk * shape.bytes_per_token / 2**30 * 1.3 + 0.5, 2)
    with cb._server(chunk, l1) as server:
        off = ConnectorMetrics(cb.MODEL, "sidecar", enabled=False)
        worker = CacheServerBackend(cb._settings(server.url, shape), rank=0, role="worker", metrics=off)
        worker.register(pool, KvGeometry(shape.heads, shape.tokens_per_block, shape.head_dim))
        sched = CacheServerBackend(cb._settings(server.url, shape), rank=0, role="scheduler", metrics=off)
        new_release = "secured" in inspect.signature(sched.release_secured).parameters
        ids = itertools.count(1000)
        op = lambda sid, toks: TransferOp(0, sid, toks, 0, len(toks), src, 0, "")
        hot = cb._prompt(1, chunk)
        worker.store(op("warm", hot)); time.sleep(0.5)
        def variant(n_queued):
            def run(_):
                for _ in range(n_queued):
                    n = next(ids); worker.store(op(f"bc{n}", cb._prompt(n, chunk)))
                sid = f"ls{next(ids)}"
                t0 = time.perf_counter()
                hit = sched.lookup(sid, hot, chunk, "")
                t1 = time.perf_counter()
                secured = sched.secure(sid, hot, 0, chunk, "")
                t2 = time.perf_counter()
                assert hit == chunk and secured is not None
                args = (sid, hot, 0, chunk, "") + ((secured,) if new_release else ())
                sched.release_secured(*args)
                sched.end_session(sid)
                lk.setdefault(n_queued, []).append(t1 - t0); sc.setdefault(n_queued, []).append(t2 - t1)
                return t2 - t0
            return run
        lk, sc = {}, {}
        res = interleaved([("idle", variant(0)), ("queued", variant(queued))], reps, 5)
        worker.close(); sched.close()
    out = {k: {q: round(v * 1e3, 2) for q, v in summarize(s).items() if q in ("p50", "p99")} for k, s in res.items()}
    parts = {f"{name}_{k}": round(summarize(v[5:])["p50"] * 1e3, 2) for name, d in (("lookup", lk), ("secure", sc)) for k, v in d.items()}
    print(json.dumps({"queued": queued, "reps": reps, "lookup_plus_secure_ms": out, "p50_parts_ms": parts}))

main(int(sys.argv[1]), int(sys.argv[2]))
