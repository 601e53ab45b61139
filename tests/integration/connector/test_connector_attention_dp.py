"""The connector under attention DP (TensorRT-LLM main): one scheduler and one worker per DP rank,
each in its own process, over one LMCache server. Real ``lmcache server`` on CPU."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.integration.connector.test_connector_on_real_executor import (
    PREFIXES,
    cancellation_stream,
    make_server_busy,
)
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import (
    CHUNK,
    KV_CACHE_MANAGER_V2_VERSIONS,
    AttentionDpRank,
    PromptRequest,
    connector_llm_args,
    make_prompt,
    settle_commits,
)

pytestmark = [pytest.mark.connector, pytest.mark.parametrize("version", KV_CACHE_MANAGER_V2_VERSIONS)]
"""Every test runs on each version that has attention DP with a connector (those serving V2)."""

ADP = {"tp": 2, "attention_dp": True, "kv_cache_manager_v2": True}
"""Attention DP with a connector runs on KVCacheManagerV2 only (main refuses a resolved V1 manager)."""


def conversations(seed: int, first_id: int, n: int = 3) -> list[PromptRequest]:
    return [PromptRequest(first_id + i, make_prompt(seed + i, 5 * CHUNK + 7), 3) for i in range(n)]


def test_two_attention_dp_ranks_load_each_others_kv_bit_exact(
    lmcache_server: LMCacheServer, executor_factory: Any, connector_env: dict[str, str], version: str
) -> None:
    """What one DP rank stored, the other loads: every prompt served again on the other rank hits
    LMCache for its whole chunks, its KV is bit-exact and its output equals the first rank's."""
    model = f"adp-{version}-model"
    rank0 = executor_factory(model, lmcache_server.url, llm_args=ADP, num_blocks=88, attention_dp_rank=0,
                             version=version)  # fmt: skip
    rank1 = AttentionDpRank(connector_llm_args(model, lmcache_server.url, **ADP), 1, dict(os.environ), num_blocks=88,
                            version=version)  # fmt: skip
    try:
        first0 = rank0.run(conversations(700, 100))
        assert settle_commits()
        again1 = rank1.run([PromptRequest(200 + i, p.prompt, 3) for i, p in enumerate(conversations(700, 100))])
        first1 = rank1.run(conversations(800, 300))
        assert rank1.settle()
        again0 = rank0.run([PromptRequest(400 + i, p.prompt, 3) for i, p in enumerate(conversations(800, 300))])
        report1 = rank1.report()
    finally:
        rank1.close()
    for first, again in ((first0, again1), (first1, again0)):
        assert [r.output_tokens for r in again] == [r.output_tokens for r in first]
        assert [r.connector_matched_tokens for r in again] == [5 * CHUNK] * 3, "whole chunks from the other rank"
        assert not any(r.failed for r in first + again)
    assert rank0.kv_mismatches == 0 and report1["kv_mismatches"] == 0
    assert rank0.scheduler.tracked_request_ids == frozenset() and report1["tracked_requests"] == 0
    assert rank0.scheduler.supports_attention_dp and rank0.rank0.worker.rank == 0
    assert rank0.scheduler.settings.world_size == 1, "whole KV heads on every DP rank"


def test_an_idle_dp_ranks_dummy_forward_never_leaks_into_a_cancelled_requests_saves(
    lmcache_server: LMCacheServer, executor_factory: Any, version: str
) -> None:
    """Requests cancelled mid chunked prefill (no ``request_finished``) with saves queued behind a busy
    server; the rank then idles while the other ranks work, so each iteration runs a dummy request
    on a block from the free pool, which the connector is never told of. Later requests with those
    prefixes load only KV that was really theirs, and the connector keeps no state of the cancelled."""
    ex = executor_factory(f"adp-cancel-{version}-model", lmcache_server.url, llm_args=ADP, num_blocks=88,
                          context_chunk_size=CHUNK, attention_dp_rank=0, version=version)  # fmt: skip
    make_server_busy(ex, 0.03)
    cancelled = 0
    for batch in cancellation_stream(seed=23, rounds=30, per_round=4, cancel_share=1.0):
        results = ex.run(batch)
        cancelled += sum(r.cancelled for r in results)
        ex.idle(6)  # the other DP ranks are busy: dummy forwards here
        ex.evict_device_cache()
    left_after_stream = sorted(ex.scheduler.tracked_request_ids)
    again = [PromptRequest(9000 + i, [*make_prompt(500 + i, 4 * CHUNK), 7, 8, 9], 2) for i in range(PREFIXES)]
    results = [r for half in (again[:3], again[3:]) for r in ex.run(half)]
    assert not any(r.failed for r in results)
    assert sum(r.connector_matched_tokens for r in results) > 0
    assert ex.kv_mismatches == 0
    assert cancelled >= 100 and ex.dummy_forwards >= 150, (cancelled, ex.dummy_forwards)
    assert left_after_stream == [], "the idle rank's dummies ended the cancelled requests' state"


def test_attention_dp_refuses_a_connector_that_does_not_declare_it(
    lmcache_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """The stand-in is no kinder than KvCacheConnectorManager: without the opt-in, attention DP is refused."""
    from kvoffload.connector import trtllm

    monkeypatch.setattr(trtllm.KvoffloadConnectorScheduler, "supports_attention_dp", False)
    with pytest.raises(NotImplementedError, match="supports_attention_dp=True"):
        executor_factory("adp-refused-model", lmcache_server.url, llm_args=ADP, attention_dp_rank=0, version=version)


def test_under_attention_dp_a_slow_load_never_trips_the_engines_load_deadline(
    lmcache_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """Main fails the engine on every DP rank when a parked load is not reported in time
    (``_KV_CONNECTOR_LOAD_TIMEOUT_SEC``, the stand-in's 1 s): under attention DP the connector loads
    synchronously, so an asynchronous load that would take 1.5 s never parks a request; the engine
    serves on. Answered asynchronously, the first hit ends the engine."""
    from kvoffload import contract
    from tests.integration.connector.test_connector_cancel_during_load import slow_async_loads

    monkeypatch.setenv(contract.ENV_ASYNC_LOAD_MIN_TOKENS, str(CHUNK))
    slow_async_loads(monkeypatch, 1.5)
    ex = executor_factory(f"adp-deadline-{version}-model", lmcache_server.url, llm_args=ADP, num_blocks=88,
                          attention_dp_rank=0, version=version)  # fmt: skip
    first = ex.run(conversations(900, 500))
    ex.evict_device_cache()
    again = ex.run([PromptRequest(600 + i, p.prompt, 3) for i, p in enumerate(conversations(900, 500))])
    assert [r.output_tokens for r in again] == [r.output_tokens for r in first]
    assert [r.connector_matched_tokens for r in again] == [5 * CHUNK] * 3
    assert ex.async_loads == 0 and ex.kv_mismatches == 0
