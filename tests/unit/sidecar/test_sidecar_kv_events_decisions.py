"""Which chunks the cache announces to routers, and the events that say so (pure)."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import chunk_report
from kvoffload.lmcache_guard.cache_key_events import CacheKeysChanged
from kvoffload.sidecar.kv_event_wire import Event, Tier, wire_event
from kvoffload.sidecar.kv_events import NEAREST_FIRST, ChunkTracker, StoredChunk, batches, block_ids, l2_tier

pytestmark = pytest.mark.sidecar

MODEL = "m~kvoffload-blocks-v1~float16-t16-b4096"
TPB = 16


def positional(events: list[Event]) -> list[list[object]]:
    """The events as vLLM <= 0.23's arrays (media CPU, DISK, EXTERNAL), the form these tests read."""
    return [wire_event(e, "vllm-positional") for e in events]


def chunks(*hashes: bytes, size: int = 64) -> list[StoredChunk]:
    return [StoredChunk(h, list(range(i * size, (i + 1) * size)), i) for i, h in enumerate(hashes)]


def test_a_stored_chunk_is_announced_as_its_engine_blocks_chained_to_the_chunk_before() -> None:
    tracker = ChunkTracker()
    events = positional(tracker.stored(MODEL, chunks(b"a", b"b"), None, TPB, ""))
    assert [e[0] for e in events] == ["BlockStored", "BlockStored"]
    first, second = events
    assert first[1] == list(block_ids(MODEL, b"a", 4)) and first[2] is None
    assert second[2] == first[1][-1]  # the parent link crosses the chunk boundary
    assert first[3] == list(range(64)) and first[4] == TPB and first[6] == "CPU"
    assert all(0 <= i < 2**63 for e in events for i in e[1])


def test_a_salted_store_is_never_announced_nor_its_eviction() -> None:
    tracker = ChunkTracker()
    assert positional(tracker.stored(MODEL, chunks(b"a"), None, TPB, "stenant")) == []
    assert positional(tracker.evicted([(MODEL, b"a", "stenant")])) == []
    assert len(tracker) == 0


def test_an_eviction_removes_exactly_the_blocks_announced_for_that_chunk() -> None:
    tracker = ChunkTracker()
    tracker.stored(MODEL, chunks(b"a", b"b"), None, TPB, "")
    assert positional(tracker.evicted([(MODEL, b"b", ""), (MODEL, b"unknown", ""), ("other-model", b"a", "")])) == [
        ["BlockRemoved", list(block_ids(MODEL, b"b", 4)), "CPU"]
    ]


def test_a_chunk_l1_evicts_while_l2_keeps_it_stays_announced_in_l2_only() -> None:
    tracker = ChunkTracker()
    tracker.stored(MODEL, chunks(b"a"), None, TPB, "")
    ids = list(block_ids(MODEL, b"a", 4))
    (disk,) = positional(tracker.l2_stored([(MODEL, b"a", "")], Tier.L2_LOCAL))
    assert disk[:2] == ["BlockStored", ids] and disk[3] == list(range(64)) and disk[6] == "DISK"
    assert (
        positional(tracker.l2_stored([(MODEL, b"a", "")], Tier.L2_LOCAL)) == []
    )  # LMCache reports a key once per KV rank
    assert positional(tracker.evicted([(MODEL, b"a", "")])) == [["BlockRemoved", ids, "CPU"]]
    assert [e[6] for e in positional(tracker.snapshot())[1:]] == ["DISK"] and len(tracker) == 1
    assert (
        positional(tracker.stored(MODEL, chunks(b"a"), None, TPB, ""))[0][6] == "CPU"
    )  # back in L1: announced there again
    tracker.evicted([(MODEL, b"a", "")])
    assert positional(tracker.evicted([(MODEL, b"a", "")], Tier.L2_LOCAL)) == [["BlockRemoved", ids, "DISK"]]
    assert len(tracker) == 0


def test_an_l2_store_before_the_report_is_announced_with_the_report_and_a_salted_one_never() -> None:
    tracker = ChunkTracker()
    assert positional(tracker.l2_stored([(MODEL, b"a", ""), (MODEL, b"s", "stenant")], Tier.L2_SHARED)) == []
    events = positional(tracker.stored(MODEL, chunks(b"a"), None, TPB, ""))
    assert sorted(e[6] for e in events) == ["CPU", "EXTERNAL"]
    assert positional(tracker.stored(MODEL, chunks(b"s"), None, TPB, "stenant")) == []


def test_past_capacity_a_chunk_is_announced_removed_from_every_tier_holding_it() -> None:
    tracker = ChunkTracker(capacity=1)
    tracker.stored(MODEL, chunks(b"a"), None, TPB, "")
    tracker.l2_stored([(MODEL, b"a", "")], Tier.L2_LOCAL)
    removed = [e for e in positional(tracker.stored(MODEL, chunks(b"b"), None, TPB, "")) if e[0] == "BlockRemoved"]
    assert sorted(e[2] for e in removed) == ["CPU", "DISK"]


def test_a_redis_or_shared_l2_is_the_shared_tier_and_a_filesystem_l2_the_local_one() -> None:
    assert (l2_tier("resp", False), l2_tier("fs_native", True), l2_tier("fs_native", False)) == (
        Tier.L2_SHARED, Tier.L2_SHARED, Tier.L2_LOCAL)  # fmt: skip


def test_a_chunk_already_announced_is_not_announced_again() -> None:
    tracker = ChunkTracker()
    tracker.stored(MODEL, chunks(b"a"), None, TPB, "")
    assert positional(tracker.stored(MODEL, chunks(b"a"), None, TPB, "")) == []


def test_past_capacity_the_least_recently_stored_chunk_is_announced_removed() -> None:
    tracker = ChunkTracker(capacity=2)
    tracker.stored(MODEL, chunks(b"a"), None, TPB, "")
    tracker.stored(MODEL, chunks(b"b"), None, TPB, "")
    tracker.stored(MODEL, chunks(b"a"), None, TPB, "")  # a is used again: b is now the oldest
    events = positional(tracker.stored(MODEL, chunks(b"c"), None, TPB, ""))
    assert events[-1] == ["BlockRemoved", list(block_ids(MODEL, b"b", 4)), "CPU"]
    assert len(tracker) == 2


def test_a_snapshot_clears_then_restores_every_chunk_parents_first() -> None:
    tracker = ChunkTracker()
    tracker.stored(MODEL, chunks(b"a", b"b"), None, TPB, "")
    tracker.stored(MODEL, chunks(b"a"), None, TPB, "")  # the parent moves behind its child in LRU order
    snapshot = positional(tracker.snapshot())
    assert snapshot[0] == ["AllBlocksCleared"]
    assert [e[1][0] for e in snapshot[1:]] == [block_ids(MODEL, b"a", 1)[0], block_ids(MODEL, b"b", 1)[0]]
    assert positional(tracker.clear())[-1] == ["AllBlocksCleared"]
    assert positional(tracker.snapshot()) == [["AllBlocksCleared"]]


@given(st.integers(0, 1000), st.integers(1, 300))
def test_batches_keep_every_event_in_order(count: int, per_batch: int) -> None:
    events = [["BlockRemoved", [i], "CPU"] for i in range(count)]
    cut = batches(events, per_batch)
    assert [e for b in cut for e in b] == events and all(0 < len(b) <= per_batch for b in cut)


def test_a_report_round_trips_and_a_malformed_one_is_refused_naming_the_field() -> None:
    report = chunk_report.ChunksStored("m", MODEL, 2, tuple(range(200)), 64, 128, TPB, "")
    decoded = chunk_report.decode(chunk_report.encode(report))
    assert decoded == chunk_report.ChunksStored("m", MODEL, 2, tuple(range(128)), 64, 128, TPB, "")
    two_tokens = b"\x01\x00\x00\x00\x02\x00\x00\x00"
    with pytest.raises(chunk_report.ReportError, match="start"):
        chunk_report.decode(b'["m","c",1,1,0,16,""]\n' + two_tokens)
    with pytest.raises(chunk_report.ReportError, match="JSON"):
        chunk_report.decode(b"\xff\n")
    with pytest.raises(chunk_report.ReportError, match="uint32"):
        chunk_report.decode(b'["m","c",1,0,1,16,""]\n\x01\x00')
    with pytest.raises(chunk_report.ReportError, match="integers"):
        chunk_report.decode(b'["m","c",true,0,1,16,""]\n' + two_tokens)
    with pytest.raises(chunk_report.ReportError, match="more than"):
        chunk_report.decode(b'["m","c",1,0,1,16,""]\n' + bytes(4 * (chunk_report.MAX_TOKENS + 1)))
    with pytest.raises(OverflowError):
        chunk_report.encode(chunk_report.ChunksStored("m", MODEL, 1, (-1,), 0, 1, TPB, ""))


def test_an_lmcache_other_than_the_one_written_for_is_refused_naming_both_and_who_refuses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The KV-event module refuses, at build, an LMCache its server internals were not checked against."""
    from kvoffload import lmcache_guard
    from kvoffload.sidecar.kv_events_module import build_server_modules

    monkeypatch.setattr(lmcache_guard.importlib.metadata, "version", lambda _name: "0.6.0")
    with pytest.raises(
        lmcache_guard.LMCacheVersionError, match=r"0\.6\.0 is installed; kvoffload's KV-event module.*0\.5\.6"
    ):
        build_server_modules(object())


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300), st.data())
def test_every_report_of_uint32_tokens_round_trips(tokens: list[int], data: st.DataObject) -> None:
    end = data.draw(st.integers(1, len(tokens)))
    start = data.draw(st.integers(0, end - 1))
    report = chunk_report.ChunksStored("m", MODEL, 1, tuple(tokens), start, end, TPB, "")
    assert chunk_report.decode(chunk_report.encode(report)) == chunk_report.ChunksStored(
        "m", MODEL, 1, tuple(tokens[:end]), start, end, TPB, ""
    )


class FakeServerContext:
    """The parts of LMCache's MPCacheServerContext the module uses: chunk size, key resolution, sessions."""

    chunk_size = 64

    def __init__(self) -> None:
        self.resolved: list[tuple[int, int]] = []
        self.salts: list[str] = []
        self.removed: list[str] = []
        self.session_manager = self

    def resolve_obj_keys(self, key: object, groups: list[int]) -> list[list[object]]:
        from types import SimpleNamespace

        start, end = key.start, key.end  # type: ignore[attr-defined]
        self.resolved.append((start, end))
        self.salts.append(key.cache_salt)  # type: ignore[attr-defined]
        chunks = range(start // self.chunk_size, end // self.chunk_size)
        # two KV ranks per chunk, as LMCache returns them for world size 2
        return [[SimpleNamespace(chunk_hash=f"h{i}".encode()) for i in chunks for _rank in range(2)]]

    def remove(self, session: str) -> None:
        self.removed.append(session)


class CapturingPublisher:
    def __init__(self) -> None:
        self.tracker = ChunkTracker()
        self.events: list[list[object]] = []
        self.counts: dict[str, int] = {}

    def submit(self, change: object) -> None:
        self.events += positional(change(self.tracker))  # type: ignore[operator]


def test_the_server_module_announces_the_reported_chunks_chained_to_the_one_before_and_never_a_salted_report() -> None:
    from kvoffload.sidecar.kv_events_module import KvEventsModule

    ctx, publisher = FakeServerContext(), CapturingPublisher()
    module = KvEventsModule(ctx, publisher)  # type: ignore[arg-type]
    tokens = tuple(range(200))
    salted = chunk_report.ChunksStored("m", MODEL, 2, tokens, 0, 128, TPB, "stenant")
    assert module.chunks_stored(chunk_report.encode(salted)) == b"salted"
    assert publisher.events == [] and ctx.resolved == []

    report = chunk_report.ChunksStored("m", MODEL, 2, tokens, 64, 192, TPB, "")
    assert module.chunks_stored(chunk_report.encode(report)) == b"ok"
    assert ctx.resolved == [(0, 192)] and len(ctx.removed) == 1  # hashed from the first chunk, session dropped
    assert [e[1] for e in publisher.events] == [list(block_ids(MODEL, b"h1", 4)), list(block_ids(MODEL, b"h2", 4))]
    assert publisher.events[0][2] == block_ids(MODEL, b"h0", 4)[-1]
    assert publisher.events[0][3] == list(range(64, 128))

    module.on_keys_changed(CacheKeysChanged("l1", False, ((MODEL, b"h2", ""),)))
    assert publisher.events[-1] == ["BlockRemoved", list(block_ids(MODEL, b"h2", 4)), "CPU"]
    module.on_keys_changed(CacheKeysChanged("l2", True, ((MODEL, b"h1", ""),), "resp"))
    assert publisher.events[-1][0] == "BlockStored" and publisher.events[-1][6] == "EXTERNAL"


# The wire format (issue 45 item 1), clears (item 2) and the journal a restart reads (items 2, 3).


def stored_and_removed() -> list[Event]:
    """Chunk ``a`` stored in each tier, withdrawn from the shared one, then from the others by a clear."""
    from kvoffload.sidecar.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored

    ids = block_ids(MODEL, b"a", 4)
    stored: list[Event] = [BlockStored(ids, None, list(range(64)), TPB, tier) for tier in NEAREST_FIRST]
    removed: list[Event] = [BlockRemoved(ids, tier) for tier in (Tier.L2_SHARED, Tier.HOST, Tier.L2_LOCAL)]
    return [*stored, *removed, AllBlocksCleared()]


def test_the_default_format_is_what_vllm_0_34s_own_classes_decode_with_vllms_media_names() -> None:
    from kvoffload.sidecar.kv_event_wire import encode_batch
    from tests.support import vllm_events as vllm

    batch = vllm.DECODER.decode(encode_batch(1.0, stored_and_removed(), "vllm"))
    ids = list(block_ids(MODEL, b"a", 4))
    assert [type(e).__name__ for e in batch.events] == ["BlockStored"] * 3 + ["BlockRemoved"] * 3 + ["AllBlocksCleared"]
    host = batch.events[0]
    assert isinstance(host, vllm.BlockStored) and (host.block_hashes, host.token_ids, host.block_size) == (
        ids, list(range(64)), TPB)  # fmt: skip
    assert [(e.medium, e.locality) for e in batch.events[:3]] == [  # type: ignore[union-attr]
        ("CPU", None), ("STORAGE", "LOCAL"), ("STORAGE", "REMOTE")]  # fmt: skip
    assert [(e.medium, e.locality) for e in batch.events[3:6]] == [  # type: ignore[union-attr]
        ("STORAGE", "REMOTE"), ("CPU", None), ("STORAGE", "LOCAL")]  # fmt: skip
    assert batch.data_parallel_rank is None  # no rank: the consumer's wiring gives it


def test_the_positional_format_is_vllm_0_23s_arrays_with_the_media_dynamo_names() -> None:
    from kvoffload.sidecar.kv_event_wire import encode_batch

    _ts, events, rank = msgspec.msgpack.decode(encode_batch(1.0, stored_and_removed(), "vllm-positional"))
    assert [e[6] for e in events[:3]] == ["CPU", "DISK", "EXTERNAL"] and events[-1] == ["AllBlocksCleared"]
    assert [e[2] for e in events[3:6]] == ["EXTERNAL", "CPU", "DISK"] and rank is None


def test_a_clear_withdraws_every_block_in_each_tier_holding_it_before_the_bare_clear() -> None:
    tracker = ChunkTracker()
    tracker.stored(MODEL, chunks(b"a", b"b"), None, TPB, "")
    tracker.l2_stored([(MODEL, b"b", "")], Tier.L2_LOCAL)
    a, b = list(block_ids(MODEL, b"a", 4)), list(block_ids(MODEL, b"b", 4))
    assert positional(tracker.clear()) == [
        ["BlockRemoved", a, "CPU"], ["BlockRemoved", b, "CPU"], ["BlockRemoved", b, "DISK"], ["AllBlocksCleared"]]  # fmt: skip
    assert len(tracker) == 0


def test_a_format_the_policy_does_not_list_is_refused_naming_the_setting_and_the_choices() -> None:
    from kvoffload import contract, policy_values
    from kvoffload.sidecar.kv_event_wire import FORMATS
    from kvoffload.sidecar.kv_events_module import KvEventsUnavailable, wire_format
    from kvoffload.sidecar.settings import SettingsError, load_settings

    assert FORMATS == policy_values.KV_EVENTS_FORMATS  # the sidecar reads what the policy sets
    env = {contract.ENV_KV_EVENTS_PORT: "5570"}
    assert load_settings(env, None).kv_events_format == "vllm"
    assert load_settings({**env, contract.ENV_KV_EVENTS_FORMAT: "vllm-positional"}, None).kv_events_format == (
        "vllm-positional")  # fmt: skip
    with pytest.raises(SettingsError, match=r"KVOFFLOAD_KV_EVENTS_FORMAT: 'vllm-0.23' .*vllm, vllm-positional"):
        load_settings({**env, contract.ENV_KV_EVENTS_FORMAT: "vllm-0.23"}, None)
    with pytest.raises(KvEventsUnavailable, match=r"format 'maps' is not allowed; use one of vllm, vllm-positional"):
        wire_format("maps")


def test_a_journal_folds_to_what_is_still_announced_per_tier_and_the_last_sequence_number() -> None:
    from kvoffload.sidecar.kv_event_wire import BlockRemoved, BlockStored, fold_journal, journal_record, withdrawals

    data = journal_record(
        7, [BlockStored([1, 2], None, [], TPB, Tier.HOST), BlockStored([3], 2, [], TPB, Tier.L2_LOCAL)]
    )
    data += journal_record(8, [BlockRemoved([1], Tier.HOST), BlockStored([4], None, [], TPB, Tier.L2_SHARED)])
    state = fold_journal(data + data[:5])  # a torn tail (a crash mid-write) ends the journal
    assert state.last_sequence == 8
    assert {tier: list(ids) for tier, ids in state.announced.items()} == {
        Tier.HOST: [2], Tier.L2_LOCAL: [3], Tier.L2_SHARED: [4]}  # fmt: skip
    assert positional(withdrawals(state)) == [
        ["BlockRemoved", [2], "CPU"], ["BlockRemoved", [3], "DISK"], ["BlockRemoved", [4], "EXTERNAL"], ["AllBlocksCleared"]]  # fmt: skip
    assert fold_journal(data + journal_record(9, stored_and_removed()[-1:])).announced[Tier.HOST] == {}
    assert fold_journal(b"").last_sequence == -1


@given(st.lists(st.tuples(st.booleans(), st.sampled_from(list(Tier)), st.lists(st.integers(0, 50), max_size=4))))
def test_a_compacted_journal_folds_to_the_state_it_was_written_from(
    changes: list[tuple[bool, Tier, list[int]]],
) -> None:
    from kvoffload.sidecar.kv_event_wire import (
        BlockRemoved,
        BlockStored,
        compacted_journal,
        fold_journal,
        journal_record,
    )

    events: list[Event] = [BlockStored(ids, None, [], TPB, t) if s else BlockRemoved(ids, t) for s, t, ids in changes]
    state = fold_journal(b"".join(journal_record(i, [e]) for i, e in enumerate(events)))
    again = fold_journal(compacted_journal(state))
    assert {t: set(ids) for t, ids in again.announced.items()} == {t: set(ids) for t, ids in state.announced.items()}
    assert again.last_sequence == state.last_sequence


# Tenants (issue 45 item 4): LoRA-scoped chunks announced under their adapter, other salted ones never.

ADAPTER_A = chunk_report.LoraScope(7, "adapter-a")


def test_a_lora_scoped_store_is_announced_under_its_adapter_apart_from_the_unsalted_copy_of_its_tokens() -> None:
    tracker = ChunkTracker()
    (scoped,) = positional(tracker.stored(MODEL, chunks(b"a"), None, TPB, "kA", ADAPTER_A))
    ids = list(block_ids(MODEL, b"a", 4, "kA"))
    assert scoped[:2] == ["BlockStored", ids] and (scoped[5], scoped[7]) == (7, "adapter-a")
    assert set(ids).isdisjoint(block_ids(MODEL, b"a", 4))  # LMCache's hash of the tokens is the same
    (plain,) = positional(tracker.stored(MODEL, chunks(b"a"), None, TPB, ""))
    assert plain[1] == list(block_ids(MODEL, b"a", 4)) and (plain[5], plain[7]) == (None, None)
    assert positional(tracker.evicted([(MODEL, b"a", "")])) == [["BlockRemoved", plain[1], "CPU"]]
    assert positional(tracker.evicted([(MODEL, b"a", "kA")])) == [["BlockRemoved", ids, "CPU"]]
    assert len(tracker) == 0


def test_a_lora_scoped_chunks_children_chain_under_its_salt_and_its_l2_copy_keeps_the_scope() -> None:
    tracker = ChunkTracker()
    assert tracker.l2_stored([(MODEL, b"b", "kA"), (MODEL, b"t", "stenant")], Tier.L2_LOCAL) == []
    tracker.stored(MODEL, chunks(b"a"), None, TPB, "kA", ADAPTER_A)
    # once an adapter's report named its salt, an L2 store under it before its own report waits for it
    assert tracker.l2_stored([(MODEL, b"b", "kA"), (MODEL, b"t", "stenant")], Tier.L2_LOCAL) == []
    events = positional(tracker.stored(MODEL, chunks(b"b"), b"a", TPB, "kA", ADAPTER_A))
    assert [(e[6], e[5], e[7]) for e in events] == [("CPU", 7, "adapter-a"), ("DISK", 7, "adapter-a")]
    assert events[0][2] == block_ids(MODEL, b"a", 4, "kA")[-1]
    assert [e[5] for e in positional(tracker.snapshot())[1:]] == [7, 7, 7]
    assert positional(tracker.stored(MODEL, chunks(b"t"), None, TPB, "stenant")) == []  # a tenant's: never


def test_the_default_format_carries_the_adapter_as_vllm_0_34s_lora_id_and_lora_name() -> None:
    from kvoffload.sidecar.kv_event_wire import encode_batch
    from tests.support import vllm_events as vllm

    tracker = ChunkTracker()
    events = tracker.stored(MODEL, chunks(b"a"), None, TPB, "kA", ADAPTER_A) + tracker.stored(
        MODEL, chunks(b"a"), None, TPB, ""
    )
    scoped, plain = vllm.DECODER.decode(encode_batch(1.0, events, "vllm")).events
    assert isinstance(scoped, vllm.BlockStored) and (scoped.lora_id, scoped.lora_name) == (7, "adapter-a")
    assert isinstance(plain, vllm.BlockStored) and (plain.lora_id, plain.lora_name) == (None, None)


def test_a_lora_scoped_report_round_trips_and_a_bad_scope_is_refused_naming_the_fields() -> None:
    report = chunk_report.ChunksStored("m", MODEL, 1, tuple(range(64)), 0, 64, TPB, "kA", ADAPTER_A)
    assert chunk_report.decode(chunk_report.encode(report)) == report
    head = chunk_report.encode(report).partition(b"\n")[0]
    assert head.endswith(b',7,"adapter-a"]')
    tokens = b"\x01\x00\x00\x00"
    for bad in (b'["m","c",1,0,1,16,"kA",7,""]', b'["m","c",1,0,1,16,"kA","7","a"]', b'["m","c",1,0,1,16,"kA",7]'):
        with pytest.raises(chunk_report.ReportError, match=r"lora_id|fields"):
            chunk_report.decode(bad + b"\n" + tokens)


def test_the_server_module_announces_a_lora_scoped_report_under_its_adapter_hashed_under_its_salt() -> None:
    from kvoffload.sidecar.kv_events_module import KvEventsModule

    ctx, publisher = FakeServerContext(), CapturingPublisher()
    module = KvEventsModule(ctx, publisher)  # type: ignore[arg-type]
    report = chunk_report.ChunksStored("m", MODEL, 2, tuple(range(128)), 0, 128, TPB, "kA", ADAPTER_A)
    assert module.chunks_stored(chunk_report.encode(report)) == b"ok"
    assert ctx.salts == ["kA"]
    assert [(e[1], e[5], e[7]) for e in publisher.events] == [
        (list(block_ids(MODEL, b"h0", 4, "kA")), 7, "adapter-a"),
        (list(block_ids(MODEL, b"h1", 4, "kA")), 7, "adapter-a"),
    ]
    module.on_keys_changed(CacheKeysChanged("l1", False, ((MODEL, b"h1", "kA"),)))
    assert publisher.events[-1] == ["BlockRemoved", list(block_ids(MODEL, b"h1", 4, "kA")), "CPU"]
