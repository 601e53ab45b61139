"""Pure planning decisions: table tests and properties (hypothesis)."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.connector import planning
from kvoffload.connector.keys import chunk_ceil, chunk_floor

pytestmark = pytest.mark.connector


@st.composite
def geometry(draw: st.DrawFn) -> tuple[int, int]:
    block = draw(st.sampled_from([1, 4, 16, 32, 64]))
    return block, block * draw(st.integers(1, 8))


@pytest.mark.parametrize(
    ("prompt", "computed", "hit", "expected"),
    [
        (300, 0, 256, planning.LoadDecision(256, 0, 256, 0, ())),
        # Whole prompt cached: keep the last token to compute (promise stops at 224, chunk 0..256 fetched).
        (256, 0, 256, planning.LoadDecision(224, 0, 256, 0, ())),
        # Device already has 96 tokens: skip them inside the first chunk, never write shared blocks.
        (600, 96, 512, planning.LoadDecision(416, 0, 512, 96, ())),
        # Device has 288: retrieve starts at the chunk holding it; chunk 0 lock released.
        (600, 288, 512, planning.LoadDecision(224, 256, 512, 32, ((0, 256),))),
        # Hit not beyond the device: nothing to load, all locks released.
        (600, 256, 256, planning.LoadDecision(0, 0, 0, 0, ((0, 256),))),
        # Partial reuse: the device prefix ends inside block 0 (17 tokens, block 32); the load
        # rewrites that block (the request's own copy) from its first token, promising up to 512.
        (600, 17, 512, planning.LoadDecision(495, 0, 512, 0, ())),
        # ... inside block 9 (300 = 9*32 + 12): retrieve from the chunk holding block 9, skip 8 blocks.
        (600, 300, 512, planning.LoadDecision(212, 256, 512, 32, ((0, 256),))),
        (600, 0, 0, planning.NO_LOAD),
    ],
)
def test_decide_load_table(prompt: int, computed: int, hit: int, expected: planning.LoadDecision) -> None:
    assert planning.decide_load(prompt, computed, hit, 32, 256) == expected


@given(
    geo=geometry(),
    prompt=st.integers(1, 5000),
    computed_blocks=st.integers(0, 200),
    partial=st.integers(0, 63),
    hit_chunks=st.integers(0, 100),
)
def test_decide_load_properties(
    geo: tuple[int, int], prompt: int, computed_blocks: int, partial: int, hit_chunks: int
) -> None:
    block, chunk = geo
    computed = min(computed_blocks * block + partial % block, prompt - 1)
    hit = min(hit_chunks * chunk, chunk_floor(prompt, chunk))
    d = planning.decide_load(prompt, computed, hit, block, chunk)
    assert d.matched_tokens >= 0
    if d.loads:
        end = computed + d.matched_tokens
        assert end % block == 0  # TensorRT-LLM gets whole blocks
        assert end <= prompt - 1  # at least one prompt token is computed
        assert end <= hit  # never promise what the store lacks
        assert d.retrieve_start % chunk == 0 and d.retrieve_end % chunk == 0
        assert d.retrieve_start <= computed < d.retrieve_end <= hit
        # Full device blocks (shared) are never written; only the block holding a partial match is.
        assert d.retrieve_start + d.skip_tokens == computed // block * block
        assert d.retrieve_end >= end
        assert d.skip_tokens % block == 0 and d.skip_tokens < chunk
    # Every locked chunk is either retrieved or released, exactly once.
    covered = [(d.retrieve_start, d.retrieve_end)] if d.loads else []
    spans = sorted(covered + list(d.free_ranges))
    pos = 0
    for a, b in spans:
        assert a == pos and b > a and a % chunk == 0 and b % chunk == 0
        pos = b
    assert pos == chunk_floor(hit, chunk)


@given(
    geo=geometry(),
    stored=st.integers(0, 4000),
    valid=st.integers(0, 4000),
    blocks=st.integers(0, 300),
    prompt=st.integers(1, 4000),
    decode=st.booleans(),
)
def test_plan_save_properties(
    geo: tuple[int, int], stored: int, valid: int, blocks: int, prompt: int, decode: bool
) -> None:
    block, chunk = geo
    span = planning.plan_save(stored, valid, blocks * block, prompt, chunk, decode)
    if span is None:
        return
    start, end = span
    assert start % chunk == 0 and end % chunk == 0 and start < end
    assert start <= stored  # nothing between what is stored and what is saved now is skipped
    assert end <= valid and end <= blocks * block  # only KV that exists, in blocks the request owns
    if not decode:
        assert end <= prompt


@given(geo=geometry(), prompt=st.integers(1, 3000), sched=st.lists(st.integers(1, 300), min_size=1, max_size=40))
def test_chunked_prefill_saves_every_full_prompt_chunk_once(
    geo: tuple[int, int], prompt: int, sched: list[int]
) -> None:
    """Simulate chunked prefill: the union of saved ranges is exactly the chunk-aligned prompt, no overlap."""
    block, chunk = geo
    stored = kv = 0
    saved: list[tuple[int, int]] = []
    blocks = chunk_ceil(prompt, block)
    for n in sched:
        kv = planning.tokens_with_kv_after_step(kv, n, prompt)
        span = planning.plan_save(stored, kv, blocks, prompt, chunk, False)
        if span:
            saved.append(span)
            stored = span[1]
        if kv >= prompt:
            break
    if kv >= prompt:
        assert stored == chunk_floor(prompt, chunk)
    for (_, e1), (s2, _) in itertools.pairwise(saved):
        assert e1 == s2


def test_lookup_end_skips_useless_lookups() -> None:
    assert planning.lookup_end(300, 0, 256) == 256
    assert planning.lookup_end(300, 256, 256) == 0  # device already has every full chunk
    assert planning.lookup_end(200, 0, 256) == 0  # no full chunk


def test_tokens_with_kv_never_counts_draft_tokens() -> None:
    assert planning.tokens_with_kv_after_step(100, 4, 102) == 102
    assert planning.tokens_with_kv_after_step(10, 5, 100) == 15


def test_block_slice() -> None:
    assert planning.block_slice([5, 6, 7, 8], 32, 96, 32) == (6, 7)


@given(st.integers(0, 40), st.integers(0, 40), st.integers(1, 6))
def test_pipeline_groups_cover_the_range_in_order_in_whole_chunks(first: int, count: int, groups: int) -> None:
    chunk = 64
    start, end = first * chunk, (first + count) * chunk
    runs = planning.pipeline_groups(start, end, chunk, groups)
    assert len(runs) <= groups and (runs == [] if count == 0 else runs[0][0] == start and runs[-1][1] == end)
    assert all(a < b and a % chunk == 0 and b % chunk == 0 for a, b in runs)
    assert all(runs[i][1] == runs[i + 1][0] for i in range(len(runs) - 1))


@pytest.mark.parametrize(
    ("honoured", "expected_matched", "expected_copy_end"),
    [
        (256, 256, None),  # the whole offer: the decision as it was
        (48, 48, 48),  # a grow that failed: copies stop at the honoured end
        (0, 0, 0),  # honoured for nothing: no copies, the key stays for the COMMIT
    ],
)
def test_a_load_honoured_in_part_keeps_its_retrieve_key_and_stops_its_copies(
    honoured: int, expected_matched: int, expected_copy_end: int | None
) -> None:
    offer = planning.decide_load(296, 0, 256, 16, 64)
    taken = planning.honour(offer, honoured, 0)
    assert (taken.matched_tokens, taken.copy_end) == (expected_matched, expected_copy_end)
    assert (taken.retrieve_start, taken.retrieve_end) == (offer.retrieve_start, offer.retrieve_end)


@given(geometry(), st.integers(0, 2000), st.integers(0, 2000), st.integers(0, 2000), st.integers(0, 2000))
def test_an_honoured_load_never_copies_past_what_was_honoured(
    geo: tuple[int, int], prompt: int, computed: int, hit: int, honoured: int
) -> None:
    block, chunk = geo
    device = min(computed, prompt)
    decision = planning.decide_load(prompt, device, hit, block, chunk)
    taken = planning.honour(decision, honoured, device)
    assert taken.matched_tokens == min(decision.matched_tokens, honoured)
    if honoured < decision.matched_tokens:
        assert taken.copy_end == device + honoured
    else:
        assert taken == decision


def test_reused_blocks_are_the_device_prefix_with_a_partially_matched_block() -> None:
    assert planning.reused_blocks([7, 8, 9, 10], 32, 16) == [7, 8]
    assert planning.reused_blocks([7, 8, 9, 10], 40, 16) == [7, 8, 9]
    assert planning.reused_blocks([7, 8, 9, 10], 0, 16) == []


def test_only_a_parked_requests_load_targets_reused_by_another_mean_it_vanished() -> None:
    holders = {1: {100}, 2: {100, 200}, 3: {300}}
    loading_into = {3: 300}  # request 300 is parked, its load writes block 3
    assert planning.vanished_holders([], [1, 2], holders, loading_into, owner=999) == set(), "shared prefix"
    assert planning.vanished_holders([], [3], holders, loading_into, owner=999) == {300}
    assert planning.vanished_holders([], [3], holders, loading_into, owner=300) == set()
    assert planning.vanished_holders([2], [], holders, loading_into, owner=100) == {200}


def test_loads_are_synchronous_under_attention_dp() -> None:
    assert planning.load_is_async(8192, 4096, 1, attention_dp=False)
    assert not planning.load_is_async(8192, 4096, 1, attention_dp=True)


def test_a_tp_load_is_asynchronous_only_where_every_rank_finishes_it() -> None:
    assert not planning.load_is_async(8192, 4096, 2)
    assert planning.load_is_async(8192, 4096, 2, finished_by_every_rank=True)
    assert not planning.load_is_async(8192, 4096, 2, attention_dp=True, finished_by_every_rank=True)


def test_an_accepted_prefix_load_copies_only_its_range_under_the_whole_retrieve_key() -> None:
    """KVCacheManagerV2 may trim a reservation at its tail (a failed grow) or its head (more of the
    prompt on the device by the time the load is accepted): the copies cover exactly what was
    accepted; the chunks stay secured under the promise's retrieve key."""
    promise = planning.decide_load(600, 64, 512, 16, 256)  # promised [64, 512): chunks [0, 512)
    assert planning.accept(promise, 64, 64, 512, 16) == promise
    tail = planning.accept(promise, 64, 64, 300, 16)
    assert (tail.matched_tokens, tail.copy_end, tail.skip_tokens) == (236, 300, 64)
    head = planning.accept(promise, 64, 128, 512, 16)
    assert (head.matched_tokens, head.skip_tokens, head.retrieve_start, head.retrieve_end) == (384, 128, 0, 512)
    for start, end in ((32, 512), (64, 600), (200, 200)):
        with pytest.raises(ValueError, match="not inside the promise"):
            planning.accept(promise, 64, start, end, 16)
