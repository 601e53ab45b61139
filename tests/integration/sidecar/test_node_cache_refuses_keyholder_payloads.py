"""A keyholder of a node cache (an engine pod holding its policy's CURVE client key) can neither poison
nor read the cache for the policy's other engines (issue 42, items 2 and 3), against the real LMCache
server the sidecar runs as a node cache pod (request port on all addresses, the policy's keys mounted),
on the pickle transport: L1 larger than ``/dev/shm`` can hold, the fallback where every store is
unpickled. Another engine of the policy stores and reads back its KV bit-exact before and after the
keyholder's payloads; each payload is refused with a line that says why."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvoffload import contract
from tests.support.cache_keys import policy_keys
from tests.support.sidecar_harness import Sidecar, lmcache_client_on

pytestmark = pytest.mark.sidecar

BIT_EXACT = {"stored": True, "hit": 2, "retrieved": True, "bit_exact": True}


@dataclass
class NodeCache:
    """A node cache pod's sidecar and the policy's client keys its engines hold."""

    sidecar: Sidecar
    client_keys: Path

    def client(self, op: str, argument: int | str) -> dict[str, object]:
        """``lmcache_client.py`` in a fresh engine process holding the policy's client key."""
        return lmcache_client_on(self.sidecar.request_port, self.sidecar.lmcache_http_port, op, argument,
                                 self.client_keys)  # fmt: skip

    def log(self) -> str:
        return self.sidecar.log_path.read_text(errors="replace")


def _pickle_transport_node_cache(make_sidecar: Callable[..., Sidecar], tmp_path: Path) -> NodeCache:
    """A node cache on the pickle transport whose first engine has stored and read back sequence 1."""
    server_keys, client_keys = policy_keys(tmp_path, "llama")
    l1_mib = shutil.disk_usage(contract.SHM_MOUNT_PATH).free // 2**20 + 1024  # more than /dev/shm can hold
    sidecar = make_sidecar(**{contract.ENV_REQUEST_HOST: "0.0.0.0", contract.ENV_CACHE_KEYS_DIR: str(server_keys),
                              contract.ENV_L1_SIZE: f"{l1_mib}Mi"})  # fmt: skip
    sidecar.wait_ready()
    cache = NodeCache(sidecar, client_keys)
    assert cache.client("roundtrip", 1) == BIT_EXACT, "the policy's engine stores and reads back its KV"
    assert "Using pickle non-GPU transfer strategy" in cache.log()
    return cache


def test_a_keyholders_build_on_the_servers_rebuild_function_is_refused_and_later_stores_read_back_bit_exact(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    """The 72-byte COMMIT that set ``_rebuild_tensor_v2.__defaults__`` on the old guard (every later
    pickled store on the node came out negated until the cache pod restarted)."""
    cache = _pickle_transport_node_cache(make_sidecar, tmp_path)
    answer = cache.client("poison-commit", "-")
    assert answer["committed"] is not True, answer
    assert "kvoffload refused a pickled tensor payload: opcode EMPTY_DICT at byte 36" in cache.log()
    for sequence in (2, 3):
        assert cache.client("roundtrip", sequence) == BIT_EXACT, f"sequence {sequence} after the keyholder's payload"
    assert cache.sidecar.ready()


def test_a_keyholders_storage_that_its_payload_never_fills_is_refused_and_nothing_stale_is_read(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    """The COMMIT whose storages torch's loader allocated and never filled: the old guard stored them
    and PREPARE_RETRIEVE handed the keyholder the server's stale heap (once another client's KV)."""
    cache = _pickle_transport_node_cache(make_sidecar, tmp_path)
    assert cache.client("unfilled-store", 7) == {"stored": False, "hit": 0, "retrieved": False}
    assert "a storage's data section lists [], not exactly its one storage" in cache.log()
    assert cache.client("roundtrip", 8) == BIT_EXACT, "the policy's other engine after the keyholder's payload"
    assert cache.client("lookup", 1)["hit"] == 2, "the first engine's KV is still served"
    assert cache.sidecar.ready()
