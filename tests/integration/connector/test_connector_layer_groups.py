"""Variable sliding-window attention (GPT-OSS, Gemma 3/4) on KVCacheManagerV2, through the real
``lmcache server``: one layer group per attention window, each its own pages; a sliding group's
pages behind its window go back to the pool after each forward and read -1, device reuse holds a
sliding group's window only, and a loaded prefix gets sliding pages only inside the window at its
end (the stand-in follows V2's ``_life_cycle_registry``, ``_block_radix_tree`` and
``_resize_for_connector_prefix``). The stand-in's forward checks every block a full-attention layer
reads and the window a sliding layer reads, so wrong KV in either group counts as mismatches."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tests.support.lmcache_server import LMCacheServer
from tests.support.server_kills import kill_after_first_hit
from tests.support.trtllm_executor import (
    CHUNK,
    AttentionDpRank,
    PromptRequest,
    connector_llm_args,
    make_prompt,
    settle_commits,
)

pytestmark = pytest.mark.connector

GPT_OSS = (48, None)
"""Layers alternate a 48-token sliding window and full attention, the sliding group first (group 0)."""
GEMMA = (40, 40, 40, 40, 40, None)
"""Five local layers of a 40-token window to one global layer."""
PROMPT = make_prompt(71, 4 * CHUNK + 10)


def vswa(executor_factory: Any, model: str, url: str, windows: tuple[int | None, ...], **kwargs: Any) -> Any:
    llm_args = {"kv_cache_manager_v2": True, **kwargs.pop("llm_args", {})}
    return executor_factory(
        model, url, layer_windows=windows, num_layers=len(windows) * 2, enable_partial_reuse=False,
        llm_args=llm_args, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("windows", [GPT_OSS, GEMMA], ids=["gpt-oss", "gemma"])
def test_a_vswa_prompt_is_stored_and_a_fresh_engine_state_loads_it_bit_exact(
    lmcache_server: LMCacheServer, executor_factory: Any, windows: tuple[int | None, ...]
) -> None:
    """Every whole chunk of the prompt is stored (every group held its pages in that forward); after
    the device forgot it, the next request loads all of them: the full-attention group the whole
    prefix, the sliding group the window before the first computed token. The same output, no wrong KV."""
    ex = vswa(executor_factory, f"vswa-{len(windows)}-model", lmcache_server.url, windows)
    first = ex.run([PromptRequest(1, PROMPT, 3)])[0]
    assert first.connector_matched_tokens == 0 and not first.failed
    ex.evict_device_cache()
    again = ex.run([PromptRequest(2, PROMPT, 3)])[0]
    assert again.device_reused_tokens == 0 and again.connector_matched_tokens == 4 * CHUNK
    assert again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0


def test_a_shared_prefix_then_another_continuation_loads_the_prefix_and_its_window(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """A second prompt shares the first's two chunks and then differs: it loads those two chunks (the
    sliding group's pages of the window before 128, which the first prompt stored mid-prompt) and
    computes the rest; a third request of the first prompt still loads all of it."""
    ex = vswa(executor_factory, "vswa-prefix-model", lmcache_server.url, GPT_OSS)
    first = ex.run([PromptRequest(1, PROMPT, 2)])[0]
    ex.evict_device_cache()
    other = [*PROMPT[: 2 * CHUNK], *make_prompt(72, 2 * CHUNK + 7)]
    branch = ex.run([PromptRequest(2, other, 2)])[0]
    assert branch.connector_matched_tokens == 2 * CHUNK and not branch.failed
    ex.evict_device_cache()
    again = ex.run([PromptRequest(3, PROMPT, 2)])[0]
    assert again.connector_matched_tokens == 4 * CHUNK and again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0


def test_the_next_turn_reuses_the_device_window_and_loads_what_the_sliding_group_released(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """A chat's next turn extends the first prompt without evicting it: the device's match is cut to
    where the sliding group still holds its window (its pages behind the window went back), and
    the connector serves what lies past that, bit-exact."""
    ex = vswa(executor_factory, "vswa-turns-model", lmcache_server.url, GPT_OSS)
    first = ex.run([PromptRequest(1, PROMPT, 2)])[0]
    turn = [*PROMPT, *first.output_tokens, *make_prompt(73, CHUNK + 30)]
    second = ex.run([PromptRequest(2, turn, 2)])[0]
    assert not second.failed
    assert second.device_reused_tokens + second.connector_matched_tokens >= 4 * CHUNK
    assert ex.kv_mismatches == 0


def test_chunked_prefill_never_stores_a_chunk_whose_sliding_pages_left_before_it_completed(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """Prefill in 32-token chunks with a 16-token window: when a 64-token chunk completes, the sliding
    group already released its first blocks, so no chunk holds every group's pages and nothing is
    stored (a chunk with another request's page in it would be wrong KV for every later hit)."""
    ex = vswa(executor_factory, "vswa-chunked-model", lmcache_server.url, (16, None), context_chunk_size=32)
    first = ex.run([PromptRequest(1, PROMPT, 2)])[0]
    ex.evict_device_cache()
    again = ex.run([PromptRequest(2, PROMPT, 2)])[0]
    assert not first.failed and not again.failed
    assert again.connector_matched_tokens == 0 and again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0


def test_a_tp2_vswa_engine_stores_and_loads_each_ranks_heads_bit_exact(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    ex = vswa(executor_factory, "vswa-tp2-model", lmcache_server.url, GPT_OSS, llm_args={"tp": 2})
    first = ex.run([PromptRequest(1, PROMPT, 2)])[0]
    ex.evict_device_cache()
    again = ex.run([PromptRequest(2, PROMPT, 2)])[0]
    assert again.connector_matched_tokens == 4 * CHUNK and again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0


def test_a_salted_vswa_prompt_is_never_loaded_by_another_tenant(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    ex = vswa(executor_factory, "vswa-salt-model", lmcache_server.url, GPT_OSS)
    ex.run([PromptRequest(1, PROMPT, 2, cache_salt="tenant-a")])
    ex.evict_device_cache()
    other = ex.run([PromptRequest(2, PROMPT, 2, cache_salt="tenant-b")])[0]
    ex.evict_device_cache()
    own = ex.run([PromptRequest(3, PROMPT, 2, cache_salt="tenant-a")])[0]
    assert other.connector_matched_tokens == 0 and own.connector_matched_tokens == 4 * CHUNK
    assert ex.kv_mismatches == 0


def test_vswa_chunks_are_keyed_apart_from_a_dense_layout_of_the_same_model(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """The same model name with every layer full-attention (another engine build) never reads the
    VSWA engine's chunks: the key names each group's window, layers and page bytes."""
    dense = executor_factory("vswa-or-dense-model", lmcache_server.url, num_layers=4,
                             llm_args={"kv_cache_manager_v2": True})  # fmt: skip
    dense.run([PromptRequest(1, PROMPT, 2)])
    ex = vswa(executor_factory, "vswa-or-dense-model", lmcache_server.url, GPT_OSS)
    assert ex.run([PromptRequest(2, PROMPT, 2)])[0].connector_matched_tokens == 0
    assert ex.kv_mismatches == 0 and dense.kv_mismatches == 0


def test_two_lora_adapters_never_share_vswa_chunks(lmcache_server: LMCacheServer, executor_factory: Any) -> None:
    ex = vswa(executor_factory, "vswa-lora-model", lmcache_server.url, GPT_OSS)
    first = ex.run([PromptRequest(1, PROMPT, 2, lora_task_id=1)])[0]
    ex.evict_device_cache()
    other = ex.run([PromptRequest(2, PROMPT, 2, lora_task_id=2)])[0]
    ex.evict_device_cache()
    again = ex.run([PromptRequest(3, PROMPT, 2, lora_task_id=1)])[0]
    assert other.connector_matched_tokens == 0 and again.connector_matched_tokens == 4 * CHUNK
    assert again.output_tokens == first.output_tokens and ex.kv_mismatches == 0


def test_a_replayed_vswa_allocation_loads_bit_exact_into_its_new_pages(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """MAX_UTILIZATION destroys the first allocation (every group's pages go back) and replays the
    request: it is asked again and loads into the pages of its second allocation."""
    ex = vswa(executor_factory, "vswa-replay-model", lmcache_server.url, GPT_OSS)
    first = ex.run([PromptRequest(1, PROMPT, 2)])[0]
    ex.evict_device_cache()
    replayed, other = ex.run(
        [PromptRequest(2, PROMPT, 2, replay_on_admission=True), PromptRequest(3, make_prompt(74, 100), 2)]
    )
    assert not replayed.failed and not other.failed
    assert replayed.connector_matched_tokens == 4 * CHUNK and replayed.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0 and ex.scheduler.tracked_request_ids == frozenset()


def test_a_vswa_load_secured_before_a_server_kill_arrives_bit_exact(
    doomed_server: LMCacheServer, executor_factory: Any
) -> None:
    """Every group's pages of a chunk are secured at lookup in one PREPARE; the server is SIGKILLed
    right after, before the load: the copies come from the mapped segment, bit-exact."""
    ex = vswa(executor_factory, "vswa-kill-model", doomed_server.url, GPT_OSS)
    first = ex.run([PromptRequest(1, PROMPT, 2)])[0]
    ex.evict_device_cache()
    killed = kill_after_first_hit(ex, doomed_server)
    loaded = ex.run([PromptRequest(2, PROMPT, 2)])[0]
    assert killed == [4 * CHUNK] and not loaded.failed
    assert loaded.output_tokens == first.output_tokens and ex.kv_mismatches == 0


def the_prompt_again_loads_what_the_cancelled_request_stored(
    ex: Any, cancelled: Any, executor_factory: Any, url: str, clean_model: str
) -> None:
    """``PROMPT`` run again on ``ex`` after ``cancelled`` (cancelled after its first prefill chunk)
    loads the chunk it stored and computes the rest: the outputs of a clean engine, bit-exact, and
    nothing of either request still tracked."""
    later = ex.run([PromptRequest(2, PROMPT, 2)])[0]
    clean = vswa(executor_factory, clean_model, url, GPT_OSS)
    expected = clean.run([PromptRequest(3, PROMPT, 2)])[0]
    assert cancelled.cancelled and not later.failed
    assert later.connector_matched_tokens == 2 * CHUNK and later.output_tokens == expected.output_tokens
    assert ex.kv_mismatches == 0 and ex.scheduler.tracked_request_ids == frozenset()


def test_a_request_cancelled_mid_prefill_leaves_no_wrong_vswa_chunk_behind(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """Cancelled after its first prefill chunk: what it stored is every group's, and a later request of
    the same prompt loads it and computes the rest, bit-exact; nothing of it stays tracked."""
    ex = vswa(executor_factory, "vswa-cancel-model", lmcache_server.url, GPT_OSS, context_chunk_size=2 * CHUNK)
    cancelled = ex.run([PromptRequest(1, PROMPT, 2, cancel_after=1)])[0]
    ex.evict_device_cache()
    the_prompt_again_loads_what_the_cancelled_request_stored(
        ex, cancelled, executor_factory, lmcache_server.url, "vswa-cancel-clean-model"
    )


def test_two_attention_dp_ranks_load_each_others_vswa_chunks(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    model, adp = "vswa-adp-model", {"tp": 2, "attention_dp": True}
    rank0 = vswa(executor_factory, model, lmcache_server.url, GPT_OSS, llm_args=adp, attention_dp_rank=0)
    args = connector_llm_args(model, lmcache_server.url, kv_cache_manager_v2=True, **adp)
    rank1 = AttentionDpRank(args, 1, dict(os.environ), layer_windows=GPT_OSS, num_layers=4, enable_partial_reuse=False)
    try:
        first = rank0.run([PromptRequest(1, PROMPT, 2)])[0]
        assert settle_commits()
        again = rank1.run([PromptRequest(2, PROMPT, 2)])[0]
        report = rank1.report()
    finally:
        rank1.close()
    assert again.connector_matched_tokens == 4 * CHUNK and again.output_tokens == first.output_tokens
    assert rank0.kv_mismatches == 0 and report["kv_mismatches"] == 0


def test_an_idle_attention_dp_ranks_dummy_takes_a_page_in_every_layer_group_and_the_rank_still_loads_bit_exact(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """KVCacheManagerV2's ``add_dummy_requests`` gives an idle DP rank's dummy request a whole KV
    cache: a page in every layer group (the sliding one's too), written by its forward. A rank whose
    request was cancelled mid-prefill idles (its connector forgets the request and fences its pages
    in both groups), then serves the prompt again: what the cancelled request stored loads bit-exact."""
    adp = {"tp": 2, "attention_dp": True}
    ex = vswa(executor_factory, "vswa-adp-idle-model", lmcache_server.url, GPT_OSS, llm_args=adp,
              attention_dp_rank=0, context_chunk_size=2 * CHUNK)  # fmt: skip
    cancelled = ex.run([PromptRequest(1, PROMPT, 2, cancel_after=1)])[0]
    ex.idle(2)
    assert ex.dummy_forwards == 2 and ex.dummy_pages_taken == [2, 2], "one page per layer group per dummy"
    assert ex.scheduler.tracked_request_ids == frozenset()
    ex.evict_device_cache()
    assert settle_commits()
    the_prompt_again_loads_what_the_cancelled_request_stored(
        ex, cancelled, executor_factory, lmcache_server.url, "vswa-adp-idle-clean-model"
    )
