"""Block <-> chunk copies: a chunk holds its blocks' bytes in order, and a load writes them back."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.connector.backends.blockcopy import (
    block_runs,
    gather_chunk,
    gather_chunks,
    scatter_chunk,
    scatter_chunks,
)

pytestmark = pytest.mark.connector


def _pool(nb: int, nl: int, nh: int, bs: int, hd: int) -> torch.Tensor:
    return torch.randint(-30000, 30000, (nb, nl, 2, nh * bs * hd), dtype=torch.int16).view(torch.float16)


def _slot(nl: int, tokens: int, nh: int, hd: int) -> torch.Tensor:
    """A chunk slot as LMCache declares it: ``[2, layers, tokens, heads * head_dim]``."""
    return torch.empty(2, nl, tokens, nh * hd, dtype=torch.float16)


@given(st.lists(st.integers(0, 40), max_size=12))
def test_block_runs_cover_the_ids_in_maximal_consecutive_runs(ids: list[int]) -> None:
    runs = list(block_runs(ids))
    rebuilt = [first + k for _, first, n in runs for k in range(n)]
    assert rebuilt == ids
    assert [pos for pos, _, _ in runs] == [sum(n for _, _, n in runs[:i]) for i in range(len(runs))]
    for (pos, _, n), (_, nxt, _) in itertools.pairwise(runs):
        assert ids[pos + n - 1] + 1 != nxt  # a run never stops where the next id continues it


@settings(max_examples=40, deadline=None)
@given(
    nl=st.integers(1, 3),
    nh=st.integers(1, 3),
    bs=st.sampled_from([1, 2, 4]),
    hd=st.integers(1, 4),
    ids=st.lists(st.integers(0, 9), min_size=1, max_size=6, unique=True),
)
def test_chunk_holds_the_bytes_of_its_blocks_in_request_order(
    nl: int, nh: int, bs: int, hd: int, ids: list[int]
) -> None:
    pool = _pool(10, nl, nh, bs, hd)
    chunk = _slot(nl, len(ids) * bs, nh, hd)
    gather_chunk(pool, ids, chunk)
    want = torch.cat([pool[b].reshape(-1) for b in ids])
    assert torch.equal(chunk.reshape(-1).view(torch.int16), want.view(torch.int16))


def test_consecutive_block_ids_are_copied_as_one_run() -> None:
    pool = _pool(8, 2, 1, 2, 2)
    chunk = _slot(2, 4 * 2, 1, 2)
    gather_chunk(pool, [3, 4, 5, 6], chunk)
    assert torch.equal(chunk.reshape(-1).view(torch.int16), pool[3:7].reshape(-1).view(torch.int16))
    assert list(block_runs([3, 4, 5, 6])) == [(0, 3, 4)]


def test_slot_of_another_size_is_refused_and_nothing_is_written() -> None:
    pool = _pool(6, 2, 1, 2, 2)
    before = pool.clone()
    too_small = _slot(2, 2, 1, 2)  # one block's worth, two blocks asked
    with pytest.raises(ValueError, match="chunk slot holds"):
        scatter_chunk(pool, [0, 1], too_small, 0)
    assert torch.equal(pool.view(torch.int16), before.view(torch.int16))


def test_pool_whose_blocks_are_not_contiguous_is_refused() -> None:
    strided = _pool(6, 2, 1, 2, 2).transpose(1, 2)  # a view whose blocks are not one contiguous run
    with pytest.raises(RuntimeError):
        gather_chunk(strided, [0], _slot(2, 2, 1, 2))


@settings(max_examples=30, deadline=None)
@given(
    nl=st.integers(1, 3),
    nh=st.integers(1, 3),
    bs=st.sampled_from([1, 2, 4]),
    hd=st.integers(1, 4),
    bpc=st.integers(1, 3),
    skip=st.integers(0, 3),
    data=st.data(),
)
def test_scatter_inverts_gather_and_skips(
    nl: int, nh: int, bs: int, hd: int, bpc: int, skip: int, data: st.DataObject
) -> None:
    nb = 2 * bpc + 2
    pool = _pool(nb, nl, nh, bs, hd)
    src = data.draw(st.permutations(range(nb)))[:bpc]
    dst = [b for b in range(nb) if b not in src][:bpc]
    chunk = _slot(nl, bpc * bs, nh, hd)
    gather_chunk(pool, src, chunk)
    before = pool.clone()
    scatter_chunk(pool, dst, chunk, skip)
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        want = before[s] if i >= skip else before[d]
        assert torch.equal(pool[d].view(torch.int16), want.view(torch.int16))
    untouched = [b for b in range(nb) if b not in dst[skip:]]
    assert torch.equal(pool[untouched].view(torch.int16), before[untouched].view(torch.int16))


@settings(max_examples=30, deadline=None)
@given(
    chunks=st.integers(1, 4),
    bpc=st.integers(1, 3),
    data=st.data(),
)
def test_many_chunks_round_trip_with_a_skip_across_chunk_boundaries(chunks: int, bpc: int, data: st.DataObject) -> None:
    nl, nh, bs, hd = 2, 2, 2, 4
    n = chunks * bpc
    nb = 2 * n + 1
    pool = _pool(nb, nl, nh, bs, hd)
    order = data.draw(st.permutations(range(nb)))
    src, dst = order[:n], order[n : 2 * n]
    wanted = data.draw(st.lists(st.integers(0, chunks - 1), min_size=1, max_size=chunks, unique=True))
    outs = [_slot(nl, bpc * bs, nh, hd) for _ in wanted]
    gather_chunks(pool, src, outs, wanted, bpc)
    for out, c in zip(outs, wanted, strict=True):
        one = torch.empty_like(out)
        gather_chunk(pool, src[c * bpc : (c + 1) * bpc], one)
        assert torch.equal(out.view(torch.int16), one.view(torch.int16))

    every = [_slot(nl, bpc * bs, nh, hd) for _ in range(chunks)]
    gather_chunks(pool, src, every, list(range(chunks)), bpc)
    skip = data.draw(st.integers(0, n))
    before = pool.clone()
    scatter_chunks(pool, dst, every, skip, bpc)
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        want = before[s] if i >= skip else before[d]
        assert torch.equal(pool[d].view(torch.int16), want.view(torch.int16)), (i, skip)
    untouched = [b for b in range(nb) if b not in dst[skip:]]
    assert torch.equal(pool[untouched].view(torch.int16), before[untouched].view(torch.int16))
