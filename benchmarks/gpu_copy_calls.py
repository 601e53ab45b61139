"""How the copy calls of a load of scattered blocks reach the host link's speed (GPU).

A load copies one DMA per run of consecutive blocks from chunk slots in pinned host memory into the
pool; with scattered block ids that is one call per block (a Llama-3-8B block: 4 MiB). This times,
for the same bytes and the same scattered destination blocks, host to device (and device to host):

- ``contiguous``: one copy of all the bytes (the ceiling: ``raw`` in the other benchmarks);
- ``views``: one ``Tensor.copy_`` per block between views (how ``blockcopy.scatter_chunks`` issues);
- ``addresses``: one ``cudaMemcpyAsync`` per block from addresses (how ``layer_copies`` issues);
- ``addresses_2_streams``: the same, blocks alternating between two streams;
- ``batch``: one ``cudaMemcpyBatchAsync`` for every block (CUDA 12.8+), where the runtime has it.

Each from two sources: memory pinned by ``cudaHostAlloc`` (torch's ``pin_memory``) and a shared
memory segment (``/dev/shm``) pinned by ``cudaHostRegister``, as LMCache's L1 pool is. Timed from the
first call to the stream's end on the host's clock (median of ``--reps``), beside the host time the
calls alone took. Prints one JSON line per size, source and way; the data is checked once per way.

    python -m benchmarks.gpu_copy_calls --tokens 4096 16384 32768 --reps 5
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import scattered_block_ids
from kvoffload.connector.backends.layer_copies import cuda_runtime

BLOCK_BYTES = 4 << 20
"""A Llama-3-8B block (32 tokens x 32 layers x K and V x 8 heads x 128 x bf16)."""
TOKENS_PER_BLOCK = 32
_MEMCPY_DEFAULT = 4


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation), ("dstLocHint", _MemLocation),
                ("flags", ctypes.c_uint)]  # fmt: skip


class HostSource:
    """``nbytes`` of pinned host memory, by ``cudaHostAlloc`` or a registered shared memory segment."""

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind = kind
        self._map: mmap.mmap | None = None
        self._registered = 0
        if kind == "host_alloc":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="kvo-copy-calls-")
            os.ftruncate(fd, nbytes)
            self._map = mmap.mmap(fd, nbytes)
            os.close(fd)
            os.unlink(path)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
            self.tensor.fill_(0)  # fault the pages in before registering
            err = int(torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0))
            if err:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
            self._registered = self.tensor.data_ptr()

    def close(self) -> None:
        if self._registered:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
        del self.tensor
        if self._map is not None:
            self._map.close()


def _pairs(dst: torch.Tensor, src: torch.Tensor, dst_ids: tuple[int, ...]) -> list[tuple[int, int]]:
    """(destination address, source address) of each block: source block i to destination block dst_ids[i]."""
    d, s = dst.data_ptr(), src.data_ptr()
    return [(d + b * BLOCK_BYTES, s + i * BLOCK_BYTES) for i, b in enumerate(dst_ids)]


def _ways(lib: ctypes.CDLL, streams: list[torch.cuda.Stream]) -> dict[str, Callable[..., None]]:
    memcpy = lib.cudaMemcpyAsync
    memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    memcpy.restype = ctypes.c_int
    handles = [s.cuda_stream for s in streams]

    def contiguous(dst: torch.Tensor, src: torch.Tensor, ids: tuple[int, ...], up: bool) -> None:
        dst[: src.numel()].copy_(src, non_blocking=True) if up else src.copy_(dst[: src.numel()], non_blocking=True)

    def views(dst: torch.Tensor, src: torch.Tensor, ids: tuple[int, ...], up: bool) -> None:
        d, s = dst.view(-1, BLOCK_BYTES), src.view(-1, BLOCK_BYTES)
        for i, b in enumerate(ids):
            d[b].copy_(s[i], non_blocking=True) if up else s[i].copy_(d[b], non_blocking=True)

    def addresses(dst: torch.Tensor, src: torch.Tensor, ids: tuple[int, ...], up: bool, n: int = 1) -> None:
        for i, (d, s) in enumerate(_pairs(dst, src, ids)):
            err = memcpy(d, s, BLOCK_BYTES, _MEMCPY_DEFAULT, handles[i % n]) if up else \
                memcpy(s, d, BLOCK_BYTES, _MEMCPY_DEFAULT, handles[i % n])  # fmt: skip
            if err:
                raise RuntimeError(f"cudaMemcpyAsync: {err}")

    ways: dict[str, Callable[..., None]] = {
        "contiguous": contiguous,
        "views": views,
        "addresses": addresses,
        "addresses_2_streams": lambda *a: addresses(*a, n=2),
    }
    batch = getattr(lib, "cudaMemcpyBatchAsync", None)
    if batch is not None:
        major = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else 0

        def batched(dst: torch.Tensor, src: torch.Tensor, ids: tuple[int, ...], up: bool) -> None:
            pairs = _pairs(dst, src, ids)
            count = len(pairs)
            dsts = (ctypes.c_void_p * count)(*[d if up else s for d, s in pairs])
            srcs = (ctypes.c_void_p * count)(*[s if up else d for d, s in pairs])
            sizes = (ctypes.c_size_t * count)(*([BLOCK_BYTES] * count))
            attrs = _MemcpyAttributes(1, _MemLocation(0, 0), _MemLocation(0, 0), 0)  # source order: stream
            index = (ctypes.c_size_t * 1)(0)
            stream = ctypes.c_void_p(handles[0])
            if major >= 13:
                err = batch(dsts, srcs, sizes, ctypes.c_size_t(count), ctypes.byref(attrs), index,
                            ctypes.c_size_t(1), stream)  # fmt: skip
            else:
                fail = ctypes.c_size_t(0)
                err = batch(dsts, srcs, sizes, ctypes.c_size_t(count), ctypes.byref(attrs), index,
                            ctypes.c_size_t(1), ctypes.byref(fail), stream)  # fmt: skip
            if err:
                raise RuntimeError(f"cudaMemcpyBatchAsync: {err}")

        ways["batch"] = batched
    return ways


def measure(way: Callable[..., None], dst: torch.Tensor, src: torch.Tensor, ids: tuple[int, ...], up: bool,
            streams: list[torch.cuda.Stream], reps: int) -> dict[str, float]:  # fmt: skip
    """Median seconds from the first call to every stream's end, and of the calls alone."""
    total, calls = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(streams[0]):
            way(dst, src, ids, up)
        t1 = time.perf_counter()
        for s in streams:
            s.synchronize()
        total.append(time.perf_counter() - t0)
        calls.append(t1 - t0)
    return {"s": statistics.median(total[1:]), "calls_s": statistics.median(calls[1:])}


def check(way: Callable[..., None], dst: torch.Tensor, src: torch.Tensor, ids: tuple[int, ...],
          streams: list[torch.cuda.Stream]) -> bool:  # fmt: skip
    """Whether ``way`` put each source block where it belongs (host to device), checked on the device."""
    src.view(-1, BLOCK_BYTES)[:, :8].copy_(torch.arange(len(ids), dtype=torch.int64).view(-1, 1).view(torch.uint8))
    dst.fill_(0xFF)
    torch.cuda.synchronize()
    with torch.cuda.stream(streams[0]):
        way(dst, src, ids, True)
    torch.cuda.synchronize()
    got = dst.view(-1, BLOCK_BYTES)[list(ids), :8].cpu().view(torch.int64).view(-1)
    return bool(torch.equal(got, torch.arange(len(ids), dtype=torch.int64)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sources", nargs="+", default=["host_alloc", "shm_registered"],
                        choices=["host_alloc", "shm_registered"])  # fmt: skip
    args = parser.parse_args(argv)
    lib = cuda_runtime()
    if lib is None:
        raise RuntimeError("no CUDA runtime library loaded")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    ways = _ways(lib, streams)
    most = max(args.tokens) // TOKENS_PER_BLOCK
    pool = torch.empty(2 * most * BLOCK_BYTES, dtype=torch.uint8, device="cuda")
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
                      "python": sys.version.split()[0], "block_bytes": BLOCK_BYTES, "ways": list(ways),
                      "thp_shmem": _read("/sys/kernel/mm/transparent_hugepage/shmem_enabled"),
                      "command": " ".join(["python", "-m", "benchmarks.gpu_copy_calls", *sys.argv[1:]])}),
          flush=True)  # fmt: skip
    failures = 0
    for kind in args.sources:
        source = HostSource(kind, most * BLOCK_BYTES)
        try:
            for name, way in list(ways.items()):
                try:
                    exact = name == "contiguous" or check(
                        way, pool, source.tensor, scattered_block_ids(most, 7)[0], streams
                    )
                except RuntimeError as exc:  # the batch call's attributes, say, refused by this runtime
                    print(json.dumps({"source": kind, "way": name, "error": str(exc)}), flush=True)
                    del ways[name]
                    continue
                if not exact:
                    failures += 1
                    print(json.dumps({"source": kind, "way": name, "bit_exact": False}), flush=True)
            for tokens in args.tokens:
                blocks = tokens // TOKENS_PER_BLOCK
                ids = scattered_block_ids(most, 7)[0][:blocks]
                src = source.tensor[: blocks * BLOCK_BYTES]
                nbytes = blocks * BLOCK_BYTES
                row: dict[str, Any] = {"tokens": tokens, "source": kind, "blocks": blocks}
                for name, way in ways.items():
                    for up in (True, False):
                        got = measure(way, pool, src, ids, up, streams, args.reps)
                        direction = "h2d" if up else "d2h"
                        row[f"{name}_{direction}_gbps"] = round(nbytes / got["s"] / 1e9, 2)
                        row[f"{name}_{direction}_calls_ms"] = round(got["calls_s"] * 1e3, 2)
                print(json.dumps(row), flush=True)
        finally:
            source.close()
    print(json.dumps({"failures": failures}), flush=True)
    return 1 if failures else 0


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "unreadable"


if __name__ == "__main__":
    sys.exit(main())
