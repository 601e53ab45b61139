"""Tier truth of the KV events (issue 45 item 5), against a real LMCache server on the sidecar's
command line, a stand-in engine, and the real routers (Dynamo's indexer, llm-d's index) or vLLM
0.34.0's own event schema: a chunk LMCache loads back from L2 into L1 is announced in L1 again, and
a chunk two L2s hold is announced once in the medium they share."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hack.ports import free_port
from kvoffload import contract
from tests.integration.connector.test_connector_kv_events_router import (
    CACHED,
    GEOMETRY,
    PROMPT,
    eventually,
    llmd_topics,
    running,
    sidecar_server,
)
from tests.support.kv_event_tap import KvEventTap, block_ids_of, held_by_medium
from tests.support.kv_router import DynamoIndexer, LlmdIndex
from tests.support.sidecar_harness import wait_for
from tests.support.trtllm_executor import BLOCK, PromptRequest, make_prompt, settle_commits

pytestmark = pytest.mark.connector


def run_prompt(engine: Any, seed: int) -> tuple[list[int], Any]:
    """``seed``'s prompt through ``engine``, its stores committed, its device blocks dropped."""
    prompt = make_prompt(seed, PROMPT)
    (result,) = engine.run([PromptRequest(seed, prompt, 2)])
    assert not result.failed, result.error
    assert settle_commits()
    engine.evict_device_cache()
    return prompt, result


def test_a_prefix_lmcache_loads_back_from_the_filesystem_l2_into_l1_is_ranked_in_the_host_tier_again_by_both_routers(
    tmp_path: Path, executor_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stores a prompt (host and disk tiers); a second prompt fills A's 64 MiB L1, which evicts the
    first from L1, not from the filesystem L2: both routers' host-tier match drops. The first prompt
    again is a hit LMCache loads from L2 into L1: Dynamo's indexer and llm-d's index rank A's host
    tier for the whole prefix again. (llm-d 0.8.1 reads only positional arrays: A publishes them.)"""
    l2 = tmp_path / "l2"
    l2.mkdir()
    env = {**llmd_topics()["a"], contract.ENV_L2_FS_PATH: str(l2), contract.ENV_L2_FS_SIZE: "1Gi"}
    server, events = sidecar_server(tmp_path, "a", env)
    dynamo = DynamoIndexer({1: events}, BLOCK, tmp_path / "indexer.log")
    llmd = LlmdIndex({"pod-a": events}, BLOCK, tmp_path / "llmd-index.log")
    monkeypatch.setenv(contract.ENV_KV_EVENTS, "true")
    with running(server, dynamo, llmd):
        engine = executor_factory("events-model", server.url, num_blocks=40, **GEOMETRY)

        def host_tiers(tokens: list[int]) -> tuple[int, int]:
            return dynamo.host_tier_matches(tokens).get(1, 0), llmd.tier_matches(tokens, "cpu", "events-model").get(
                "pod-a", 0
            )

        first, _ = run_prompt(engine, 1)
        # llm-d's subscriber retries its connection every 5 s: the first events may wait for it.
        eventually(lambda: host_tiers(first) == (CACHED, CACHED), "both routers rank A's host tier", 60.0)
        run_prompt(engine, 3)  # fills the 64 MiB L1: the first prompt leaves L1, not L2
        eventually(lambda: max(host_tiers(first)) < CACHED, "both routers' host-tier match drops")
        assert dynamo.tier_matches(first, "disk") == {1: CACHED}

        _, again = run_prompt(engine, 1)
        assert again.connector_matched_tokens == CACHED, "the prefix was loaded from L2 into L1"
        eventually(lambda: host_tiers(first) == (CACHED, CACHED), "both routers rank A's host tier again")


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    """A real ``redis-server`` (Debian package) on a free port, without a password."""
    port = free_port()
    proc = subprocess.Popen(
        ["/usr/bin/redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        wait_for(lambda: subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).returncode == 0,
                 30, "redis-server")  # fmt: skip
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_chunk_the_filesystem_and_the_redis_l2_both_hold_is_announced_once_as_storage_and_stays_when_the_disk_drops_it(
    tmp_path: Path, executor_factory: Any, monkeypatch: pytest.MonkeyPatch, redis_url: str
) -> None:
    """vLLM's maps name both L2s ``STORAGE`` (apart only by ``locality``, which llm-d's index keys
    without). A with a 40 MiB filesystem L2 and a Redis L2 stores three prompts: the filesystem L2
    drops the first prompt's chunks while Redis keeps them. Decoded with vLLM 0.34.0's classes, no
    block is ever announced twice in one medium without a removal between, and a router keying by
    medium still holds every block of the first prompt in ``STORAGE``."""
    l2 = tmp_path / "l2"
    l2.mkdir()
    env = {contract.ENV_L2_FS_PATH: str(l2), contract.ENV_L2_FS_SIZE: "40Mi", contract.ENV_L2_REDIS_URL: redis_url}
    server, events = sidecar_server(tmp_path, "a", env)
    monkeypatch.setenv(contract.ENV_KV_EVENTS, "true")
    server.start()
    try:
        with KvEventTap(events) as tap:
            engine = executor_factory("events-model", server.url, num_blocks=40, **GEOMETRY)
            first, _ = run_prompt(engine, 1)
            eventually(lambda: len(block_ids_of(tap.events(), first[:CACHED], BLOCK)) == CACHED // BLOCK,
                       "A announced the first prompt")  # fmt: skip
            blocks = block_ids_of(tap.events(), first[:CACHED], BLOCK)
            run_prompt(engine, 3)
            run_prompt(engine, 5)

            def dropped_from_disk() -> bool:
                return any(
                    type(e).__name__ == "BlockRemoved" and e.locality == "LOCAL" and blocks & set(e.block_hashes)
                    for e in tap.events()
                )

            eventually(dropped_from_disk, "the filesystem L2 dropped a chunk of the first prompt")
            twice = {key: n for key, n in held_by_medium(tap.events()).items() if n > 1}
            assert twice == {}, f"{len(twice)} blocks announced twice in one medium"
            eventually(
                lambda: {b for b, medium in held_by_medium(tap.events()) if medium == "STORAGE"} >= blocks,
                "every block of the first prompt is held in STORAGE (Redis keeps it)",
            )
    finally:
        server.stop()


def test_a_disk_tier_score_loads_the_whole_l2_part_of_the_prefix_or_none_of_it(
    tmp_path: Path, executor_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What docs/routing.md ("Tier truth") tells routers to weigh: four prompts of four 8 MiB chunks
    through a 64 MiB L1. The first prompt, mostly only in the filesystem L2 now, scores its whole
    prefix in Dynamo's disk column; asked again, LMCache reserves L1 for its chunks in L2 in one
    allocation: the hit is the whole prefix if L1 had room for all of them at that moment (its
    eviction thread may have made room meanwhile), else only what L1 held (the cpu score), the
    server logging the failed reservation; never a part of the L2 chunks."""
    l2 = tmp_path / "l2"
    l2.mkdir()
    server, events = sidecar_server(tmp_path, "a", {contract.ENV_L2_FS_PATH: str(l2), contract.ENV_L2_FS_SIZE: "1Gi"})
    dynamo = DynamoIndexer({1: events}, BLOCK, tmp_path / "indexer.log")
    monkeypatch.setenv(contract.ENV_KV_EVENTS, "true")
    with running(server, dynamo):
        engine = executor_factory("events-model", server.url, num_blocks=40, **GEOMETRY)
        first, _ = run_prompt(engine, 1)
        for seed in (3, 5, 7):
            run_prompt(engine, seed)

        def in_l1() -> int:
            return dynamo.tier_matches(first, "cpu").get(1, 0)

        eventually(lambda: in_l1() < CACHED and dynamo.tier_matches(first, "disk") == {1: CACHED},
                   "the first prompt scores whole in the disk tier, not in cpu")  # fmt: skip
        held_in_l1 = in_l1()
        _, again = run_prompt(engine, 1)
        assert held_in_l1 < CACHED
        assert again.connector_matched_tokens in (held_in_l1, CACHED), "all of the L2 part of the prefix or none"
        if again.connector_matched_tokens == held_in_l1:  # L1 had no room for the L2 part at once
            assert "L1 reservations failed with out-of-memory" in server.log_path.read_text(errors="replace")
