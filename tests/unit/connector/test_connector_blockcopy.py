"""Our block<->chunk copies produce exactly LMCache's engine-driven chunk layout, and invert it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.connector.backends.blockcopy import gather_chunk, gather_chunks, scatter_chunk, scatter_chunks

pytestmark = pytest.mark.connector


def _pool(nb: int, nl: int, nh: int, bs: int, hd: int) -> torch.Tensor:
    return torch.randint(-30000, 30000, (nb, nl, 2, nh * bs * hd), dtype=torch.int16).view(torch.float16)


def test_gather_matches_lmcache_engine_driven_layout() -> None:
    from lmcache.utils import EngineType
    from lmcache.v1.multiprocess.transfer_context.base import compute_kv_layout, gather_paged_kv_to_cpu

    nb, nl, nh, bs, hd, bpc = 12, 3, 2, 4, 8, 2
    pool = _pool(nb, nl, nh, bs, hd)
    hints = {"kv_layout": "HND", "num_kv_heads": nh, "tokens_per_block": bs, "head_dim": hd}
    kv = {"pool": pool}
    fmt = compute_kv_layout(kv, layout_hints=hints, engine_type=EngineType.TRTLLM)[4]  # type: ignore[arg-type]
    blocks = [7, 2, 9, 4]
    theirs = gather_paged_kv_to_cpu(
        kv,
        blocks,
        bpc,
        layout_hints=hints,
        engine_kv_format=fmt,
        engine_type=EngineType.TRTLLM,  # type: ignore[arg-type]
    )
    for i, chunk in enumerate(theirs):
        mine = torch.empty_like(chunk)
        gather_chunk(pool, blocks[i * bpc : (i + 1) * bpc], mine, nh, bs, hd)
        assert torch.equal(mine.view(torch.int16), chunk.view(torch.int16))


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
    chunk = torch.empty(2, nl, bpc * bs, nh * hd, dtype=pool.dtype)
    gather_chunk(pool, src, chunk, nh, bs, hd)
    before = pool.clone()
    scatter_chunk(pool, dst, chunk, skip, nh, bs, hd)
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
    outs = [torch.empty(2, nl, bpc * bs, nh * hd, dtype=pool.dtype) for _ in wanted]
    gather_chunks(pool, src, outs, wanted, bpc, nh, bs, hd)
    for out, c in zip(outs, wanted, strict=True):
        one = torch.empty_like(out)
        gather_chunk(pool, src[c * bpc : (c + 1) * bpc], one, nh, bs, hd)
        assert torch.equal(out.view(torch.int16), one.view(torch.int16))

    every = [torch.empty(2, nl, bpc * bs, nh * hd, dtype=pool.dtype) for _ in range(chunks)]
    gather_chunks(pool, src, every, list(range(chunks)), bpc, nh, bs, hd)
    skip = data.draw(st.integers(0, n))
    before = pool.clone()
    scatter_chunks(pool, dst, every, skip, bpc, nh, bs, hd)
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        want = before[s] if i >= skip else before[d]
        assert torch.equal(pool[d].view(torch.int16), want.view(torch.int16)), (i, skip)
    untouched = [b for b in range(nb) if b not in dst[skip:]]
    assert torch.equal(pool[untouched].view(torch.int16), before[untouched].view(torch.int16))
