"""Where every prompt token came from: the connector's ``kvoffload_connector_prompt_tokens_total``
by source (device reuse, the cache server, computed with a reason) adds up to the prompt tokens the
engine scheduled, on the stand-in of TensorRT-LLM's executor with a real ``lmcache server``: chunked
prefill, partial reuse, cancellations and server kills, each on KVCacheManagerV1 and V2."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvoffload import contract
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import CHUNK, PromptRequest, RequestResult, make_prompt

pytestmark = pytest.mark.connector


def token_sources(ex: Any) -> Counter[tuple[str, str]]:
    """The connector's prompt-token counter of this executor's model, per (source, reason)."""
    metrics = ex.scheduler.metrics
    metrics.flush()
    found: Counter[tuple[str, str]] = Counter()
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if sample.name == contract.M_PROMPT_TOKENS + "_total":
                found[sample.labels["source"], sample.labels["reason"]] += sample.value
    return found


def engine_scheduled(results: list[RequestResult]) -> Counter[str]:
    """What the stand-in engine itself did with every prompt token it scheduled."""
    return Counter(
        device=sum(r.device_reused_tokens for r in results),
        cache=sum(r.connector_matched_tokens for r in results),
        computed=sum(r.computed_prompt_tokens for r in results),
    )


def by_source(found: Counter[tuple[str, str]]) -> Counter[str]:
    out: Counter[str] = Counter()
    for (source, _reason), value in found.items():
        out[source] += int(value)
    return out


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
@pytest.mark.parametrize("overlap", [False, True], ids=["plain-loop", "overlap-loop"])
def test_chunked_prefill_from_cache_device_and_scratch_adds_up(
    lmcache_server: LMCacheServer, executor_factory: Any, overlap: bool, manager_v2: bool
) -> None:
    ex = executor_factory(f"sources-chunked-{overlap}-{manager_v2}-model", lmcache_server.url, context_chunk_size=CHUNK,
                          overlap_scheduler=overlap, llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    shared = make_prompt(1, 4 * CHUNK)
    results = ex.run([PromptRequest(1, [*shared, *make_prompt(2, CHUNK // 2)], 2)])  # from scratch
    ex.evict_device_cache()
    results += ex.run([PromptRequest(2, [*shared, *make_prompt(3, 40)], 2)])  # from the cache server
    results += ex.run([PromptRequest(3, [*shared, *make_prompt(4, 70)], 2)])  # from the device
    results += ex.run([PromptRequest(4, make_prompt(5, CHUNK // 4), 2)])  # shorter than one chunk
    found = token_sources(ex)
    assert by_source(found) == engine_scheduled(results)
    assert results[1].connector_matched_tokens > 0 and results[2].device_reused_tokens > 0
    assert found["computed", "not_cached"] > 0, "the first prompt was computed: nothing was cached"
    assert found["computed", "partial_chunk"] > 0, "tails shorter than a chunk are never cached"
    assert found["computed", "final_block"] + found["computed", "partial_chunk"] >= 40
    assert set(found) <= {("device", "none"), ("cache", "none"), *(("computed", r) for r in contract.COMPUTED_REASONS)}


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
@pytest.mark.parametrize("partial_reuse", [True, False], ids=["partial-reuse-on", "partial-reuse-off"])
def test_partial_reuse_adds_up(
    lmcache_server: LMCacheServer, executor_factory: Any, partial_reuse: bool, manager_v2: bool
) -> None:
    ex = executor_factory(f"sources-partial-{partial_reuse}-{manager_v2}-model", lmcache_server.url,
                          enable_partial_reuse=partial_reuse, llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    shared = make_prompt(70, 200)
    x = shared + make_prompt(71, 200)
    results = ex.run([PromptRequest(1, x, 2)])
    ex.evict_device_cache()
    results += ex.run([PromptRequest(2, shared + make_prompt(72, 100), 2)])
    results += ex.run([PromptRequest(3, x, 2)])
    assert results[2].device_reused_tokens == (200 if partial_reuse else 192)
    assert by_source(token_sources(ex)) == engine_scheduled(results)


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_cancelled_requests_count_only_what_was_scheduled(
    lmcache_server: LMCacheServer, executor_factory: Any, manager_v2: bool
) -> None:
    ex = executor_factory(f"sources-cancel-{manager_v2}-model", lmcache_server.url, num_blocks=88,
                          context_chunk_size=CHUNK, llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    rng = random.Random(3)
    prefixes = [make_prompt(600 + i, 4 * CHUNK) for i in range(4)]
    results: list[RequestResult] = []
    rid = 0
    for _ in range(12):
        batch = []
        for _ in range(4):
            rid += 1
            prompt = prefixes[rng.randrange(4)] + make_prompt(rid, rng.randrange(1, CHUNK))
            batch.append(PromptRequest(rid, prompt, 4, cancel_after=rng.choice([1, 2, 3, None])))
        results += ex.run(batch)
        ex.evict_device_cache()
    assert sum(r.cancelled for r in results) >= 10
    print(f"v2={manager_v2}: connector {dict(by_source(token_sources(ex)))}, engine {dict(engine_scheduled(results))}")
    assert by_source(token_sources(ex)) == engine_scheduled(results)


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_server_kills_count_failed_lookups_as_computed_with_their_reason(
    doomed_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch, manager_v2: bool
) -> None:
    monkeypatch.setenv(contract.ENV_LOOKUP_TIMEOUT_MS, "500")
    ex = executor_factory(f"sources-kills-{manager_v2}-model", doomed_server.url, num_blocks=88,
                          context_chunk_size=CHUNK, llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    shared = make_prompt(90, 4 * CHUNK)
    results: list[RequestResult] = []
    for round_ in range(4):
        results += ex.run([PromptRequest(100 + round_, [*shared, *make_prompt(200 + round_, 30)], 2)])
        ex.evict_device_cache()
        doomed_server.kill()
        results += ex.run([PromptRequest(300 + round_, [*shared, *make_prompt(400 + round_, 30)], 2)])  # server down
        ex.evict_device_cache()
        doomed_server.start()
    found = token_sources(ex)
    print(f"v2={manager_v2}: connector {dict(by_source(found))}, engine {dict(engine_scheduled(results))}")
    assert by_source(found) == engine_scheduled(results)
    lost = found["computed", "cache_unavailable"] + found["computed", "lookup_timeout"]
    assert lost >= 4 * (4 * CHUNK - CHUNK), found
    assert not any(r.failed for r in results)


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_a_hit_measured_slower_to_load_than_to_compute_is_computed_and_counted_so(
    lmcache_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch, manager_v2: bool
) -> None:
    """The cost guard: once this engine process has measured loads, an engine whose prefill is
    (given as) faster than them computes the hit, bit-exact, and counts it ``slower_to_load``; with
    the guard off the same engine loads it."""
    model, shared = f"sources-guard-{manager_v2}-model", make_prompt(80, 4 * CHUNK)
    llm_args = {"kv_cache_manager_v2": manager_v2}

    def engine(recompute_tokens_per_s: str, guard: str = "on") -> Any:
        monkeypatch.setenv(contract.ENV_RECOMPUTE_TOKENS_PER_S, recompute_tokens_per_s)
        monkeypatch.setenv(contract.ENV_LOAD_COST_GUARD, guard)
        return executor_factory(model, lmcache_server.url, llm_args=llm_args)

    slow_prefill = engine("1")  # any load pays against one token a second
    slow_prefill.run([PromptRequest(1, [*shared, *make_prompt(81, 40)], 2)])
    slow_prefill.evict_device_cache()
    [measured] = slow_prefill.run([PromptRequest(2, [*shared, *make_prompt(82, 40)], 2)])
    assert measured.connector_matched_tokens > 0, "the first engine loads, and so measures a load"

    fast_prefill = engine("1e15")
    before = token_sources(fast_prefill)  # the model's counter: the first engine's counts are in it
    results = fast_prefill.run([PromptRequest(3, [*shared, *make_prompt(83, 40)], 2)])
    found = token_sources(fast_prefill) - before
    assert results[0].connector_matched_tokens == 0, "loaded a hit measured slower than its prefill"
    assert fast_prefill.kv_mismatches == 0
    assert found["computed", "slower_to_load"] == measured.connector_matched_tokens
    assert by_source(found) == engine_scheduled(results)

    unguarded = engine("1e15", guard="off")
    before = token_sources(unguarded)
    [loaded] = unguarded.run([PromptRequest(4, [*shared, *make_prompt(84, 40)], 2)])
    assert loaded.connector_matched_tokens == measured.connector_matched_tokens
    assert unguarded.kv_mismatches == 0 and (token_sources(unguarded) - before)["computed", "slower_to_load"] == 0
