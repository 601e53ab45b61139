"""STORE or LOOKUP one synthetic request against an LMCache server with LMCache's own client.

Usage: ``lmcache_client.py REQUEST_PORT HTTP_PORT store|lookup SEQUENCE[-LAST]``; prints one
JSON line (for a range: totals over its sequences).
``lmcache_client.py REQUEST_PORT HTTP_PORT foreign-commit MARKER_PATH``: a stranger registered
like any client sends a COMMIT_STORE whose pickle payload, if unpickled freely, creates
``MARKER_PATH``; prints ``{"committed": ..., "error": ...}``.
``lmcache_client.py REQUEST_PORT HTTP_PORT stranger MARKER_PATH``: sends CLEAR (force) and a LOOKUP
(3 s wait each), then tries to register (6 s) and, registered, to store and to COMMIT a pickle that
would create ``MARKER_PATH``; prints ``{"answered": [CLEAR/LOOKUP answered, error answers
included], "registered": ..., and when registered "stored", "committed", "error"}``.
``lmcache_client.py REQUEST_PORT HTTP_PORT roundtrip SEQUENCE``: stores the sequence (cold pass), then
zeroes its blocks, looks it up and retrieves it (warm pass); prints ``{"stored", "hit", "retrieved",
"bit_exact"}`` (bit_exact: the retrieved blocks hash as the stored ones did).
``lmcache_client.py REQUEST_PORT HTTP_PORT poison-commit -``: a keyholder COMMITs
``hostile_payloads.poisoning_payload()``; prints ``{"committed": ..., "error": ...}``.
``lmcache_client.py REQUEST_PORT HTTP_PORT unfilled-store SEQUENCE``: a keyholder stores the sequence
with storages its payload never fills (``hostile_payloads.unfilled_storage_payload``, shaped as the
real chunks), then looks it up and retrieves it; prints ``{"stored", "hit", "retrieved"}``.
With ``KVOFFLOAD_CACHE_KEYS_DIR`` set, every connection is a CURVE client with the keys there (as the
connector's in node mode); without it, a plain one.
Uses ``lmcache bench server``'s client in CPU mode: ``auto`` transfer picks the
engine-driven path, the one that works on CPU (see measured-baselines.md).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import types
from pathlib import Path

import torch
from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from lmcache.cli.commands.bench.server_bench.config import BenchConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: make ``tests`` importable
from tests.support.hostile_payloads import poisoning_payload, unfilled_storage_payload

NUM_TOKENS = 512  # two 256-token chunks


class _RunsCode:
    """A pickle that calls ``os.system`` when it is loaded: what a hostile client would send."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.command,)


def foreign_commit(client: ServerBenchClient, marker: str) -> dict[str, object]:
    """COMMIT_STORE a code-running pickle under this client's registered instance."""
    return commit_payload(client, pickle.dumps([_RunsCode(f"touch {marker}")]))


def commit_payload(client: ServerBenchClient, payload: bytes) -> dict[str, object]:
    """COMMIT_STORE ``payload`` as this registered client's ``cpu_data``."""
    from lmcache.cli.commands.bench.server_bench.helpers import _INSTANCE_ID_BASE, _make_key

    request = client.create_request(0, "kvo-foreign-0", "store")
    assert request is not None
    key = _make_key(request.token_ids, request.request_id, start=0, end=request.num_full_tokens, worker_id=0)
    try:
        committed = client._req_client.commit_store(key, _INSTANCE_ID_BASE, payload).result(timeout=5)
    except Exception as exc:
        return {"committed": None, "error": repr(exc)}
    return {"committed": bool(committed), "error": None}


def roundtrip(client: ServerBenchClient, sequence: int) -> dict[str, object]:
    """Store ``sequence`` (cold pass), then zero, look up and retrieve it (warm pass), as
    ``lmcache bench server`` checks its data: the warm blocks must hash as the cold ones did."""
    cold = client.create_request(sequence, f"kvo-cold-{sequence}", "cold")
    assert cold is not None
    stored_from = client.compute_checksums(cold, 0, cold.num_full_tokens)
    stored = client.store(cold, 0, cold.num_full_tokens)
    client.end_session(cold)
    warm = client.create_request(sequence, f"kvo-warm-{sequence}", "warm")
    assert warm is not None
    hit = client.lookup(warm).hit_chunks
    client.zero_destination(warm, 0, warm.num_full_tokens)
    retrieved = client.retrieve(warm, 0, warm.num_full_tokens)
    read_back = client.compute_checksums(warm, 0, warm.num_full_tokens)
    client.end_session(warm)
    return {"stored": bool(stored and stored.succeeded), "hit": hit,
            "retrieved": bool(retrieved and retrieved.succeeded),
            "bit_exact": bool(stored_from) and stored_from == read_back}  # fmt: skip


def unfilled_store(client: ServerBenchClient, sequence: int) -> dict[str, object]:
    """Store ``sequence`` through the pickle transport with storages the payload never fills (shaped
    as the real chunks), then look it up and retrieve it: what a keyholder reads back."""
    import lmcache.v1.multiprocess.transfer_context.pickle as transport

    def unfilled(chunks: list[torch.Tensor]) -> bytes:
        return unfilled_storage_payload([tuple(c.shape) for c in chunks], chunks[0].dtype)

    transport.pickle = types.SimpleNamespace(dumps=unfilled, loads=pickle.loads)
    try:
        request = client.create_request(sequence, f"kvo-unfilled-{sequence}", "store")
        assert request is not None
        stored = client.store(request, 0, request.num_full_tokens)
        client.end_session(request)
    finally:
        transport.pickle = pickle
    warm = client.create_request(sequence, f"kvo-unfilled-read-{sequence}", "warm")
    assert warm is not None
    hit = client.lookup(warm).hit_chunks
    retrieved = client.retrieve(warm, 0, warm.num_full_tokens) if hit else None
    client.end_session(warm)
    return {"stored": bool(stored and stored.succeeded), "hit": hit,
            "retrieved": bool(retrieved and retrieved.succeeded)}  # fmt: skip


STRANGER_WAIT_S = 3.0


def curve_contexts_from_env() -> None:
    """Where ``KVOFFLOAD_CACHE_KEYS_DIR`` is set, every request client LMCache creates from now on
    authenticates with its keys, through the connector's own ``authenticate_as_client``."""
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    from kvoffload import contract
    from kvoffload.cache_keys import read_client_keys
    from kvoffload.connector.backends.connection import authenticate_as_client

    directory = os.environ.get(contract.ENV_CACHE_KEYS_DIR)
    if not directory:
        return
    keys = read_client_keys(directory)
    create = RequestClientFactory.create

    def create_authenticated(server_url: str, *, context: object = None) -> object:
        assert context is not None, "the bench client and stranger() pass their own context"
        authenticate_as_client(context, keys)  # type: ignore[arg-type]
        return create(server_url, context=context)

    RequestClientFactory.create = staticmethod(create_authenticated)  # type: ignore[method-assign,assignment]


def stranger(port: int, http_port: int, marker: str) -> dict[str, object]:
    """What a client gets from the server: answers to CLEAR and LOOKUP, then whether it can register
    (LMCache's bench client, its start bounded), and, if it can, a store and a code-running pickle."""
    import threading

    import zmq
    from lmcache.cli.commands.bench.server_bench.helpers import _make_key
    from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

    context = zmq.Context()
    context.setsockopt(zmq.LINGER, 0)
    client = RequestClientFactory.create(f"tcp://127.0.0.1:{port}", context=context)
    key = _make_key(tuple(range(NUM_TOKENS)), "kvo-stranger", worker_id=0)
    attempts = {"clear": client.clear(force=True), "lookup": client.lookup(key, 1)}
    answered = []
    for name, future in attempts.items():
        try:
            future.result(timeout=STRANGER_WAIT_S)
            answered.append(name)
        except TimeoutError:
            pass
        except Exception:  # an error answer is an answer: the request reached a handler
            answered.append(name)
    bench = ServerBenchClient(_bench_config(port, http_port), log=lambda m: print(m, file=sys.stderr))
    starter = threading.Thread(target=bench.start, daemon=True)
    starter.start()
    starter.join(timeout=STRANGER_WAIT_S * 2)
    result: dict[str, object] = {"answered": answered, "registered": not starter.is_alive()}
    if result["registered"]:
        request = bench.create_request(99, "kvo-stranger-store", "store")
        assert request is not None
        stored = bench.store(request, 0, request.num_full_tokens)
        result["stored"] = bool(stored and stored.succeeded)
        result.update(foreign_commit(bench, marker))
    return result


def _bench_config(port: int, http_port: int) -> BenchConfig:
    return BenchConfig(
        rpc_url=f"tcp://127.0.0.1:{port}",
        http_url=f"http://127.0.0.1:{http_port}",
        mode="cpu",
        transfer_mode="auto",
        tp_size=1,
        use_mla=False,
        num_tokens=NUM_TOKENS,
        kvcache_shape_spec="(2,64,16,2,32):float16:2",
        num_blocks=64,
        block_size=16,
    )


def main() -> int:
    """Run one operation; exit 0 when the client itself worked (hits are in the JSON)."""
    port, http_port, op = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    curve_contexts_from_env()
    if op == "stranger":
        print(json.dumps(stranger(port, http_port, sys.argv[4])), flush=True)
        os._exit(0)  # a client that never got in may still be retrying its handshake
    client = ServerBenchClient(_bench_config(port, http_port), log=lambda m: print(m, file=sys.stderr))
    client.start()
    single = {
        "foreign-commit": lambda: foreign_commit(client, sys.argv[4]),
        "poison-commit": lambda: commit_payload(client, poisoning_payload()),
        "roundtrip": lambda: roundtrip(client, int(sys.argv[4])),
        "unfilled-store": lambda: unfilled_store(client, int(sys.argv[4])),
    }
    if op in single:
        try:
            print(json.dumps(single[op]()), flush=True)
        finally:
            client.close()
        return 0
    first, _, last = sys.argv[4].partition("-")
    sequences = range(int(first), int(last or first) + 1)
    stored_all, chunks, hits, errors = True, 0, 0, []
    try:
        for sequence in sequences:
            request = client.create_request(sequence, f"kvo-{op}-{sequence}", op)
            assert request is not None
            chunks += request.total_chunks
            if op == "store":
                stored = client.store(request, 0, request.num_full_tokens)
                stored_all = stored_all and bool(stored and stored.succeeded)
            else:
                found = client.lookup(request)
                hits += found.hit_chunks
                if found.error:
                    errors.append(found.error)
    finally:
        client.close()
    if op == "store":
        result: dict[str, object] = {"stored": stored_all, "chunks": chunks}
    else:
        result = {"hit": hits, "total": chunks, "error": ", ".join(errors) or None}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
