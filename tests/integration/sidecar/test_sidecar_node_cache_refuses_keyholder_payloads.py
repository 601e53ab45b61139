"""A keyholder of a node cache (an engine pod holding its policy's CURVE client key) can neither poison
nor read the cache for the policy's other engines (issue 42, items 2 and 3), against the real LMCache
server run as the sidecar runs it in a node cache pod (``kvoffload.sidecar.lmcache_server`` with the
policy's CURVE keys) on the pickle transport, the fallback where every store is unpickled (L1 that
``/dev/shm`` cannot hold; in shared-memory mode a COMMIT that carries bytes still takes this path).
Another engine of the policy stores and reads back its KV bit-exact before and after the keyholder's
payloads; each payload is refused with a line that says why."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvoffload import contract
from tests.support.cache_keys import policy_keys
from tests.support.lmcache_server import LMCacheServer
from tests.support.sidecar_harness import lmcache_client_on

pytestmark = pytest.mark.sidecar

BIT_EXACT = {"stored": True, "hit": 2, "retrieved": True, "bit_exact": True}


@dataclass
class NodeCache:
    """A node cache's LMCache server and the policy's client keys its engines hold."""

    server: LMCacheServer
    client_keys: Path

    def client(self, op: str, argument: int | str) -> dict[str, object]:
        """``lmcache_client.py`` in a fresh engine process holding the policy's client key."""
        return lmcache_client_on(self.server.port, self.server.http_port, op, argument, self.client_keys)

    def log(self) -> str:
        return self.server.log_path.read_text(errors="replace")


@pytest.fixture
def node_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[NodeCache]:
    """The sidecar's server module (``kvoffload.sidecar.lmcache_server``: the decoder, CURVE with the
    policy's keys) without SHM, whose first engine has stored and read back sequence 1. (The sidecar
    itself picks the pickle transport only when L1 outgrows ``/dev/shm``, and L1 is allocated whole.)"""
    server_keys, client_keys = policy_keys(tmp_path, "llama")
    monkeypatch.setenv(contract.ENV_CACHE_KEYS_DIR, str(server_keys))
    server = LMCacheServer(chunk_size=256, log_dir=tmp_path, guarded=True, shm=False)
    server.start()
    try:
        cache = NodeCache(server, client_keys)
        assert cache.client("roundtrip", 1) == BIT_EXACT, "the policy's engine stores and reads back its KV"
        assert "Using pickle non-GPU transfer strategy" in cache.log()
        yield cache
    finally:
        server.stop()


def test_a_keyholders_build_on_the_servers_rebuild_function_is_refused_and_later_stores_read_back_bit_exact(
    node_cache: NodeCache,
) -> None:
    """The 72-byte COMMIT that set ``_rebuild_tensor_v2.__defaults__`` on the old guard (every later
    pickled store on the node came out negated until the cache pod restarted)."""
    cache = node_cache
    answer = cache.client("poison-commit", "-")
    assert answer["committed"] is not True, answer
    for sequence in (2, 3):
        assert cache.client("roundtrip", sequence) == BIT_EXACT, f"sequence {sequence} after the keyholder's payload"
    assert "kvoffload refused a pickled tensor payload: opcode EMPTY_DICT at byte 36" in cache.log()
    assert cache.server.healthy()


def test_a_keyholders_storage_that_its_payload_never_fills_is_refused_and_nothing_stale_is_read(
    node_cache: NodeCache,
) -> None:
    """The COMMIT whose storages torch's loader allocated and never filled: the old guard stored them
    and PREPARE_RETRIEVE handed the keyholder the server's stale heap (once another client's KV)."""
    cache = node_cache
    assert cache.client("unfilled-store", 7) == {"stored": False, "hit": 0, "retrieved": False}
    assert "a storage's data section lists [], not exactly its one storage" in cache.log()
    assert cache.client("roundtrip", 8) == BIT_EXACT, "the policy's other engine after the keyholder's payload"
    assert cache.client("lookup", 1)["hit"] == 2, "the first engine's KV is still served"
    assert cache.server.healthy()
