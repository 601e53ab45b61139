"""Small round trips (GET_CHUNK_SIZE) through LMCache's own client to the sidecar's guarded server,
plain and with node mode's CURVE keys; prints p50/p90/p99 in microseconds per run.

Run from the repository root with the project's venv: ``python docs/results/node-cache-curve/round-trip.py``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import zmq
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

from kvoffload import contract
from kvoffload.cache_keys import read_client_keys
from kvoffload.connector.backends.connection import authenticate_as_client
from tests.support.cache_keys import policy_keys

ROUND_TRIPS = 2000
KEYS_ROOT = Path("/tmp/kvo-curve-rtt-keys")


def start(port: int, keys: Path | None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    if keys is not None:
        env[contract.ENV_CACHE_KEYS_DIR] = str(keys)
    argv = [sys.executable, "-m", "kvoffload.sidecar.lmcache_server", "server", "--host", "127.0.0.1",
            "--port", str(port), "--http-port", str(port + 1), "--chunk-size", "256", "--l1-size-gb", "0.1",
            "--eviction-policy", "LRU", "--max-workers", "1", "--supported-transfer-mode", "auto"]  # fmt: skip
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def measure(port: int, keys: Path | None) -> str:
    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        authenticate_as_client(context, read_client_keys(str(keys)))
    client = RequestClientFactory.create(f"tcp://127.0.0.1:{port}", context=context)
    client.get_chunk_size().result(timeout=30)
    times = []
    for _ in range(ROUND_TRIPS):
        start_s = time.perf_counter()
        client.get_chunk_size().result(timeout=10)
        times.append((time.perf_counter() - start_s) * 1e6)
    client.close()
    times.sort()
    p50, p90, p99 = (times[int(ROUND_TRIPS * q)] for q in (0.5, 0.9, 0.99))
    return f"{'curve' if keys else 'plain'} get_chunk_size round trip us: p50 {p50:.0f} p90 {p90:.0f} p99 {p99:.0f}"


def main() -> None:
    shutil.rmtree(KEYS_ROOT, ignore_errors=True)
    server_keys, engine_keys = policy_keys(KEYS_ROOT, "p")
    plain_port, curve_port = 27921, 27931
    servers = [start(plain_port, None), start(curve_port, server_keys)]
    time.sleep(25)  # both servers import LMCache
    try:
        for port, keys in (
            (curve_port, engine_keys),
            (plain_port, None),
            (curve_port, engine_keys),
            (plain_port, None),
        ):
            print(measure(port, keys), flush=True)
    finally:
        for server in servers:
            server.terminate()
    os._exit(0)  # LMCache's client polling thread would hold the interpreter


if __name__ == "__main__":
    main()
