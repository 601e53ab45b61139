"""KV events from the cache tier, read by real KV-aware routers (Dynamo's indexer, llm-d's index).

LMCache servers started from the sidecar's own command line (``KVOFFLOAD_KV_EVENTS_PORT`` set, so
with kvoffload's KV-event module), stand-in engines with ``KVOFFLOAD_KV_EVENTS`` on, and
``dynamo.indexer`` or llm-d's index (``hack/llmd-index``) subscribed to the servers' event ports.
Nothing is skipped: without the routers (``hack/setup.sh python`` installs both) the tests fail.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hack.polling import WaitTimedOut, wait_until
from hack.ports import free_port
from kvoffload import contract
from tests.support.kv_router import DynamoIndexer, LlmdIndex
from tests.support.lmcache_server import LMCacheServer, sidecar_events_server
from tests.support.trtllm_executor import BLOCK, CHUNK, PromptRequest, make_prompt, settle_commits

pytestmark = pytest.mark.connector

GEOMETRY = {"num_layers": 4, "num_kv_heads": 4, "head_dim": 2048}
"""Blocks of 2 MiB (fp16), chunks of 8 MiB: the sidecar's smallest L1 (64 MiB) holds about 7 chunks."""
PROMPT = 4 * CHUNK + 10
"""Four whole chunks and a tail that stays on the device."""
CACHED = 4 * CHUNK


def sidecar_server(tmp_path: Path, name: str, extra_env: dict[str, str] | None = None) -> tuple[LMCacheServer, str]:
    """An LMCache server on the sidecar's command line with KV events on; and its event endpoint."""
    events_port = free_port()
    server = sidecar_events_server(
        tmp_path / f"lmcache-{name}",
        CHUNK,
        contract.MIN_L1_SIZE,
        events_port,
        f"events-{name}-{free_port()}",
        {contract.ENV_PROMETHEUS_MULTIPROC_DIR: str(tmp_path / f"metrics-{name}"), **(extra_env or {})},
    )
    return server, f"tcp://127.0.0.1:{events_port}"


@contextlib.contextmanager
def running(*parts: Any) -> Iterator[None]:
    """Start ``parts`` in order (servers before the routers that subscribe to them); on the way out,
    stop the ones that started, in reverse order."""
    started: list[Any] = []
    try:
        for part in parts:
            part.start()
            started.append(part)
        yield
    finally:
        for part in reversed(started):
            part.stop()


@pytest.fixture
def two_servers(tmp_path: Path) -> Iterator[tuple[LMCacheServer, LMCacheServer, DynamoIndexer]]:
    server_a, events_a = sidecar_server(tmp_path, "a")
    server_b, events_b = sidecar_server(tmp_path, "b")
    indexer = DynamoIndexer({1: events_a, 2: events_b}, BLOCK, tmp_path / "indexer.log")
    with running(server_a, server_b, indexer):
        yield server_a, server_b, indexer


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll ``check`` until it holds (``hack.polling``), naming ``what`` on timeout."""
    wait_until(check, timeout_s, f"until {what}", interval=0.2)


def llmd_topics() -> dict[str, dict[str, str]]:
    """Pods a and b's KV-event env for llm-d's index: its topic names the pod and the model, and it
    reads the positional format."""
    return {
        name: {
            contract.ENV_KV_EVENTS_TOPIC: f"kv@pod-{name}@events-model",
            contract.ENV_KV_EVENTS_FORMAT: "vllm-positional",
        }
        for name in ("a", "b")
    }


def test_router_ranks_the_replica_whose_cache_holds_a_prefix_and_follows_evictions_restarts_and_tenants(
    two_servers: tuple[LMCacheServer, LMCacheServer, DynamoIndexer],
    executor_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stores a prompt: the indexer ranks A (host tier, the cached chunks) and not B; B's own prompt
    ranks B. A's L1 (64 MiB) overflowing evicts the first prompt: A's score for it drops. A salted
    tenant's prompt is never announced. A's server killed and restarted: A's state is cleared, B's stays."""
    server_a, server_b, indexer = two_servers
    monkeypatch.setenv(contract.ENV_KV_EVENTS, "true")
    engine_a = executor_factory("events-model", server_a.url, num_blocks=40, **GEOMETRY)
    engine_b = executor_factory("events-model", server_b.url, num_blocks=40, **GEOMETRY)

    def run(engine: Any, seed: int, salt: str = "", prompt: list[int] | None = None) -> list[int]:
        prompt = prompt or make_prompt(seed, PROMPT)
        (result,) = engine.run([PromptRequest(seed, prompt, 2, cache_salt=salt or None)])
        assert not result.failed, result.error
        assert settle_commits()
        engine.evict_device_cache()
        return prompt

    first = run(engine_a, 1)
    eventually(lambda: indexer.host_tier_matches(first) == {1: CACHED}, "A holds the first prompt's chunks")
    other = run(engine_b, 2)
    eventually(lambda: indexer.host_tier_matches(other) == {2: CACHED}, "B holds its own prompt")
    assert indexer.host_tier_matches(first) == {1: CACHED}

    # Another prompt on A fills its 64 MiB L1 (8 chunks of 8 MiB); LMCache's eviction controller
    # brings it under its 80 % watermark by dropping the least recently used: the first prompt's.
    run(engine_a, 3)
    eventually(lambda: indexer.host_tier_matches(first).get(1, 0) < CACHED, "A's score for the evicted prompt drops")

    tenant = run(engine_a, 5, salt="tenant-x")
    # Reported after the tenant's store, by the same committer. A store that finds L1 full before the
    # eviction controller's next pass is refused for the chunks that did not fit: run it again then.
    marker = make_prompt(6, PROMPT)
    for attempt in range(4):
        run(engine_a, 6 + 100 * attempt, prompt=marker)
        with contextlib.suppress(WaitTimedOut):
            eventually(lambda: indexer.host_tier_matches(marker) == {1: CACHED}, "A announced the marker", 5.0)
            break
    assert indexer.host_tier_matches(marker) == {1: CACHED}
    assert indexer.host_tier_matches(tenant) == {}

    server_a.kill()
    server_a.start()
    eventually(lambda: 1 not in indexer.host_tier_matches(marker), "A's restarted, empty server cleared A")
    assert indexer.host_tier_matches(other) == {2: CACHED}


def test_a_prefix_that_leaves_a_chunk_midway_is_over_scored_by_its_blocks_in_that_chunk_only(
    two_servers: tuple[LMCacheServer, LMCacheServer, DynamoIndexer],
    executor_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Routers score by engine block; the cache serves whole chunks. A prompt that shares two chunks
    and three blocks of the third with a cached one is scored two chunks and three blocks, and loads
    two chunks: the router's excess is the blocks inside the chunk it leaves, never more than a chunk
    less a block (docs/routing.md, "Granularity")."""
    server_a, _, indexer = two_servers
    monkeypatch.setenv(contract.ENV_KV_EVENTS, "true")
    engine = executor_factory("events-model", server_a.url, num_blocks=40, **GEOMETRY)
    cached = make_prompt(1, PROMPT)
    (stored,) = engine.run([PromptRequest(1, cached, 2)])
    assert not stored.failed, stored.error
    assert settle_commits()
    engine.evict_device_cache()
    eventually(lambda: indexer.host_tier_matches(cached) == {1: CACHED}, "A holds the cached prompt")

    inside = 3 * BLOCK
    query = cached[: 2 * CHUNK + inside] + make_prompt(2, CHUNK + 10)
    scored = indexer.host_tier_matches(query)[1]
    (hit,) = engine.run([PromptRequest(2, query, 2)])
    assert not hit.failed, hit.error
    assert hit.connector_matched_tokens == 2 * CHUNK
    assert scored - hit.connector_matched_tokens == inside <= CHUNK - BLOCK
    assert engine.kv_mismatches == 0


def test_router_sees_a_prefix_in_the_disk_tier_after_l1_evicts_it_while_the_filesystem_l2_keeps_it(
    tmp_path: Path, executor_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a filesystem L2, a stored prompt is announced in both tiers (medium CPU and DISK); when
    A's 64 MiB L1 evicts it, the indexer's host-tier score drops and its disk-tier score (host or
    disk: the indexer's columns are cumulative) stays whole."""
    l2 = tmp_path / "l2"
    l2.mkdir()
    server, events = sidecar_server(tmp_path, "l2", {contract.ENV_L2_FS_PATH: str(l2), contract.ENV_L2_FS_SIZE: "1Gi"})
    indexer = DynamoIndexer({1: events}, BLOCK, tmp_path / "indexer.log")
    monkeypatch.setenv(contract.ENV_KV_EVENTS, "true")
    server.start()
    try:
        indexer.start()
        engine = executor_factory("events-model", server.url, num_blocks=40, **GEOMETRY)

        def run(seed: int) -> list[int]:
            prompt = make_prompt(seed, PROMPT)
            (result,) = engine.run([PromptRequest(seed, prompt, 2)])
            assert not result.failed, result.error
            assert settle_commits()
            engine.evict_device_cache()
            return prompt

        first = run(1)
        eventually(lambda: indexer.tier_matches(first, "cpu") == {1: CACHED}, "A holds the prompt in L1")
        run(3)  # fills the 64 MiB L1: the first prompt's chunks are evicted from L1, not from L2
        eventually(lambda: indexer.tier_matches(first, "cpu").get(1, 0) < CACHED, "A's host-tier score drops")
        assert indexer.tier_matches(first, "disk") == {1: CACHED}
    finally:
        indexer.stop()
        server.stop()


def test_llm_ds_index_ranks_the_pod_that_stored_a_prefix_per_tier_never_a_tenants_and_forgets_a_restarted_one(
    tmp_path: Path, executor_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llm-d's kv-cache index (its event pool, vLLM adapter, per-pod subscribers, in-memory index)
    on two servers publishing with llm-d's topic ``kv@<pod>@<model>``; A with a filesystem L2. A's
    prompt ranks A in ``cpu`` and ``disk``, B's ranks B; A's L1 evicting its prompt drops A's
    ``cpu`` match and keeps its ``disk`` match; a salted tenant's prompt matches no pod. A's server
    killed and started again: llm-d 0.8.1 only logs ``AllBlocksCleared``, so A is forgotten in both
    tiers only because the new server withdraws, block by block, what its journal says A announced.
    llm-d 0.8.1 reads only positional arrays: the servers publish ``vllm-positional``."""
    l2 = tmp_path / "l2"
    l2.mkdir()
    topic = llmd_topics()
    server_a, events_a = sidecar_server(
        tmp_path, "a", {**topic["a"], contract.ENV_L2_FS_PATH: str(l2), contract.ENV_L2_FS_SIZE: "1Gi"}
    )
    server_b, events_b = sidecar_server(tmp_path, "b", topic["b"])
    index = LlmdIndex({"pod-a": events_a, "pod-b": events_b}, BLOCK, tmp_path / "llmd-index.log")
    monkeypatch.setenv(contract.ENV_KV_EVENTS, "true")
    with running(server_a, server_b, index):
        engine_a = executor_factory("events-model", server_a.url, num_blocks=40, **GEOMETRY)
        engine_b = executor_factory("events-model", server_b.url, num_blocks=40, **GEOMETRY)

        def run(engine: Any, seed: int, salt: str | None = None) -> list[int]:
            prompt = make_prompt(seed, PROMPT)
            (result,) = engine.run([PromptRequest(seed, prompt, 2, cache_salt=salt)])
            assert not result.failed, result.error
            assert settle_commits()
            engine.evict_device_cache()
            return prompt

        def held(tokens: list[int], tier: str) -> dict[str, int]:
            return index.tier_matches(tokens, tier, "events-model")

        # llm-d's subscriber retries its connection every 5 s: the first events may wait for it.
        first = run(engine_a, 1)
        eventually(lambda: held(first, "cpu") == {"pod-a": CACHED}, "llm-d ranks A for A's prompt", 60.0)
        eventually(lambda: held(first, "disk") == {"pod-a": CACHED}, "llm-d sees A's prompt in A's L2")
        other = run(engine_b, 2)
        eventually(lambda: held(other, "cpu") == {"pod-b": CACHED}, "llm-d ranks B for B's prompt", 60.0)
        third = run(engine_a, 3)  # fills A's 64 MiB L1: the first prompt leaves L1, not L2
        eventually(lambda: held(first, "cpu").get("pod-a", 0) < CACHED, "A's cpu match drops")
        assert held(first, "disk") == {"pod-a": CACHED}
        tenant = run(engine_a, 5, salt="tenant-x")
        marker = run(engine_b, 6)  # B reports after the tenant's store on A was reported
        eventually(lambda: held(marker, "cpu") == {"pod-b": CACHED}, "llm-d ranks B for the marker")
        assert held(tenant, "cpu") == {} and held(tenant, "disk") == {}

        assert held(third, "cpu").get("pod-a", 0) > 0 and held(first, "disk") == {"pod-a": CACHED}
        server_a.kill()
        server_a.start()
        eventually(lambda: held(third, "cpu") == {} and held(first, "disk") == {}, "llm-d forgot restarted A", 60.0)
        assert held(marker, "cpu") == {"pod-b": CACHED}


# Tenants (issue 45 item 4): a LoRA adapter's chunks are announced under the adapter and matched only
# for its requests; chunks no router can be asked about (multimodal, a tenant's salt) never.

SHORT = 2 * CHUNK + 10
"""Two whole chunks and a tail: a LoRA prompt, a multimodal one and a marker fit one 64 MiB L1 unevicted."""
SHORT_CACHED = 2 * CHUNK
IMAGE = [11, -12, 13, -14, 15, -16, 17, -18]
"""A multimodal item's content digest (8 int32, as TensorRT-LLM hashes images)."""


def adapter_checkpoint(root: Path, name: str) -> str:
    """A LoRA checkpoint directory named ``name``: the name routers know the adapter by."""
    directory = root / "adapters" / name
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(f'{{"r": 8, "name": "{name}"}}')
    (directory / "adapter_model.safetensors").write_bytes(name.encode() * 4096)
    return str(directory)


def tenants_run(engine: Any, request: PromptRequest) -> list[int]:
    (result,) = engine.run([request])
    assert not result.failed, result.error
    assert settle_commits()
    engine.evict_device_cache()
    return request.prompt


def test_dynamo_matches_a_lora_adapters_chunks_only_for_that_adapters_requests_and_never_a_multimodal_prompt(
    two_servers: tuple[LMCacheServer, LMCacheServer, DynamoIndexer],
    executor_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """One prompt, stored on A under adapter ``adapter-a`` and on B without an adapter. Dynamo 1.6.1
    ranks A for a request of ``adapter-a`` (the query's ``lora_name``), and only A; B for the unscoped
    request, and only B (A's copy is the adapter's: of no use to it); nobody for ``adapter-b``. A
    multimodal prompt on B (its keys carry the image's digest, which no router computes alike) is
    never announced: no unscoped match, once a later marker store on B was announced; nor is one under
    the adapter and a tenant's ``cache_salt``. A's L1 evicting the adapter's chunks withdraws them."""
    _server_a, _server_b, indexer = two_servers
    monkeypatch.setenv(contract.ENV_KV_EVENTS, "true")
    engine_a = executor_factory("events-model", _server_a.url, num_blocks=40, **GEOMETRY)
    engine_b = executor_factory("events-model", _server_b.url, num_blocks=40, **GEOMETRY)
    adapter = adapter_checkpoint(tmp_path, "adapter-a")
    prompt = make_prompt(21, SHORT)

    tenants_run(engine_a, PromptRequest(21, prompt, 2, lora_task_id=1, lora_path=adapter))
    eventually(
        lambda: indexer.host_tier_matches(prompt, "adapter-a") == {1: SHORT_CACHED},
        "Dynamo ranks A, which holds the adapter's chunks, for a request of that adapter",
    )
    tenants_run(engine_b, PromptRequest(22, prompt, 2))
    eventually(lambda: indexer.host_tier_matches(prompt) == {2: SHORT_CACHED}, "an unscoped request ranks B only")
    assert indexer.host_tier_matches(prompt, "adapter-a") == {1: SHORT_CACHED}
    assert indexer.host_tier_matches(prompt, "adapter-b") == {}

    image = make_prompt(23, SHORT)
    tenants_run(engine_b, PromptRequest(23, image, 2, multimodal_hashes=[IMAGE], multimodal_positions=[10],
                                        multimodal_lengths=[64]))  # fmt: skip
    salted = make_prompt(25, CHUNK + 10)  # the adapter and a tenant's salt: a scope no router is asked under
    tenants_run(engine_b, PromptRequest(25, salted, 2, cache_salt="tenant-x", lora_task_id=1, lora_path=adapter))
    marker = tenants_run(engine_b, PromptRequest(24, make_prompt(24, CHUNK + 10), 2))
    eventually(lambda: indexer.host_tier_matches(marker) == {2: CHUNK}, "B announced the marker after the image")
    assert indexer.host_tier_matches(image) == {} and indexer.host_tier_matches(image, "adapter-a") == {}
    assert indexer.host_tier_matches(salted) == {} and indexer.host_tier_matches(salted, "adapter-a") == {}

    # Two more prompts fill A's 64 MiB L1: LMCache evicts the adapter's chunks (under their salt) first.
    tenants_run(engine_a, PromptRequest(26, make_prompt(26, PROMPT), 2))
    tenants_run(engine_a, PromptRequest(27, make_prompt(27, PROMPT), 2))
    eventually(
        lambda: indexer.host_tier_matches(prompt, "adapter-a").get(1, 0) < SHORT_CACHED,
        "A's score for the adapter's evicted chunks drops",
    )


def test_llm_ds_index_matches_a_lora_adapters_chunks_only_under_the_adapters_name_and_never_a_multimodal_prompt(
    tmp_path: Path, executor_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with llm-d's index (0.8.1, ``vllm-positional``), which keys an event that names a LoRA
    adapter under the adapter's name instead of the topic's model: A's adapter chunks match a request
    for model ``adapter-a`` only; the unscoped request (model ``events-model``) matches B's copy only;
    ``adapter-b`` matches nothing; B's multimodal prompt is never announced."""
    topic = llmd_topics()
    server_a, events_a = sidecar_server(tmp_path, "a", topic["a"])
    server_b, events_b = sidecar_server(tmp_path, "b", topic["b"])
    index = LlmdIndex({"pod-a": events_a, "pod-b": events_b}, BLOCK, tmp_path / "llmd-index.log")
    monkeypatch.setenv(contract.ENV_KV_EVENTS, "true")
    with running(server_a, server_b, index):
        engine_a = executor_factory("events-model", server_a.url, num_blocks=40, **GEOMETRY)
        engine_b = executor_factory("events-model", server_b.url, num_blocks=40, **GEOMETRY)
        adapter = adapter_checkpoint(tmp_path, "adapter-a")
        prompt = make_prompt(31, SHORT)

        def held(tokens: list[int], model: str = "events-model") -> dict[str, int]:
            return index.tier_matches(tokens, "cpu", model)

        # llm-d's subscriber retries its connection every 5 s: the first events may wait for it.
        tenants_run(engine_b, PromptRequest(32, prompt, 2))
        eventually(lambda: held(prompt) == {"pod-b": SHORT_CACHED}, "an unscoped request ranks B", 60.0)
        tenants_run(engine_a, PromptRequest(31, prompt, 2, lora_task_id=1, lora_path=adapter))
        eventually(
            lambda: held(prompt, "adapter-a") == {"pod-a": SHORT_CACHED},
            "llm-d ranks A, which holds the adapter's chunks, for a request of that adapter",
            60.0,
        )
        assert held(prompt) == {"pod-b": SHORT_CACHED} and held(prompt, "adapter-b") == {}

        image = make_prompt(33, SHORT)
        tenants_run(engine_b, PromptRequest(33, image, 2, multimodal_hashes=[IMAGE], multimodal_positions=[10],
                                            multimodal_lengths=[64]))  # fmt: skip
        marker = tenants_run(engine_b, PromptRequest(34, make_prompt(34, CHUNK + 10), 2))
        eventually(lambda: held(marker) == {"pod-b": CHUNK}, "B announced the marker after the image")
        assert held(image) == {} and held(image, "adapter-a") == {}
