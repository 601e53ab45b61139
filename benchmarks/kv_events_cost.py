"""The connector's per-store cost with KV events on vs off, same run, same server.

One LMCache server started from the sidecar's command line with the KV-event module
(``KVOFFLOAD_KV_EVENTS_PORT``) and a ZMQ subscriber reading its events; two worker backends on it,
one with ``KVOFFLOAD_KV_EVENTS`` on, one off. Each store is a fresh one-chunk prompt (256 tokens,
``connector_bench.OVERHEAD_SHAPE``; with ``--prompt-tokens N`` the last chunk of an N-token prompt), the
variants interleaved round by round. Per store:

* ``store_ms``: ``PoolCopies.store`` (a worker backend's) on the calling (engine's saver) thread: PREPARE, copies,
  COMMIT queued;
* ``published_ms``: from the store's start until its COMMIT was answered and, with events on, the
  report sent (the committer thread's work: what a lookup of the same prompt would wait for);
* ``event_ms`` (events on): from the store's start until the subscriber holds the ``BlockStored``.

    python -m benchmarks.kv_events_cost [--reps 300] [--prompt-tokens 256]

Prints JSON. Asserts nothing about timings (benchmarks are not tests).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import interleaved, machine_info, standin_on_path, summarize
from benchmarks.connector_bench import MODEL, OVERHEAD_SHAPE, _pool, _prompt, _settings


def _sidecar_server(chunk: int, l1: str, events_port: int) -> Any:
    from tests.support.lmcache_server import sidecar_events_server

    log_dir = Path(tempfile.mkdtemp(prefix="kvo-bench-events-"))
    return sidecar_events_server(log_dir, chunk, l1, events_port, f"bench-events-{events_port}", {})


def kv_events_cost(reps: int, prompt_tokens: int, warmup: int = 5) -> dict[str, Any]:
    """Each store writes the last chunk of a fresh ``prompt_tokens``-token prompt (the report carries
    all of its tokens, and the server hashes them from the first)."""
    standin_on_path()
    import msgspec
    import zmq

    from hack.ports import free_port
    from kvoffload.connector.backends.base import KvGeometry
    from kvoffload.connector.backends.worker_backend import WorkerBackend
    from kvoffload.connector.metrics import ConnectorMetrics
    from kvoffload.connector.runtime import engine_process
    from kvoffload.connector.wire import TransferOp

    shape = OVERHEAD_SHAPE
    chunk, bpc = shape.chunk, shape.chunk // shape.tokens_per_block
    geometry = KvGeometry(shape.heads, shape.tokens_per_block, shape.head_dim)
    pool = _pool(shape, num_blocks=2 * bpc)
    src = tuple(range(bpc))
    events_port = free_port()
    stores = 2 * (reps + warmup)
    l1_mib = max(256, int(stores * chunk * shape.bytes_per_token / 2**20 * 1.5))
    server = _sidecar_server(chunk, f"{l1_mib}Mi", events_port)
    server.start()
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    metrics = ConnectorMetrics(MODEL, "sidecar", enabled=False)
    backends = {
        on: WorkerBackend(
            _settings(server.url, shape, {"KVOFFLOAD_KV_EVENTS": "true" if on else "false"}),
            rank=0, metrics=metrics, process=engine_process(),
        )
        for on in (False, True)
    }  # fmt: skip
    for backend in backends.values():
        backend.register(pool, geometry)
    ids = itertools.count(10_000)
    event_ms: list[float] = []
    published: dict[str, list[float]] = {"events_off": [], "events_on": []}
    received = 0

    def wait_for_stored(deadline: float) -> float | None:
        nonlocal received
        while time.perf_counter() < deadline:
            if not sub.poll(50):
                continue
            _topic, _seq, payload = sub.recv_multipart()
            events = msgspec.msgpack.decode(payload)[1]
            received += len(events)
            if any(e[0] == "BlockStored" for e in events):
                return time.perf_counter()
        return None

    def store_with(on: bool) -> Any:
        name = "events_on" if on else "events_off"

        def run(i: int) -> float:
            n = next(ids)
            sid = f"bench-events-{n}"
            op = TransferOp(0, sid, _prompt(n, prompt_tokens), prompt_tokens - chunk, prompt_tokens, src, 0, "")
            t0 = time.perf_counter()
            assert backends[on].copies.store(op) > 0, "store failed"
            t1 = time.perf_counter()
            assert engine_process().pending.wait_session(sid, 30.0), "COMMIT not answered"
            t2 = time.perf_counter()
            if i >= warmup:
                published[name].append((t2 - t0) * 1e3)
            if on:
                got = wait_for_stored(t0 + 5.0)
                if got is not None and i >= warmup:
                    event_ms.append((got - t0) * 1e3)
            return (t1 - t0) * 1e3

        return run

    try:
        time.sleep(1.0)  # the subscriber joins (and gets its snapshot) before the first store
        wait_for_stored(time.perf_counter() + 0.5)
        store_ms = interleaved([("events_off", store_with(False)), ("events_on", store_with(True))], reps, warmup)
    finally:
        for backend in backends.values():
            backend.close()
        sub.close(0)
        context.term()
        server.stop()
    return {
        "machine": machine_info(),
        "command": " ".join(["python", "-m", "benchmarks.kv_events_cost", *sys.argv[1:]]),
        "chunk_tokens": chunk,
        "prompt_tokens": prompt_tokens,
        "chunk_bytes": chunk * shape.bytes_per_token,
        "store_ms": {k: summarize(v) for k, v in store_ms.items()},
        "published_ms": {k: summarize(v) for k, v in published.items()},
        "event_ms": summarize(event_ms),
        "events_received": received,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument(
        "--prompt-tokens", type=int, default=256, help="a multiple of 256; each store is its last chunk"
    )
    args = parser.parse_args()
    print(json.dumps(kv_events_cost(args.reps, args.prompt_tokens), indent=2))


if __name__ == "__main__":
    main()
