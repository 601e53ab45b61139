"""Tier truth of the KV events (issue 45 item 5): each chunk announced at most once per medium as
routers key it, and in L1 again when LMCache loads it back from L2 (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.lmcache_guard.cache_key_events import CacheKeysChanged
from kvoffload.sidecar.kv_event_wire import (
    FORMATS,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    Tier,
    WireFormat,
    medium,
    wire_event,
)
from kvoffload.sidecar.kv_events import NEAREST_FIRST, ChunkTracker, StoredChunk, announced_tiers, block_ids

pytestmark = pytest.mark.sidecar

MODEL = "m~kvoffload-blocks-v1~float16-t16-b4096"
TPB = 16


def chunk(name: bytes, depth: int = 0) -> list[StoredChunk]:
    return [StoredChunk(name, list(range(depth * 64, (depth + 1) * 64)), depth)]


def key(name: bytes) -> tuple[str, bytes, str]:
    return (MODEL, name, "")


def by_medium(events: Sequence[Event], wire: WireFormat) -> dict[tuple[int, str], int]:
    """What a router keying blocks by medium alone (llm-d's index: the medium lowercased, locality
    ignored) holds after ``events``: (block id, medium) -> how many stores it saw without a removal."""
    held: dict[tuple[int, str], int] = {}
    for event in events:
        if isinstance(event, AllBlocksCleared):
            held.clear()
            continue
        name = medium(event.tier, wire)[0]
        for block in event.ids:
            if isinstance(event, BlockStored):
                held[(block, name)] = held.get((block, name), 0) + 1
            else:
                held.pop((block, name), None)
    return held


def test_in_vllms_maps_a_chunk_both_l2s_hold_is_announced_in_storage_once_and_passes_to_redis_when_the_disk_drops_it() -> (
    None
):
    tracker = ChunkTracker(wire="vllm")
    tracker.stored(MODEL, chunk(b"a"), None, TPB, "")
    ids = block_ids(MODEL, b"a", 4)
    (local,) = tracker.l2_stored([key(b"a")], Tier.L2_LOCAL)
    assert isinstance(local, BlockStored) and local.tier is Tier.L2_LOCAL
    assert tracker.l2_stored([key(b"a")], Tier.L2_SHARED) == []  # STORAGE already announced
    assert tracker.evicted([key(b"a")], Tier.L2_LOCAL) == [
        BlockRemoved(ids, Tier.L2_LOCAL), BlockStored(ids, None, list(range(64)), TPB, Tier.L2_SHARED)]  # fmt: skip
    assert [e.tier for e in tracker.snapshot()[1:]] == [Tier.HOST, Tier.L2_SHARED]  # type: ignore[union-attr]
    assert tracker.evicted([key(b"a")], Tier.L2_SHARED) == [BlockRemoved(ids, Tier.L2_SHARED)]


def test_in_vllm_023s_arrays_a_chunk_both_l2s_hold_is_announced_as_disk_and_as_external() -> None:
    tracker = ChunkTracker(wire="vllm-positional")
    tracker.stored(MODEL, chunk(b"a"), None, TPB, "")
    assert len(tracker.l2_stored([key(b"a")], Tier.L2_LOCAL) + tracker.l2_stored([key(b"a")], Tier.L2_SHARED)) == 2
    assert tracker.evicted([key(b"a")], Tier.L2_LOCAL) == [BlockRemoved(block_ids(MODEL, b"a", 4), Tier.L2_LOCAL)]


def test_the_announced_tiers_are_per_medium_the_nearest_holding_the_chunk() -> None:
    assert announced_tiers({Tier.L2_SHARED, Tier.L2_LOCAL, Tier.HOST}, "vllm") == (Tier.HOST, Tier.L2_LOCAL)
    assert announced_tiers({Tier.L2_SHARED, Tier.L2_LOCAL}, "vllm-positional") == (Tier.L2_LOCAL, Tier.L2_SHARED)
    assert announced_tiers({Tier.L2_SHARED}, "vllm") == (Tier.L2_SHARED,)
    assert announced_tiers((), "vllm") == ()


CHUNKS = (b"a", b"b", b"c")
Step = tuple[str, int, Tier]


@given(
    st.sampled_from(FORMATS),
    st.lists(
        st.tuples(
            st.sampled_from(["stored", "l2_stored", "evicted", "loaded", "snapshot"]),
            st.integers(0, len(CHUNKS) - 1),
            st.sampled_from(NEAREST_FIRST),
        ),
        max_size=40,
    ),
)
def test_no_block_is_ever_announced_twice_in_one_medium_and_routers_end_holding_each_held_tier(
    wire: WireFormat, steps: list[Step]
) -> None:
    tracker = ChunkTracker(wire=wire)
    held: dict[bytes, set[Tier]] = {}
    reported: set[bytes] = set()
    events: list[Event] = []
    for action, index, tier in steps:
        name = CHUNKS[index]
        if action == "stored":
            events += tracker.stored(MODEL, chunk(name), None, TPB, "")
            held.setdefault(name, set()).add(Tier.HOST)
            reported.add(name)
        elif action == "l2_stored" and tier is not Tier.HOST:
            events += tracker.l2_stored([key(name)], tier)
            held.setdefault(name, set()).add(tier)
        elif action == "evicted":
            events += tracker.evicted([key(name)], tier)
            held.get(name, set()).discard(tier)
            if not held.get(name):
                reported.discard(name)  # forgotten with its tokens: an L2 store waits for the next report
        elif action == "loaded" and held.get(name):
            events += tracker.loaded([key(name)])
            held[name].add(Tier.HOST)
        elif action == "snapshot":
            events += tracker.snapshot()
        assert max(by_medium(events, wire).values(), default=1) == 1, "a block announced twice in one medium"
    routers = set(by_medium(events, wire))
    expected = {
        (block, medium(tier, wire)[0])
        for name in reported
        for tier in held.get(name, set())
        for block in block_ids(MODEL, name, 4)
    }
    assert routers == expected


def test_a_chunk_loaded_back_from_l2_into_l1_is_announced_in_l1_again_and_one_never_announced_is_not() -> None:
    tracker = ChunkTracker()
    tracker.stored(MODEL, chunk(b"a"), None, TPB, "")
    tracker.l2_stored([key(b"a")], Tier.L2_LOCAL)
    tracker.evicted([key(b"a")])
    assert tracker.loaded([key(b"a"), key(b"never-reported")]) == [
        BlockStored(block_ids(MODEL, b"a", 4), None, list(range(64)), TPB, Tier.HOST)]  # fmt: skip
    assert tracker.loaded([key(b"a")]) == []  # already announced there
    assert len(tracker) == 1


@pytest.mark.parametrize("l1_keeps_loads", [True, False])
def test_the_server_module_announces_a_load_from_l2_in_l1_only_where_the_server_keeps_loads_there(
    l1_keeps_loads: bool,
) -> None:
    from kvoffload.sidecar.kv_events_module import KvEventsModule

    tracker, events = ChunkTracker(wire="vllm-positional"), list[list[object]]()

    class Publisher:
        counts: dict[str, int] = {}

        def submit(self, change: object) -> None:
            events.extend(wire_event(e, "vllm-positional") for e in change(tracker))  # type: ignore[operator]

    module = KvEventsModule(object(), Publisher(), l1_keeps_loads)  # type: ignore[arg-type]
    tracker.stored(MODEL, chunk(b"a"), None, TPB, "")
    module.on_keys_changed(CacheKeysChanged("l2", True, (key(b"a"),), "fs_native"))
    module.on_keys_changed(CacheKeysChanged("l1", False, (key(b"a"),)))
    module.on_keys_changed(CacheKeysChanged("l1", True, (key(b"a"),)))
    kept = [("BlockStored", "CPU")] if l1_keeps_loads else []  # else LMCache drops the copy at once
    assert [(e[0], e[-2] if e[0] == "BlockStored" else e[2]) for e in events] == [
        ("BlockStored", "DISK"), ("BlockRemoved", "CPU"), *kept]  # fmt: skip


def test_with_an_l2_the_server_keeps_what_it_loads_from_l2_in_l1_and_the_event_module_is_told_so(
    tmp_path: object,
) -> None:
    import json

    from kvoffload import contract
    from kvoffload.sidecar.command import KV_EVENTS_MODULE, build_server_command
    from kvoffload.sidecar.settings import load_settings

    env = {contract.ENV_KV_EVENTS_PORT: "5570"}
    for l2, keeps in (({}, False), ({contract.ENV_L2_FS_PATH: "/l2"}, True)):
        argv = build_server_command(load_settings({**env, **l2}, None), {}, None).argv
        policy = [argv[i + 1] for i, a in enumerate(argv) if a == "--l2-prefetch-policy"]
        assert policy == (["retain"] if keeps else [])
        (module,) = [json.loads(argv[i + 1]) for i, a in enumerate(argv) if a == "--server-module"]
        assert module["module_path"] == KV_EVENTS_MODULE
        assert module["config"].get("l1_keeps_loads", False) is keeps
