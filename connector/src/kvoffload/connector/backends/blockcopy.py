"""Block <-> chunk copies between TensorRT-LLM's pool and LMCache chunk slots (device-neutral torch).

A TensorRT-LLM block holds all layers of ``tokens_per_block`` tokens contiguously
(``[num_layers, 2, num_kv_heads * tokens_per_block * head_dim]``: 4 MiB for Llama-3-8B). In
LMCache's engine-driven protocol the server only stores the bytes of the chunk slots it hands out
(PREPARE) and hands them back (RETRIEVE); it never reads them. So a chunk here is **block-native**:
the raw bytes of its ``blocks_per_chunk`` blocks, in order. A store or a load is then one DMA per
run of consecutive block ids (at most one per block) between the pool and the (pinned) slot, with
no reordering kernel and no staging buffer; the copy runs at the host link's speed.

The chunk slot's declared shape is LMCache's (``[2, layers, tokens, heads * head_dim]``); only its
byte size matters here and is checked. Chunks written this way are not LMCache's own layout, so the
connector keys them under a layout-tagged model name (``keys.cache_model_name``) and never mixes
them with chunks written by LMCache's gather/scatter.

Copies are issued on the current stream, asynchronously where the device allows. Backends run
them on a ``TransferStream``: on a GPU pool a dedicated CUDA stream, ordered after the work the
calling thread already queued (the forward pass that wrote the KV), and synchronized alone before
COMMIT, so a transfer never waits for unrelated work the engine queued meanwhile (a device-wide
synchronize would wait for the next forward pass) and its DMA overlaps the engine's kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def block_runs(block_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Maximal runs of consecutive ids in ``block_ids``: ``(position, first id, length)``."""
    start = 0
    for i in range(1, len(block_ids) + 1):
        if i == len(block_ids) or block_ids[i] != block_ids[i - 1] + 1:
            yield start, int(block_ids[start]), i - start
            start = i


def kept_chunk_blocks(num_chunks: int, blocks_per_chunk: int, skip_blocks: int) -> Iterator[tuple[int, int, int, int]]:
    """The chunks a load of ``num_chunks`` consecutive chunks writes when it leaves its first
    ``skip_blocks`` blocks untouched (the device's own prefix): ``(chunk index, its first kept block
    within the chunk, [start, end) of the kept blocks among the load's)``; whole skipped chunks left out."""
    for i in range(num_chunks):
        lo = i * blocks_per_chunk
        first_kept = max(skip_blocks - lo, 0)
        if first_kept < blocks_per_chunk:
            yield i, first_kept, lo + first_kept, lo + blocks_per_chunk


def pool_blocks(pool: torch.Tensor) -> torch.Tensor:
    """The pool as ``[num_blocks, block_bytes]`` bytes (a view: raises if blocks are not contiguous)."""
    return pool.view(pool.shape[0], -1).view(torch.uint8)


def slot_blocks(slot: torch.Tensor, blocks_per_chunk: int, block_bytes: int) -> torch.Tensor:
    """A chunk slot as ``[blocks_per_chunk, block_bytes]`` bytes (a view)."""
    flat = slot.view(-1).view(torch.uint8)
    if flat.numel() != blocks_per_chunk * block_bytes:
        raise ValueError(
            f"chunk slot holds {flat.numel()} bytes, {blocks_per_chunk} blocks need {blocks_per_chunk * block_bytes}"
        )
    return flat.view(blocks_per_chunk, block_bytes)


def gather_chunks(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    outs: Sequence[torch.Tensor],
    chunk_indices: Sequence[int],
    blocks_per_chunk: int,
) -> None:
    """Copy chunk ``chunk_indices[i]`` of ``block_ids`` (its blocks, in order) into the slot ``outs[i]``."""
    blocks = pool_blocks(pool)
    for out, c in zip(outs, chunk_indices, strict=True):
        slot = slot_blocks(out, blocks_per_chunk, blocks.shape[1])
        ids = block_ids[c * blocks_per_chunk : (c + 1) * blocks_per_chunk]
        for pos, first, n in block_runs(ids):
            slot[pos : pos + n].copy_(blocks[first : first + n], non_blocking=True)


def scatter_chunks(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    chunks: Sequence[torch.Tensor],
    skip_blocks: int,
    blocks_per_chunk: int,
) -> None:
    """Write ``chunks`` (consecutive, from the first) into ``block_ids``, leaving the first ``skip_blocks`` untouched."""
    blocks = pool_blocks(pool)
    for i, first_kept, start, end in kept_chunk_blocks(len(chunks), blocks_per_chunk, skip_blocks):
        slot = slot_blocks(chunks[i], blocks_per_chunk, blocks.shape[1])
        for pos, first, n in block_runs(block_ids[start:end]):
            at = first_kept + pos
            blocks[first : first + n].copy_(slot[at : at + n], non_blocking=True)


def gather_chunk(pool: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor) -> None:
    """One chunk's blocks into ``out`` (convenience for tests and single chunks)."""
    gather_chunks(pool, block_ids, [out], [0], len(block_ids))


def scatter_chunk(pool: torch.Tensor, block_ids: Sequence[int], chunk: torch.Tensor, skip_blocks: int) -> None:
    """One chunk back into ``block_ids`` (convenience for tests and single chunks)."""
    scatter_chunks(pool, block_ids, [chunk], skip_blocks, len(block_ids))


def page_runs(page_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """Like :func:`block_runs`, leaving out entries without a page (negative: ``BAD_PAGE_INDEX``)."""
    start = 0
    for i in range(1, len(page_ids) + 1):
        if i == len(page_ids) or page_ids[i] != page_ids[i - 1] + 1 or page_ids[i] < 0 or page_ids[i - 1] < 0:
            if page_ids[start] >= 0:
                yield start, int(page_ids[start]), i - start
            start = i


class GroupedPages:
    """The pages of several layer groups (``layout.GroupedLayout``), each group ``[num_slots, page_bytes]``
    bytes (a strided view of its region: one slot of the pool may hold other groups' regions too).
    In a chunk, a block ordinal's bytes are every group's page for it, in chunk order."""

    def __init__(self, groups: Sequence[torch.Tensor]) -> None:
        self.groups = [pages.view(torch.uint8) if pages.dtype != torch.uint8 else pages for pages in groups]
        self.offsets: list[int] = []
        offset = 0
        for pages in self.groups:
            self.offsets.append(offset)
            offset += int(pages.shape[1])
        self.block_bytes = offset
        self.device = self.groups[0].device

    def _ids(self, group: int, block_ids: Sequence[int], group_block_ids: Sequence[Sequence[int]]) -> Sequence[int]:
        return block_ids if group == 0 else group_block_ids[group - 1]

    def gather(
        self,
        block_ids: Sequence[int],
        group_block_ids: Sequence[Sequence[int]],
        outs: Sequence[torch.Tensor],
        chunk_indices: Sequence[int],
        blocks_per_chunk: int,
    ) -> None:
        """Chunk ``chunk_indices[i]`` of the op's blocks, every group's pages, into the slot ``outs[i]``;
        raises if one of them has no page (a stored chunk holds every group)."""
        for out, c in zip(outs, chunk_indices, strict=True):
            slot = slot_blocks(out, blocks_per_chunk, self.block_bytes)
            lo = c * blocks_per_chunk
            for g, (pages, offset) in enumerate(zip(self.groups, self.offsets, strict=True)):
                ids = self._ids(g, block_ids, group_block_ids)[lo : lo + blocks_per_chunk]
                if len(ids) != blocks_per_chunk or any(i < 0 for i in ids):
                    raise ValueError(f"layer group {g} has no page for a block of the chunk to store")
                dst = slot[:, offset : offset + pages.shape[1]]
                for pos, first, n in page_runs(ids):
                    dst[pos : pos + n].copy_(pages[first : first + n], non_blocking=True)

    def scatter(
        self,
        block_ids: Sequence[int],
        group_block_ids: Sequence[Sequence[int]],
        chunks: Sequence[torch.Tensor],
        skip_blocks: int,
        blocks_per_chunk: int,
    ) -> None:
        """Write ``chunks`` (consecutive, from the first) into every group's pages, leaving the first
        ``skip_blocks`` ordinals and the ordinals a group has no page for untouched."""
        for i, first_kept, start, end in kept_chunk_blocks(len(chunks), blocks_per_chunk, skip_blocks):
            slot = slot_blocks(chunks[i], blocks_per_chunk, self.block_bytes)
            for g, (pages, offset) in enumerate(zip(self.groups, self.offsets, strict=True)):
                ids = self._ids(g, block_ids, group_block_ids)[start:end]
                src = slot[:, offset : offset + pages.shape[1]]
                for pos, first, n in page_runs(ids):
                    at = first_kept + pos
                    pages[first : first + n].copy_(src[at : at + n], non_blocking=True)


class TransferStream:
    """Where a backend's block copies run: a dedicated CUDA stream for a GPU pool, inline on CPU."""

    def __init__(self, device: torch.device) -> None:
        self._stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None

    @contextlib.contextmanager
    def after_caller(self) -> Iterator[None]:
        """Run the block's copies on this stream, after the work already queued on the caller's stream.

        The ordering is on the device: the calling thread does not wait for the caller's stream.
        """
        if self._stream is None:
            yield
            return
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        with torch.cuda.stream(self._stream):
            yield

    def mark(self) -> CopyMark:
        """A mark after the copies issued on this stream so far: ask whether they finished, or order
        another stream after them on the device."""
        if self._stream is None:
            return CopyMark(None)
        event = torch.cuda.Event()
        event.record(self._stream)
        return CopyMark(event)

    def synchronize(self) -> None:
        """Wait until every copy issued on this stream finished (and the work it was ordered after)."""
        if self._stream is not None:
            self._stream.synchronize()


class CopyMark:
    """Where a transfer stream's copies stood when marked (CPU copies run inline: always done)."""

    def __init__(self, event: Any) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event is None or bool(self._event.query())

    def wait(self) -> None:
        """Block the calling thread until the marked copies are done (host-side)."""
        if self._event is not None:
            self._event.synchronize()

    def order_current_stream_after(self) -> None:
        """The calling thread's current stream runs later work only after the marked copies (device-side)."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
