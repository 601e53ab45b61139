"""A lookup reads this process's own stores (it waits for their deferred COMMITs), but only those on
its prompt's chain: another request's COMMIT still queued never holds up the scheduler."""

from __future__ import annotations

import threading

from kvoffload.connector.wire import TransferOp
from tests.support.direct_backend import backend_pair, hold_store_commits
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import BLOCK, CHUNK, make_prompt

LOOKUP_TIMEOUT_S = 60.0
"""Far above any answer's time: a lookup that waited for the held COMMIT would take all of it."""


ENV = {
    "KVOFFLOAD_STORE_TIMEOUT_MS": "10000",
    "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "10000",
    "KVOFFLOAD_LOOKUP_TIMEOUT_MS": str(int(LOOKUP_TIMEOUT_S * 1000)),
}


def test_a_lookup_waits_for_its_own_chains_commit_and_not_for_another_requests(
    lmcache_server: LMCacheServer,
) -> None:
    tokens = 2 * CHUNK
    blocks = tokens // BLOCK
    worker, scheduler = backend_pair(lmcache_server, "lookup-chain", ENV, 2 * blocks)
    held, release = hold_store_commits(worker, LOOKUP_TIMEOUT_S)
    stored, other = tuple(make_prompt(41, tokens)), tuple(make_prompt(42, tokens))
    try:
        assert worker.is_up() and scheduler.is_up()
        worker.copies.store(TransferOp(0, "stored", stored, 0, tokens, tuple(range(blocks)), 0, "t"))
        assert held.wait(10.0), "the store's COMMIT never reached the committer"

        answers: dict[str, int] = {}
        unrelated = threading.Thread(target=lambda: answers.update(other=scheduler.lookup("other", other, tokens, "t")))
        unrelated.start()
        unrelated.join(LOOKUP_TIMEOUT_S / 3)
        assert not unrelated.is_alive(), "a lookup of another prompt waited for an unrelated COMMIT"
        assert answers["other"] == 0 and not release.is_set()

        same_chain = threading.Thread(
            target=lambda: answers.update(stored=scheduler.lookup("again", stored, tokens, "t"))
        )
        same_chain.start()
        same_chain.join(0.5)
        assert same_chain.is_alive(), "a lookup of the stored prompt did not wait for its COMMIT"
        release.set()
        same_chain.join(LOOKUP_TIMEOUT_S / 3)
        assert not same_chain.is_alive()
        assert answers["stored"] == tokens, "the lookup ran before the COMMIT it waited for"
    finally:
        release.set()
        assert worker.wait_commits(10.0)
        for session in ("other", "again"):
            scheduler.end_session(session)
        scheduler.close()
        worker.close()
