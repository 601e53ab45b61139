"""A parked request cancelled while its asynchronous load runs, and a request whose allocation is
destroyed and replayed: the paths TensorRT-LLM really takes (``py_executor.py`` @0004396 frees a
cancelled parked request's blocks at once, and the C++ ``storeBlocksForReuse`` keeps them for reuse
under its prompt), against a real ``lmcache server`` on CPU, with every KV position checked."""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvoffload import contract
from kvoffload.connector.backends.pool_copies import PoolCopies
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import (
    BLOCK,
    CHUNK,
    TRTLLM_VERSIONS,
    V2_WITHOUT_RESERVATIONS,
    PromptRequest,
    make_prompt,
)

pytestmark = pytest.mark.connector

PAIRS_PER_ROUND = 20
LOADED = 2 * CHUNK
"""Tokens each parked request loads: its prompt is ``LOADED`` + 5 tokens, so the blocks TensorRT-LLM
stores for reuse at its cancel are exactly the ones its load writes."""


def slow_async_loads(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every asynchronous load takes ``seconds`` longer to land (a long DMA), so a cancel and a retry
    fall inside it."""
    start = PoolCopies.start_async_load

    def slow(self: PoolCopies, op: Any) -> Any:
        time.sleep(seconds)
        return start(self, op)

    monkeypatch.setattr(PoolCopies, "start_async_load", slow)


def cancel_and_retry_rounds(ex: Any, rounds: int, first_id: int) -> list[int]:
    """``rounds`` rounds of ``PAIRS_PER_ROUND`` pairs: P (its prefix stored in LMCache, not on the
    device) loads asynchronously and is cancelled in the iteration it parked; its retry E (the same
    prefix, other tokens) arrives one iteration later. Returns the tokens each E reused on the device."""
    reused = []
    rid = first_id
    for _ in range(rounds):
        prompts = [make_prompt(rid + i, LOADED + 5) for i in range(PAIRS_PER_ROUND)]
        seeds = [PromptRequest(rid + i, p, 1) for i, p in enumerate(prompts)]
        assert not any(r.failed for r in ex.run(seeds))
        ex.evict_device_cache()
        rid += PAIRS_PER_ROUND
        batch = []
        for i, prompt in enumerate(prompts):
            batch.append(PromptRequest(rid + 2 * i, prompt, 2, cancel_after=1))
            retry = prompt[:LOADED] + make_prompt(rid + 2 * i + 1, 40)
            batch.append(PromptRequest(rid + 2 * i + 1, retry, 2, arrive_after=1))
        results = ex.run(batch)
        assert all(r.cancelled for r in results[0::2]), "every P was cancelled while parked"
        assert not any(r.failed for r in results)
        reused.extend(r.device_reused_tokens for r in results[1::2])
        rid += 2 * PAIRS_PER_ROUND
        ex.evict_device_cache()
    return reused


@pytest.mark.parametrize(
    ("version", "manager_v2", "overlap", "rounds"),
    [("main", False, overlap, 10) for overlap in (False, True)]
    + [(V2_WITHOUT_RESERVATIONS, True, overlap, 10) for overlap in (False, True)]
    + [(v, False, False, 2) for v in sorted(TRTLLM_VERSIONS) if v != "main"],
)
def test_a_retry_never_reads_kv_a_cancelled_parked_request_is_still_loading(
    lmcache_server: LMCacheServer,
    executor_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    version: str,
    manager_v2: bool,
    overlap: bool,
    rounds: int,
) -> None:
    """A client disconnects while its request's asynchronous load runs (loads slowed to 20 ms, a
    long DMA) and retries with the same prefix: the retry device-reuses the blocks TensorRT-LLM
    stored at the cancel, and its forward reads them only after the load landed. 0 wrong KV; no
    request state is left in the scheduler."""
    monkeypatch.setenv(contract.ENV_ASYNC_LOAD_MIN_TOKENS, str(CHUNK))
    slow_async_loads(monkeypatch, 0.02)
    ex = executor_factory(f"cancel-parked-{version}-{manager_v2}-{overlap}-model", lmcache_server.url,
                          num_blocks=2 * 20 * 12, version=version, overlap_scheduler=overlap,
                          llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    reused = cancel_and_retry_rounds(ex, rounds, first_id=10_000)
    assert ex.async_loads == rounds * PAIRS_PER_ROUND, "every P parked on an asynchronous load"
    assert reused.count(LOADED) == len(reused), "every retry read the cancelled request's blocks"
    assert ex.kv_mismatches == 0
    assert ex.scheduler.tracked_request_ids == frozenset()


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_a_replayed_request_keeps_its_load_when_its_old_blocks_go_to_another_request(
    lmcache_server: LMCacheServer, executor_factory: Any, manager_v2: bool
) -> None:
    """MAX_UTILIZATION destroys a request's first allocation and replays it after a request admitted
    with it, which takes the freed blocks: the replay is asked again, promised the same load, and
    gets it bit-exact (its old blocks no longer name it, so the other request's allocation never
    looks like its end)."""
    ex = executor_factory(f"replay-{manager_v2}-model", lmcache_server.url, num_blocks=64,
                          llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    prompt = make_prompt(77, LOADED + 5)
    assert not ex.run([PromptRequest(1, prompt, 1)])[0].failed
    ex.evict_device_cache()
    replayed, other = ex.run([
        PromptRequest(2, prompt, 3, replay_on_admission=True),
        PromptRequest(3, make_prompt(78, 100), 3),
    ])  # fmt: skip
    assert not replayed.failed and not other.failed
    assert replayed.connector_matched_tokens == LOADED
    assert ex.kv_mismatches == 0
    assert ex.scheduler.tracked_request_ids == frozenset()


PARTIAL = LOADED - BLOCK // 2
"""Tokens a retry shares with its cancelled parked request: whole blocks, then half of the last block
the load writes, which partial reuse copies into the retry's own block in ``prepare_resources``."""


@pytest.mark.parametrize(
    ("manager_v2", "overlap"),
    [(False, False), (False, True), (True, False)],
    ids=["v1", "v1-overlap", "kv-cache-manager-v2"],
)
def test_a_partial_reuse_copy_never_reads_a_block_a_cancelled_parked_request_is_still_loading(
    lmcache_server: LMCacheServer,
    executor_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    manager_v2: bool,
    overlap: bool,
) -> None:
    """Partial reuse and copy-on-partial-reuse (on by default in ``KvCacheConfig``): the retry matches
    part of a block the cancelled request's load still writes, and TensorRT-LLM copies that block in
    ``prepare_resources``, before any hook of the connector in that iteration. The copy must read
    the loaded KV, never what the block held before. (Loads are asynchronous with one rank only:
    ``planning.load_is_async``.)"""
    monkeypatch.setenv(contract.ENV_ASYNC_LOAD_MIN_TOKENS, str(CHUNK))
    slow_async_loads(monkeypatch, 0.05)
    ex = executor_factory(f"partial-copy-{manager_v2}-{overlap}-model", lmcache_server.url,
                          num_blocks=2 * PAIRS_PER_ROUND * 12, overlap_scheduler=overlap, enable_partial_reuse=True,
                          version=V2_WITHOUT_RESERVATIONS if manager_v2 else "main",
                          llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    rid = 50_000
    prompts = [make_prompt(rid + i, LOADED + 5) for i in range(PAIRS_PER_ROUND)]
    assert not any(r.failed for r in ex.run([PromptRequest(rid + i, p, 1) for i, p in enumerate(prompts)]))
    ex.evict_device_cache()
    rid += PAIRS_PER_ROUND
    batch = []
    for i, prompt in enumerate(prompts):
        batch.append(PromptRequest(rid + 2 * i, prompt, 2, cancel_after=1))
        batch.append(PromptRequest(rid + 2 * i + 1, prompt[:PARTIAL] + make_prompt(rid + 2 * i + 1, 40), 2,
                                   arrive_after=1))  # fmt: skip
    results = ex.run(batch)
    assert all(r.cancelled for r in results[0::2]), "every P was cancelled while parked"
    assert [r.device_reused_tokens for r in results[1::2]] == [PARTIAL] * PAIRS_PER_ROUND, (
        "every retry copied part of a block"
    )
    assert ex.async_loads == PAIRS_PER_ROUND
    assert ex.kv_mismatches == 0
