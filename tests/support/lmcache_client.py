"""STORE or LOOKUP one synthetic request against an LMCache server with LMCache's own client.

Usage: ``lmcache_client.py REQUEST_PORT HTTP_PORT store|lookup SEQUENCE[-LAST]``; prints one
JSON line (for a range: totals over its sequences).
``lmcache_client.py REQUEST_PORT HTTP_PORT foreign-commit MARKER_PATH``: a stranger registered
like any client sends a COMMIT_STORE whose pickle payload, if unpickled freely, creates
``MARKER_PATH``; prints ``{"committed": ..., "error": ...}``.
Uses ``lmcache bench server``'s client in CPU mode: ``auto`` transfer picks the
engine-driven path, the one that works on CPU (see measured-baselines.md).
"""

from __future__ import annotations

import json
import os
import pickle
import sys

from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
from lmcache.cli.commands.bench.server_bench.config import BenchConfig

NUM_TOKENS = 512  # two 256-token chunks


class _RunsCode:
    """A pickle that calls ``os.system`` when it is loaded: what a hostile client would send."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.system, (self.command,)


def foreign_commit(client: ServerBenchClient, marker: str) -> dict[str, object]:
    """COMMIT_STORE a code-running pickle under this client's registered instance."""
    from lmcache.cli.commands.bench.server_bench.helpers import _INSTANCE_ID_BASE, _make_key

    request = client.create_request(0, "kvo-foreign-0", "store")
    assert request is not None
    key = _make_key(request.token_ids, request.request_id, start=0, end=request.num_full_tokens, worker_id=0)
    payload = pickle.dumps([_RunsCode(f"touch {marker}")])
    try:
        committed = client._req_client.commit_store(key, _INSTANCE_ID_BASE, payload).result(timeout=5)
    except Exception as exc:
        return {"committed": None, "error": repr(exc)}
    return {"committed": bool(committed), "error": None}


def main() -> int:
    """Run one operation; exit 0 when the client itself worked (hits are in the JSON)."""
    port, http_port, op = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    config = BenchConfig(
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
    client = ServerBenchClient(config, log=lambda m: print(m, file=sys.stderr))
    client.start()
    if op == "foreign-commit":
        try:
            print(json.dumps(foreign_commit(client, sys.argv[4])), flush=True)
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
