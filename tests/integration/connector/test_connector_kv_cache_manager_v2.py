"""The connector under KVCacheManagerV2, TensorRT-LLM main's default for most models ("auto" resolves
to it for Llama 3.x/4, DeepSeek, GPT-OSS, Gemma, Qwen3-Next): the stand-in's V2 manager registers a
layout, allocates pages per chunk and may honour less than the connector offered (a grow that fails).
Real ``lmcache server`` on CPU, every KV position checked."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integration.connector.test_connector_on_real_executor import outputs_of_stream
from tests.integration.connector.test_connector_token_sources import by_source, engine_scheduled, token_sources
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import (
    CHUNK,
    KV_CACHE_MANAGER_V2_VERSIONS,
    PromptRequest,
    StandinExecutor,
    connector_llm_args,
    make_prompt,
)

pytestmark = pytest.mark.connector

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
MINIMAX = "MiniMaxAI/MiniMax-M2"

on_every_v2_version = pytest.mark.parametrize("version", KV_CACHE_MANAGER_V2_VERSIONS)
"""Every test here runs on each stand-in version whose connector path runs on KVCacheManagerV2."""


@on_every_v2_version
def test_a_default_llama3_configuration_runs_kv_cache_manager_v2_and_hits(
    lmcache_server: LMCacheServer, executor_factory: Any, version: str
) -> None:
    """No option set: "auto" resolves to V2 for Llama and is written back into ``llm_args`` before
    the connector is built; the connector starts, stores and loads bit-exact."""
    ex = executor_factory(f"{LLAMA}-default-v2-{version}", lmcache_server.url, num_blocks=64, version=version)
    assert ex.llm_args.kv_cache_config.use_kv_cache_manager_v2 is True
    prompt = make_prompt(3, 4 * CHUNK + 20)
    first = ex.run([PromptRequest(1, prompt, 3)])[0]
    ex.evict_device_cache()
    again = ex.run([PromptRequest(2, prompt, 3)])[0]
    assert again.connector_matched_tokens == 4 * CHUNK and again.device_reused_tokens == 0
    assert again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0


@on_every_v2_version
def test_an_offer_honoured_in_part_is_loaded_only_as_far_as_it_was_honoured(
    lmcache_server: LMCacheServer, executor_factory: Any, version: str
) -> None:
    """A tight pool with another request holding most pages: the 256-token offer needs a grow that
    fails, V2 honours the 48 tokens its first chunk's pages hold. The connector copies only those,
    the engine computes the rest, and the token sources count 48 from the cache."""
    ex = executor_factory(f"v2-partial-honour-{version}-model", lmcache_server.url, num_blocks=32,
                          context_chunk_size=CHUNK, version=version, llm_args={"kv_cache_manager_v2": True})  # fmt: skip
    prompt = make_prompt(5, 4 * CHUNK + 40)
    seed = ex.run([PromptRequest(1, prompt, 1)])
    ex.evict_device_cache()
    holder = PromptRequest(2, make_prompt(6, 300), 3)  # 19 of the 32 pages, decoding when the other arrives
    served = PromptRequest(3, prompt, 3, arrive_after=5)
    results = ex.run([holder, served])
    assert results[1].connector_matched_tokens == 48, "V2 honoured the whole blocks of the first chunk's pages"
    assert ex.kv_mismatches == 0
    assert by_source(token_sources(ex)) == engine_scheduled(seed + results)  # the cache counted 48, not 256
    assert ex.scheduler.tracked_request_ids == frozenset()


@on_every_v2_version
@pytest.mark.parametrize("overlap", [False, True], ids=["plain-loop", "overlap-loop"])
def test_chunked_prefill_with_pages_per_chunk_gives_the_outputs_of_v1(
    lmcache_server: LMCacheServer, executor_factory: Any, overlap: bool, version: str
) -> None:
    """Pages arrive with each chunk (later ones in ``cached_requests``): every chunk is saved from the
    pages that hold it and loaded bit-exact; with cancellations, outputs equal V1's."""
    outputs = {}
    for manager in (False, True):
        ex = executor_factory(f"v2-chunked-{overlap}-{manager}-{version}-model", lmcache_server.url, num_blocks=88,
                              context_chunk_size=CHUNK, overlap_scheduler=overlap, version=version,
                              llm_args={"kv_cache_manager_v2": manager})  # fmt: skip
        assert ex.kv_manager_v2 is manager
        outputs[manager] = outputs_of_stream(ex, seed=53, rounds=10, cancel_share=0.3)
        assert ex.kv_mismatches == 0
        assert ex.scheduler.tracked_request_ids == frozenset()
    assert outputs[True] == outputs[False] and len(outputs[False]) >= 15


@pytest.mark.parametrize(("model", "resolved"), [(LLAMA, False), (MINIMAX, True)], ids=["llama-3", "minimax-m2"])
def test_on_a_1_3_rc_before_the_v2_connector_path_the_engine_runs_v1_whatever_the_flag_says(
    lmcache_server: LMCacheServer, executor_factory: Any, model: str, resolved: bool
) -> None:
    """1.3.0rc22-rc26: "auto" resolves MiniMax M2 to V2 (#17360; not yet Llama) and writes True back, but with a
    connector the engine builds V1 (``_validate_or_fallback_kv_cache_manager_v2``) and records no
    honoured count. The connector reads none of that flag: it registers the one pool tensor, and
    every offer is honoured whole and loaded bit-exact."""
    ex = executor_factory(f"{model}-default-1.3rc", lmcache_server.url, num_blocks=64, version="1.3.0rc")
    assert ex.llm_args.kv_cache_config.use_kv_cache_manager_v2 is resolved
    assert not ex.kv_manager_v2, "the connector runs on V1"
    prompt = make_prompt(8, 4 * CHUNK + 20)
    first = ex.run([PromptRequest(1, prompt, 3)])[0]
    ex.evict_device_cache()
    again = ex.run([PromptRequest(2, prompt, 3)])[0]
    assert again.connector_matched_tokens == 4 * CHUNK and again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0


@on_every_v2_version
def test_one_sliding_window_layer_group_is_refused_at_engine_start_naming_the_window(
    lmcache_server: LMCacheServer, version: str
) -> None:
    """All layers share one 64-token window: V2 registers one group with that ``window_size``, whose
    pages behind the window go back to the pool. With no full-attention group to anchor its chunks
    the worker refuses the layout at start, naming the window."""
    args = connector_llm_args(f"swa-{version}-model", lmcache_server.url, kv_cache_manager_v2=True)
    with pytest.raises(RuntimeError, match=r"sliding attention window \(64 tokens\) and none attends"):
        StandinExecutor(args, version=version, sliding_window=64)
