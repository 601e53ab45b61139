"""Layer-wise loads: a chunk's blocks copied into the pool one span of layers at a time, so the
forward pass can run layer ``i`` once that layer's span has landed instead of after the whole copy.

A TensorRT-LLM block holds its layers one after the other (``[num_layers, ...]`` per block), so
layers ``[first, end)`` of a run of consecutive blocks are rows of ``(end - first) * layer_bytes``
bytes, one per block, ``block_bytes`` apart in the pool and in the chunk slot alike: one 2-D copy
(``cudaMemcpy2DAsync``) per span and run. Spans are as many as keep the copy calls per load within
``MAX_COPY_CALLS`` (the host issues every call; a span of all layers is the whole-block copy).

The runs are worked out once per load (``RowRuns``: addresses, a block apart on both sides, and
runs whose slots and blocks both continue each other merged), and each span's calls are issued
from those addresses alone. Issued through tensor views, each call cost about 57 us of host time
(an H100, 2,048 calls for 16k tokens: 116 ms, all of it before the forward pass could be queued).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvoffload.connector.backends.base import LoadResult
from kvoffload.connector.backends.blockcopy import CopyMark, block_runs, kept_chunk_blocks, pool_blocks, slot_blocks

MAX_COPY_CALLS = 4096
"""Copy calls one layer-wise load may issue at most (spans x runs of blocks): about 45 ms of host time."""
COPY_CALL_SECONDS = 11e-6
"""Host time of one copy call as issued here (an H100 host, 2026-12-07: 44 ms for 4,096 calls)."""
COPY_BYTES_PER_S = 45e9
"""A pinned host-to-device copy (PCIe 5 on an H100 or H200: 45-55 GB/s), for the span count only."""

_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)


def layer_spans(num_layers: int, runs: int, max_calls: int | None = None, load_bytes: int | None = None
                ) -> list[tuple[int, int]]:  # fmt: skip
    """``[first, end)`` of consecutive layer spans, the layers spread evenly: at most one per layer, at
    least one, within ``max_calls`` (default ``MAX_COPY_CALLS``) copy calls of ``runs`` runs each, and,
    given the ``load_bytes``, as many as balance the host's issuing of every call (the forward pass is
    queued only after it) against the first span's copy (the first layer waits for it):
    ``sqrt(copy time / (runs x call time))``. Many scattered runs get few spans, a load of a few
    long runs one per layer."""
    budget = MAX_COPY_CALLS if max_calls is None else max_calls
    spans = max(1, min(num_layers, budget // max(runs, 1)))
    if load_bytes is not None:
        balanced = math.sqrt(load_bytes / COPY_BYTES_PER_S / (max(runs, 1) * COPY_CALL_SECONDS))
        spans = max(1, min(spans, round(balanced)))
    bounds = [num_layers * i // spans for i in range(spans + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(spans)]


@functools.cache
def cuda_runtime() -> ctypes.CDLL | None:
    """The CUDA runtime torch runs on (its soname is already loaded), or None without one."""
    for name in ("libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart")):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        fn = lib.cudaMemcpy2DAsync
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]  # fmt: skip
        fn.restype = ctypes.c_int
        return lib
    return None


def rows_copy_available(device: torch.device) -> bool:
    """Whether layer-wise copies can be issued into a pool on ``device`` (always on CPU; on a GPU,
    with the CUDA runtime's 2-D copy)."""
    return device.type == "cpu" or (device.type == "cuda" and cuda_runtime() is not None)


def _copy_rows_on_host(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, rows: int) -> None:
    """What one ``cudaMemcpy2DAsync`` does, in host memory, now: ``rows`` rows of ``width`` bytes from
    address ``src`` to ``dst``, rows ``src_pitch`` and ``dst_pitch`` bytes apart."""
    for row in range(rows):
        ctypes.memmove(dst + row * dst_pitch, src + row * src_pitch, width)


@dataclass(frozen=True)
class PoolRows:
    """The pool as ``[num_blocks, num_layers, layer_bytes]`` bytes (a view)."""

    blocks: torch.Tensor

    @classmethod
    def of(cls, pool: torch.Tensor) -> PoolRows:
        """``pool`` is ``[num_blocks, num_layers, ...]`` with contiguous blocks."""
        num_layers = int(pool.shape[1])
        flat = pool_blocks(pool)
        return cls(flat.view(pool.shape[0], num_layers, flat.shape[1] // num_layers))

    @property
    def num_layers(self) -> int:
        return int(self.blocks.shape[1])

    def runs(
        self, block_ids: Sequence[int], chunks: Sequence[torch.Tensor], skip_blocks: int, blocks_per_chunk: int
    ) -> RowRuns:
        """The runs of a load of ``chunks`` (consecutive, from the first) into ``block_ids``, leaving
        the first ``skip_blocks`` untouched: what ``blockcopy.scatter_chunks`` writes, as addresses."""
        num_layers, layer_bytes = int(self.blocks.shape[1]), int(self.blocks.shape[2])
        block_bytes = num_layers * layer_bytes
        pool, pitch = self.blocks.data_ptr(), int(self.blocks.stride(0))
        runs: list[list[int]] = []  # [pool address, slot address, blocks]
        for i, first_kept, start, end in kept_chunk_blocks(len(chunks), blocks_per_chunk, skip_blocks):
            slot = slot_blocks(chunks[i], blocks_per_chunk, block_bytes)
            base = slot.data_ptr()
            for pos, first, n in block_runs(block_ids[start:end]):
                dst, src = pool + first * pitch, base + (first_kept + pos) * block_bytes
                last = runs[-1] if runs else None
                if last and last[0] + last[2] * pitch == dst and last[1] + last[2] * block_bytes == src:
                    last[2] += n  # this run continues the last on both sides: one copy
                else:
                    runs.append([dst, src, n])
        stream = torch.cuda.current_stream(self.blocks.device).cuda_stream if self.blocks.is_cuda else None
        return RowRuns(tuple((d, s, n) for d, s, n in runs), pitch, block_bytes, layer_bytes, stream)

    def scatter_span(
        self,
        block_ids: Sequence[int],
        chunks: Sequence[torch.Tensor],
        skip_blocks: int,
        blocks_per_chunk: int,
        span: tuple[int, int],
    ) -> None:
        """Layers ``span`` of ``chunks`` into ``block_ids`` (``runs``, then ``RowRuns.copy_span``)."""
        self.runs(block_ids, chunks, skip_blocks, blocks_per_chunk).copy_span(span)


@dataclass(frozen=True)
class RowRuns:
    """A load's runs of blocks as addresses: ``(pool address, slot address, blocks)``, blocks
    ``pool_pitch`` bytes apart in the pool and ``slot_pitch`` in the slot."""

    runs: tuple[tuple[int, int, int], ...]
    pool_pitch: int
    slot_pitch: int
    layer_bytes: int
    stream: int | None
    """The CUDA stream the copies go on (the current one when the runs were worked out); None: host."""

    def copy_span(self, span: tuple[int, int]) -> None:
        """Issue layers ``span`` of every run: one copy call per run (on a GPU the loop calls the
        runtime and nothing else: its host time is what the forward pass waits behind)."""
        first_layer, end_layer = span
        offset, width = first_layer * self.layer_bytes, (end_layer - first_layer) * self.layer_bytes
        pool_pitch, slot_pitch, stream = self.pool_pitch, self.slot_pitch, self.stream
        if stream is None:
            for dst, src, rows in self.runs:
                _copy_rows_on_host(dst + offset, pool_pitch, src + offset, slot_pitch, width, rows)
            return
        lib = cuda_runtime()
        if lib is None:
            raise RuntimeError("the CUDA runtime's cudaMemcpy2DAsync is not available")
        memcpy_2d = lib.cudaMemcpy2DAsync
        for dst, src, rows in self.runs:
            status = memcpy_2d(dst + offset, pool_pitch, src + offset, slot_pitch, width, rows, _CUDA_MEMCPY_DEFAULT,
                               stream)  # fmt: skip
            if status:
                raise RuntimeError(f"cudaMemcpy2DAsync failed with CUDA error {status}")


@dataclass
class LayerwiseLoad:
    """Secured loads issued span by span of layers: one result per op (bytes, or the error that
    stopped it), and after each span a mark the forward pass's layers in that span wait for."""

    results: list[LoadResult]
    spans: list[tuple[int, int]]
    marks: list[CopyMark]
    copy_timer: CopyTimer

    def mark_for_layer(self, layer: int) -> CopyMark | None:
        """The mark after the span holding ``layer`` (None: no such layer in the pool)."""
        for (first, end), mark in zip(self.spans, self.marks, strict=True):
            if first <= layer < end:
                return mark
        return None

    @property
    def last_mark(self) -> CopyMark:
        return self.marks[-1]


class CopyTimer:
    """The time copies took on their stream: CUDA events around them on a GPU, the host's clock on
    CPU (copies there run inline); read once they are done."""

    def __init__(self, device: torch.device) -> None:
        self._events: tuple[Any, Any] | None = None
        self._started = time.perf_counter()
        self._host_seconds: float | None = None
        if device.type == "cuda":
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()

    def stop(self) -> None:
        """The copies to time are issued (on the current stream)."""
        if self._events is not None:
            self._events[1].record()
        else:
            self._host_seconds = time.perf_counter() - self._started

    def seconds(self) -> float | None:
        """How long the copies took, once they are done (None before)."""
        if self._events is None:
            return self._host_seconds
        start, end = self._events
        return float(start.elapsed_time(end)) / 1e3 if end.query() else None
