"""A request cancelled while its asynchronous save runs, whose freed block partial reuse copies into
in the next ``prepare_resources``: TensorRT-LLM 1.2 and main free a cancelled request's blocks at once
without ``request_finished`` (``py_executor.py``), and copy-on-partial-reuse (on by default) writes
the copy's target before any hook of the connector in that iteration. Against a real ``lmcache
server`` on CPU, with every KV position checked."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvoffload.connector.backends.pool_copies import PoolCopies
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import (
    BLOCK,
    CHUNK,
    V2_WITHOUT_RESERVATIONS,
    PromptRequest,
    make_prompt,
)

pytestmark = pytest.mark.connector

ROUNDS = 4
SAVED = 2 * CHUNK
"""Tokens the cancelled request P saves: its prompt is ``SAVED`` + 5 tokens (its whole blocks, then a
partial one the saves leave out)."""
SOURCE_BLOCKS = 3
"""Whole blocks of the request Q whose third block the retry R partially matches (copy-on-partial-reuse)."""


def slow_saves(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every save waits ``seconds`` on the saver thread before it reads the blocks (a busy copy engine),
    so a cancel and the next iteration's allocation fall inside it."""
    store = PoolCopies.store

    def slow(self: PoolCopies, op: Any) -> Any:
        time.sleep(seconds)
        return store(self, op)

    monkeypatch.setattr(PoolCopies, "store", slow)


@pytest.mark.parametrize(
    ("manager_v2", "overlap"),
    [(False, False), (False, True), (True, False)],
    ids=["v1", "v1-overlap", "kv-cache-manager-v2"],
)
def test_a_partial_reuse_copy_into_a_cancelled_requests_block_never_reaches_its_saved_kv(
    lmcache_server: LMCacheServer,
    executor_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    manager_v2: bool,
    overlap: bool,
) -> None:
    """P computes its prompt, its save is queued on the saver thread (slowed to 50 ms) and P is
    cancelled in that iteration. The pool is sized so that the next iteration's allocation hands P's
    first saved block to a retry R as the target of its partial-reuse copy (a request X takes P's
    freed partial block first; the stand-in hands out free blocks last-freed first, then reusable ones
    least recently used first). What LMCache then holds under P's prompt must be P's KV: a later
    request loading it reads no wrong position. (Without the fix every run failed in round 0: the
    save, running when R's copy was made, read the copy.)"""
    slow_saves(monkeypatch, 0.05)
    for round_ in range(ROUNDS):
        q_tokens = make_prompt(1000 + round_, SOURCE_BLOCKS * BLOCK + 5)
        p_tokens = make_prompt(2000 + round_, SAVED + 5)
        # Q's whole blocks (reusable once it ends) and P's (8 whole, 1 partial) fill the pool exactly.
        num_blocks = SOURCE_BLOCKS + SAVED // BLOCK + 1
        ex = executor_factory(f"cancel-save-{manager_v2}-{overlap}-{round_}-model", lmcache_server.url,
                              num_blocks=num_blocks, overlap_scheduler=overlap, enable_partial_reuse=True,
                              version=V2_WITHOUT_RESERVATIONS if manager_v2 else "main",
                              llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
        assert not ex.run([PromptRequest(1, q_tokens, 1)])[0].failed
        shared = (SOURCE_BLOCKS - 1) * BLOCK + BLOCK // 2  # Q's first two blocks, half of its third
        p, x, r = ex.run([
            PromptRequest(2, p_tokens, 2, cancel_after=1),
            PromptRequest(3, make_prompt(3000 + round_, 10), 1, arrive_after=1),
            PromptRequest(4, q_tokens[:shared] + make_prompt(4000 + round_, 40), 1, arrive_after=1),
        ])  # fmt: skip
        assert p.cancelled and not x.failed and not r.failed
        assert r.device_reused_tokens == shared, "R copied part of Q's third block into a block of its own"
        ex.evict_device_cache()
        again = ex.run([PromptRequest(5, p_tokens, 1)])[0]
        assert not again.failed
        # P's save ran (waited for before R's copy) and is loaded whole, or it was still queued at the
        # cancel and was dropped: nothing of it is loaded.
        assert again.connector_matched_tokens in (0, SAVED)
        assert ex.kv_mismatches == 0, f"round {round_}: P's saved KV was overwritten by R's copy"
