"""Block <-> chunk copies between TensorRT-LLM's pool and LMCache chunk buffers (device-neutral torch).

LMCache's engine-driven path stores a chunk of ``T = blocks_per_chunk * tokens_per_block`` tokens
as ``[2, num_layers, T, num_kv_heads * head_dim]`` (K/V, layer, token, hidden). TensorRT-LLM keeps
one block as ``[num_layers, 2, num_kv_heads, tokens_per_block, head_dim]``. So one chunk is a single
permute of ``blocks_per_chunk`` pool blocks, ``(b, l, kv, h, t, d) -> (kv, l, b, t, h, d)``.

LMCache 0.5.6's ``gather_paged_kv_to_cpu``/``scatter_cpu_to_paged_kv`` do the same through its
generic transfer op. These functions produce byte-identical chunks (unit-tested against LMCache's
own gather) and are used inside LMCache's PREPARE/COMMIT protocol, into the SHM slots the server
hands out; measured in docs/connector.md.

On a GPU pool the permute runs on the device into a contiguous staging tensor and one async DMA
per chunk moves it to/from the (``cudaHostRegister``-ed) SHM slot; the block ids go to the device
once per operation. Callers synchronize the device before COMMIT.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _blocks_view(pool: torch.Tensor, num_kv_heads: int, tokens_per_block: int, head_dim: int) -> torch.Tensor:
    nb, nl, kv, _ = pool.shape
    return pool.view(nb, nl, kv, num_kv_heads, tokens_per_block, head_dim)


def _index(pool: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    idx = torch.tensor(list(block_ids), dtype=torch.long)
    if pool.device.type == "cpu":
        return idx
    return idx.pin_memory().to(pool.device, non_blocking=True)


def gather_chunks(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    outs: Sequence[torch.Tensor],
    chunk_indices: Sequence[int],
    blocks_per_chunk: int,
    num_kv_heads: int,
    tokens_per_block: int,
    head_dim: int,
) -> None:
    """Copy chunk ``chunk_indices[i]`` of ``block_ids`` into ``outs[i]`` (``[2, layers, T, heads*head_dim]``)."""
    blocks = _blocks_view(pool, num_kv_heads, tokens_per_block, head_dim)
    idx = _index(pool, block_ids)
    shape = (2, pool.shape[1], blocks_per_chunk, tokens_per_block, num_kv_heads, head_dim)
    for out, c in zip(outs, chunk_indices, strict=False):
        # [b, l, kv, h, t, d] -> [kv, l, b, t, h, d]
        src = blocks.index_select(0, idx[c * blocks_per_chunk : (c + 1) * blocks_per_chunk]).permute(2, 1, 0, 4, 3, 5)
        if out.device == pool.device:
            out.view(shape).copy_(src)
        else:  # reorder on the device, then one contiguous async DMA
            out.view(shape).copy_(src.contiguous(), non_blocking=True)


def scatter_chunks(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    chunks: Sequence[torch.Tensor],
    skip_blocks: int,
    blocks_per_chunk: int,
    num_kv_heads: int,
    tokens_per_block: int,
    head_dim: int,
) -> None:
    """Write ``chunks`` (consecutive, from the first) into ``block_ids``, leaving the first ``skip_blocks`` untouched."""
    blocks = _blocks_view(pool, num_kv_heads, tokens_per_block, head_dim)
    idx = _index(pool, block_ids)
    nl = pool.shape[1]
    for i, chunk in enumerate(chunks):
        lo = i * blocks_per_chunk
        first = max(skip_blocks - lo, 0)
        if first >= blocks_per_chunk:
            continue
        src = chunk.view(2, nl, blocks_per_chunk, tokens_per_block, num_kv_heads, head_dim)
        if chunk.device != pool.device:  # one contiguous async DMA, then reorder on the device (stream-ordered)
            src = src.to(pool.device, non_blocking=True)
        # [kv, l, b, t, h, d] -> [b, l, kv, h, t, d]
        reordered = src[:, :, first:].permute(2, 1, 0, 4, 3, 5).contiguous()
        blocks.index_copy_(0, idx[lo + first : lo + blocks_per_chunk], reordered)


def gather_chunk(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    out: torch.Tensor,
    num_kv_heads: int,
    tokens_per_block: int,
    head_dim: int,
) -> None:
    """One chunk's blocks into ``out`` (convenience for tests and single chunks)."""
    gather_chunks(pool, block_ids, [out], [0], len(block_ids), num_kv_heads, tokens_per_block, head_dim)


def scatter_chunk(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    chunk: torch.Tensor,
    skip_blocks: int,
    num_kv_heads: int,
    tokens_per_block: int,
    head_dim: int,
) -> None:
    """One chunk back into ``block_ids`` (convenience for tests and single chunks)."""
    scatter_chunks(pool, block_ids, [chunk], skip_blocks, len(block_ids), num_kv_heads, tokens_per_block, head_dim)
