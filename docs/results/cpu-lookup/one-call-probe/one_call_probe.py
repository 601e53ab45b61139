"""How much of a hit's lookup + secure one server call would save: the connector's path (LOOKUP,
WAIT, PREPARE_RETRIEVE: three round trips) against the same three LMCache handlers run server-side
in one call (``kvo_one_call_probe``), with each handler's time inside the server. CPU only, real
LMCache MP server. Run from a tree's root:

    python docs/results/cpu-lookup/one-call-probe/one_call_probe.py --tokens 4096 16384 32768
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path.insert(0, ".")

from benchmarks import connector_bench as cb
from benchmarks.common import standin_on_path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    standin_on_path()
    from kvoffload.connector.backends.base import KvGeometry
    from kvoffload.connector.backends.scheduler_client import SchedulerClient
    from kvoffload.connector.backends.worker_backend import WorkerBackend
    from kvoffload.connector.lmcache_seam import IPCCacheServerKey, ServerModuleCallRequest
    from kvoffload.connector.metrics import ConnectorMetrics
    from kvoffload.connector.runtime import engine_process
    from kvoffload.connector.wire import TransferOp
    from tests.support.lmcache_server import LMCacheServer

    sys.path.insert(0, str(HERE))
    from kvo_one_call_probe import METHOD

    shape = cb.OVERHEAD_SHAPE
    pool = cb._pool(shape, num_blocks=max(args.tokens) // shape.tokens_per_block + 4)
    off = ConnectorMetrics(cb.MODEL, "sidecar", enabled=False)
    os.environ["PYTHONPATH"] = f"{HERE}:{os.environ.get('PYTHONPATH', '')}"
    server = LMCacheServer(chunk_size=shape.chunk, log_dir=Path(tempfile.mkdtemp(prefix="kvo-probe-")), l1_size_gb=2.0,
                           extra_args=("--server-module", json.dumps({"module_path": "kvo_one_call_probe"})))  # fmt: skip
    server.start()
    try:
        process = engine_process()
        worker = WorkerBackend(cb._settings(server.url, shape), rank=0, metrics=off, process=process)
        worker.register(pool, KvGeometry(shape.heads, shape.tokens_per_block, shape.head_dim))
        sched = SchedulerClient(cb._settings(server.url, shape), metrics=off, process=process)
        instance, model = worker._instance_id, sched._lookup_keys().model
        ids = itertools.count()
        print(json.dumps({"pool": shape.describe(), "reps": args.reps}), flush=True)
        for n in args.tokens:
            prompt = cb._prompt(n, n)
            worker.copies.store(
                TransferOp(0, f"store-{n}", prompt, 0, n, tuple(range(n // shape.tokens_per_block)), 0, "")
            )
            time.sleep(1.0)
            today: list[float] = []
            one_call: list[float] = []
            inside: dict[str, list[float]] = {}
            for rep in range(args.reps + 2):
                sid = f"today-{next(ids)}"
                t0 = time.perf_counter()
                hit = sched.lookup(sid, prompt, n, "")
                secured = sched.secure(sid, prompt, 0, hit, "")
                t1 = time.perf_counter()
                assert hit == n and secured is not None
                sched.release_secured(sid, prompt, 0, n, "", secured)
                sched.end_session(sid)
                sid = f"probe-{next(ids)}"
                payload = msgspec.msgpack.encode({"tokens": list(prompt), "model": model, "end": n, "session": sid,
                                                  "chunk": shape.chunk, "cap": n, "start": 0, "instance": instance})  # fmt: skip
                t2 = time.perf_counter()
                answer = sched.connection.client.server_module_call(
                    ServerModuleCallRequest(method=METHOD, payload=payload)
                ).result(timeout=10)
                got = msgspec.msgpack.decode(answer.payload)
                t3 = time.perf_counter()
                assert answer.success and got["hit"] == n and len(got["slots"]) == n // shape.chunk, answer.error
                key = IPCCacheServerKey(model_name=model, world_size=1, worker_id=0, token_ids=tuple(prompt), start=0, end=n,
                                        request_id=sid, cache_salt="", num_kv_readers=1)  # fmt: skip
                worker.connection.client.commit_retrieve(key, instance).result(timeout=10)
                sched.end_session(sid)
                if rep >= 2:
                    today.append((t1 - t0) * 1e3)
                    one_call.append((t3 - t2) * 1e3)
                    for name, seconds in got["server_s"].items():
                        inside.setdefault(name, []).append(seconds * 1e3)
            row = {"tokens": n, "lookup_then_secure_ms": round(statistics.median(today), 2),
                   "one_call_ms": round(statistics.median(one_call), 2),
                   **{f"in_server_{k}_ms": round(statistics.median(v), 2) for k, v in inside.items()}}  # fmt: skip
            print(json.dumps(row), flush=True)
        worker.close()
        sched.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
