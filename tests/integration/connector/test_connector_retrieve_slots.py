"""A load secured by the sidecar's server gets the slots LMCache itself describes.

The sidecar's server describes PREPARE_RETRIEVE's slots from each memory object's metadata instead of
building tensor views per chunk (``kvoffload.lmcache_guard.retrieve_slots``). The same stores on a
plain LMCache 0.5.6 server and on the server run as the sidecar runs it give the same slots (offset,
length, shape, dtype), and a load through them is bit-exact.
"""

from __future__ import annotations

import pytest
import torch

from kvoffload.connector.backends.engine_process import EngineProcess
from kvoffload.connector.wire import TransferOp
from tests.support.direct_backend import direct_scheduler, direct_worker, pool_for
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import BLOCK, CHUNK, make_prompt

pytestmark = pytest.mark.connector

CHUNKS = 4
TOKENS = CHUNKS * CHUNK
ENV = {
    "KVOFFLOAD_STORE_TIMEOUT_MS": "5000",
    "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "5000",
    "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "2000",
}


def test_a_load_secured_by_the_sidecars_server_gets_the_slots_lmcache_describes_and_loads_bit_exact(
    plain_and_sidecar_servers: dict[str, LMCacheServer],
) -> None:
    prompt = tuple(make_prompt(41, TOKENS + 1))
    blocks = TOKENS // BLOCK
    slots = {}
    for name, server in plain_and_sidecar_servers.items():
        pool, process = pool_for(2 * blocks), EngineProcess()
        worker = direct_worker(server, "retrieve-slots", ENV, pool, process)
        scheduler = direct_scheduler(server, "retrieve-slots", ENV, process)
        try:
            source, target = tuple(range(blocks)), tuple(range(blocks, 2 * blocks))
            worker.copies.store(TransferOp(1, "store", prompt[:TOKENS], 0, TOKENS, source, 0, ""))
            assert worker.wait_commits(10.0), f"{name}: the store's COMMIT was never answered"
            assert scheduler.lookup("load", prompt, TOKENS, "") == TOKENS, f"{name}: the stored prompt missed"
            secured = scheduler.secure("load", prompt[:TOKENS], 0, TOKENS, "")
            assert secured is not None, f"{name}: the hit could not be secured"
            slots[name] = secured.slots
            worker.copies.retrieve(TransferOp(2, "load", prompt[:TOKENS], 0, TOKENS, target, 0, "", secured=secured))
            assert torch.equal(pool[list(target)], pool[list(source)]), f"{name}: the load is not bit-exact"
            scheduler.release_secured("load", prompt[:TOKENS], 0, TOKENS, "", secured)
            scheduler.end_session("load")
        finally:
            scheduler.close()
            worker.close()
    assert len(slots["sidecar"][0]) == CHUNKS
    assert slots["sidecar"] == slots["lmcache"]
