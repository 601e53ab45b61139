"""Multi-head latent attention (DeepSeek-V3/R1, Kimi K2) served: a pool with one latent and no value
half per layer, stored once for a tensor-parallel group and read by every rank, shared with
attention-DP ranks. Real ``lmcache server`` on CPU, every KV position checked bit-exact."""

from __future__ import annotations

import os
import time
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

DEEPSEEK_V3 = {"num_layers": 61, "head_dim": 512 + 64}
"""DeepSeek-V3/R1's cache per layer and token: ``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 (config.json);
Kimi K2 has the same 61 layers and latent."""
SMALL_MLA = {"num_layers": 3, "head_dim": 64}
"""A cheap latent for tests whose point is not the shape."""


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
@pytest.mark.parametrize("model", ["deepseek-ai/DeepSeek-V3", "moonshotai/Kimi-K2-Instruct"])
def test_a_deepseek_v3_shaped_latent_pool_is_stored_and_loaded_bit_exact(
    lmcache_server: LMCacheServer, executor_factory: Any, model: str, manager_v2: bool
) -> None:
    """61 layers of a 576-wide bf16 latent, no value half (V1's ``SELFKONLY`` pool, V2's one "key"
    buffer): the prefix evicted from the device comes back from LMCache whole, bit-exact, and
    the output is the one computed from scratch."""
    ex = executor_factory(f"{model}-{manager_v2}", lmcache_server.url, mla=True, num_blocks=40, **DEEPSEEK_V3,
                          llm_args={"kv_cache_manager_v2": manager_v2, "kv_dtype": "bfloat16"})  # fmt: skip
    assert ex.kv_manager_v2 is manager_v2
    assert ex.rank0.worker.backend.cache_model.endswith("-mla-l61-w576"), "the key names MLA and its geometry"
    prompt = make_prompt(11, 3 * CHUNK + 9)
    first = ex.run([PromptRequest(1, prompt, 3)])[0]
    ex.evict_device_cache()
    again = ex.run([PromptRequest(2, prompt, 3)])[0]
    assert again.connector_matched_tokens == 3 * CHUNK and again.device_reused_tokens == 0
    assert again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_a_tp2_groups_latent_is_stored_once_and_read_by_every_rank_and_by_a_tp1_engine(
    lmcache_server: LMCacheServer, executor_factory: Any, manager_v2: bool
) -> None:
    """Every TP rank holds the same latent: rank 0 stores it as one rank's chunks, rank 1 loads rank
    0's copy (bit-exact on both ranks), and an engine of another TP size finds the same chunks
    (with per-rank keys it would find none)."""
    model = f"mla-tp-{manager_v2}-model"
    tp2 = executor_factory(model, lmcache_server.url, mla=True, **SMALL_MLA,
                           llm_args={"tp": 2, "kv_cache_manager_v2": manager_v2})  # fmt: skip
    stored = make_prompt(21, 4 * CHUNK + 5)
    first = tp2.run([PromptRequest(1, stored, 3)])[0]
    tp2.evict_device_cache()
    again = tp2.run([PromptRequest(2, stored, 3)])[0]
    assert again.connector_matched_tokens == 4 * CHUNK and again.output_tokens == first.output_tokens
    assert tp2.kv_mismatches == 0, "rank 1 read rank 0's copy bit-exact"
    assert settle_commits()
    tp1 = executor_factory(model, lmcache_server.url, mla=True, **SMALL_MLA,
                           llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    from_group = tp1.run([PromptRequest(3, stored, 3)])[0]
    assert from_group.connector_matched_tokens == 4 * CHUNK
    own = make_prompt(22, 3 * CHUNK + 1)
    tp1.run([PromptRequest(4, own, 3)])
    assert settle_commits()
    back = tp2.run([PromptRequest(5, own, 3)])[0]
    assert back.connector_matched_tokens == 3 * CHUNK
    # Outputs differ across TP sizes (the stand-in sums every rank's attention); the KV itself is
    # checked position by position after every forward, loaded positions included.
    assert tp1.kv_mismatches == 0 and tp2.kv_mismatches == 0


def test_attention_dp_ranks_share_the_latent_with_each_other_and_with_a_tp_group(
    lmcache_server: LMCacheServer, executor_factory: Any, connector_env: dict[str, str]
) -> None:
    """Under attention DP every rank holds whole latents for its own requests: what one DP rank
    stored another loads, and a plain-TP group of the same model reads it too (one copy, one key)."""
    model = "mla-adp-model"
    adp = {"tp": 2, "attention_dp": True, "kv_cache_manager_v2": True}
    rank0 = executor_factory(model, lmcache_server.url, mla=True, attention_dp_rank=0, llm_args=adp, **SMALL_MLA)
    rank1 = AttentionDpRank(connector_llm_args(model, lmcache_server.url, **adp), 1, dict(os.environ), mla=True,
                            num_blocks=64, **SMALL_MLA)  # fmt: skip
    prompt = make_prompt(31, 5 * CHUNK + 3)
    try:
        first = rank0.run([PromptRequest(1, prompt, 3)])[0]
        assert settle_commits()
        on_other = rank1.run([PromptRequest(2, prompt, 3)])[0]
        report1 = rank1.report()
    finally:
        rank1.close()
    assert on_other.connector_matched_tokens == 5 * CHUNK and on_other.output_tokens == first.output_tokens
    tp_group = executor_factory(model, lmcache_server.url, mla=True, **SMALL_MLA,
                                llm_args={"tp": 2, "kv_cache_manager_v2": True})  # fmt: skip
    from_dp = tp_group.run([PromptRequest(3, prompt, 3)])[0]
    assert from_dp.connector_matched_tokens == 5 * CHUNK  # outputs differ across TP sizes; the KV is checked
    assert rank0.kv_mismatches == 0 and report1["kv_mismatches"] == 0 and tp_group.kv_mismatches == 0


def test_a_latent_pool_and_a_key_value_pool_of_one_model_never_read_each_others_chunks(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """The same model name and block bytes, but one pool is MLA: the layout in the key keeps them apart."""
    model = "mla-vs-kv-model"
    mla = executor_factory(model, lmcache_server.url, mla=True, num_layers=2, head_dim=16)
    prompt = make_prompt(41, 2 * CHUNK + 3)
    mla.run([PromptRequest(1, prompt, 2)])
    assert settle_commits()
    kv = executor_factory(model, lmcache_server.url, num_layers=2, num_kv_heads=1, head_dim=8)
    assert kv.rank0.worker.backend.cache_model != mla.rank0.worker.backend.cache_model
    assert kv.run([PromptRequest(2, prompt, 2)])[0].connector_matched_tokens == 0
    assert kv.kv_mismatches == 0 and mla.kv_mismatches == 0


def test_salts_and_lora_adapters_scope_latent_chunks_as_they_scope_key_value_chunks(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """One copy per TP group does not mean one copy per tenant: a salted or adapter request neither
    loads the plain one's latent nor leaves its own to it, and each loads its own back, bit-exact."""
    ex = executor_factory("mla-scope-model", lmcache_server.url, mla=True, **SMALL_MLA,
                          llm_args={"tp": 2, "kv_cache_manager_v2": True})  # fmt: skip
    prompt = make_prompt(51, 3 * CHUNK + 7)
    plain = ex.run([PromptRequest(1, prompt, 2)])[0]
    ex.evict_device_cache()
    salted = ex.run([PromptRequest(2, prompt, 2, cache_salt="tenant-a")])[0]
    lora = ex.run([PromptRequest(3, prompt, 2, lora_task_id=7)])[0]
    assert salted.connector_matched_tokens == 0 and lora.connector_matched_tokens == 0
    ex.evict_device_cache()
    again = ex.run([PromptRequest(4, prompt, 2, cache_salt="tenant-a"), PromptRequest(5, prompt, 2, lora_task_id=7)])
    assert [r.connector_matched_tokens for r in again] == [3 * CHUNK, 3 * CHUNK]
    assert [r.output_tokens for r in again] == [salted.output_tokens, lora.output_tokens]
    assert lora.output_tokens != plain.output_tokens, "the stand-in's latent does not depend on the adapter"
    assert ex.kv_mismatches == 0


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_cancelled_requests_never_leak_a_latent_into_later_requests(
    lmcache_server: LMCacheServer, executor_factory: Any, manager_v2: bool
) -> None:
    """``test_cancelled_requests_never_leak_kv_into_later_requests`` on a latent pool (fewer rounds):
    cancellations mid chunked prefill behind a busy server, then every prefix again from LMCache."""
    from tests.integration.connector.test_connector_on_real_executor import (
        PREFIXES,
        cancellation_stream,
        make_server_busy,
    )

    ex = executor_factory(f"mla-cancel-{manager_v2}-model", lmcache_server.url, mla=True, num_blocks=88,
                          context_chunk_size=CHUNK, **SMALL_MLA, llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    make_server_busy(ex, 0.03)
    cancelled = 0
    for batch in cancellation_stream(seed=13, rounds=20, per_round=4):
        results = ex.run(batch)
        cancelled += sum(r.cancelled for r in results)
        assert not any(r.failed for r in results)
        ex.evict_device_cache()
    again = [PromptRequest(9000 + i, [*make_prompt(500 + i, 4 * CHUNK), 7, 8, 9], 2) for i in range(PREFIXES)]
    results = [r for half in (again[:3], again[3:]) for r in ex.run(half)]
    assert not any(r.failed for r in results) and sum(r.connector_matched_tokens for r in results) > 0
    assert cancelled >= 50 and ex.kv_mismatches == 0
    assert ex.scheduler.tracked_request_ids == frozenset()


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_a_replayed_request_keeps_its_latent_load_when_its_old_blocks_go_to_another_request(
    lmcache_server: LMCacheServer, executor_factory: Any, manager_v2: bool
) -> None:
    """MAX_UTILIZATION's destroy and replay on a latent pool: the replay is asked again and loads bit-exact."""
    ex = executor_factory(f"mla-replay-{manager_v2}-model", lmcache_server.url, mla=True, **SMALL_MLA,
                          llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    prompt = make_prompt(77, 4 * CHUNK + 5)
    assert not ex.run([PromptRequest(1, prompt, 1)])[0].failed
    ex.evict_device_cache()
    replayed, other = ex.run(
        [PromptRequest(2, prompt, 3, replay_on_admission=True), PromptRequest(3, make_prompt(78, 100), 3)]
    )
    assert not replayed.failed and not other.failed
    assert replayed.connector_matched_tokens == 4 * CHUNK
    assert ex.kv_mismatches == 0 and ex.scheduler.tracked_request_ids == frozenset()


def test_a_tp2_latent_load_secured_in_a_restarted_servers_segment_reaches_a_rank_whose_heartbeat_lags(
    doomed_server: LMCacheServer, executor_factory: Any
) -> None:
    """After a server restart rank 0 registers again first, stores the latent alone (one copy per TP
    group) and secures a load in the new L1 segment; rank 1's heartbeat thread (stalled here, as on a
    starved CPU) has not mapped that segment yet when the load reaches it. Rank 1 registers and maps it there, instead of failing
    every request of the batch (``KV load failed``: what a test of the restart saw once in a while)."""
    ex = executor_factory("mla-lagging-rank-model", doomed_server.url, mla=True, **SMALL_MLA, llm_args={"tp": 2})
    prompt = make_prompt(63, 3 * CHUNK + 5)
    (first,) = ex.run([PromptRequest(1, prompt, 2)])
    ex.stall_follower_heartbeats()
    worker = ex.rank0.worker.backend
    # A new registration, not a new segment identity: nothing maps the old segment any more, so the
    # restarted server's may reuse its inode.
    before = worker.registration_generation
    doomed_server.kill()
    doomed_server.start()
    deadline = time.monotonic() + 60
    while worker.registration_generation == before:  # rank 0 alone
        assert time.monotonic() < deadline, "rank 0 never registered with the restarted server"
        worker.heartbeat_once()
        time.sleep(0.05)
    scheduler = ex.scheduler.backend
    while not scheduler.is_up():  # its lookups go again
        assert time.monotonic() < deadline, "the scheduler never reached the restarted server"
        scheduler.heartbeat_once()
        time.sleep(0.05)
    ex.evict_device_cache()
    (stored,) = ex.run([PromptRequest(2, prompt, 2)])  # rank 0 stores the group's one copy
    assert settle_commits()
    ex.evict_device_cache()
    (loaded,) = ex.run([PromptRequest(3, prompt, 2)])
    assert not stored.failed and not loaded.failed, loaded.error
    assert loaded.connector_matched_tokens == 3 * CHUNK
    assert loaded.output_tokens == first.output_tokens and ex.kv_mismatches == 0


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_a_tp2_latent_load_secured_before_a_server_kill_arrives_bit_exact_on_every_rank(
    doomed_server: LMCacheServer, executor_factory: Any, manager_v2: bool
) -> None:
    """The one copy of a TP group's latent is secured once at lookup; the server is SIGKILLed right
    after it, before the load: both ranks still copy it from the mapped segment, no request fails,
    and once the server is back the group stores and loads again."""
    ex = executor_factory(f"mla-kill-{manager_v2}-model", doomed_server.url, mla=True, **SMALL_MLA,
                          llm_args={"tp": 2, "kv_cache_manager_v2": manager_v2})  # fmt: skip
    prompt = make_prompt(61, 4 * CHUNK + 3)
    first = ex.run([PromptRequest(1, prompt, 2)])[0]
    ex.evict_device_cache()
    killed = kill_after_first_hit(ex, doomed_server)
    loaded = ex.run([PromptRequest(2, prompt, 2)])[0]
    assert killed == [4 * CHUNK] and not loaded.failed
    assert loaded.connector_matched_tokens == 4 * CHUNK and loaded.output_tokens == first.output_tokens
    doomed_server.start()
    later = make_prompt(62, 3 * CHUNK + 1)
    deadline, rid, matched = time.monotonic() + 120, 10, 0  # the deadline only stops a hang
    while matched == 0:  # the heartbeat re-registers the pool with the restarted server
        assert time.monotonic() < deadline, "the group never stored again after the restart"
        assert not ex.run([PromptRequest(rid, later, 2)])[0].failed
        assert settle_commits()
        ex.evict_device_cache()
        matched = ex.run([PromptRequest(rid + 1, later, 2)])[0].connector_matched_tokens
        ex.evict_device_cache()
        rid += 2
    assert matched == 3 * CHUNK
    assert ex.kv_mismatches == 0
