"""The CUDA runtime's copy calls the connector issues from addresses: ``cudaMemcpy2DAsync`` (layer
spans) and ``cudaMemcpyBatchAsync`` (every block run of a load or a store in one call).

One DMA per scattered 4 MiB block reaches 96.3-96.8% of one contiguous copy however the calls are
issued; one batched call of the same copies 97.5-99.0%, and its host time is a fraction of a call
per block (H100, docs/benchmarks.md, "Copy calls"). The batch call exists from CUDA 12.8 on (13.0
dropped its ``failIdx`` argument); where the runtime or the driver lacks it, callers issue a call per
run. The runtime is the one torch already loaded.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import threading
from collections.abc import Sequence

logger = logging.getLogger("kvoffload.connector")

MEMCPY_DEFAULT = 4
"""``cudaMemcpyDefault``: the direction from the pointers (unified addressing)."""
_SRC_ACCESS_ORDER_STREAM = 1
"""``cudaMemcpySrcAccessOrderStream``: the source is read in stream order, as ``cudaMemcpyAsync`` does."""
_BATCH_FROM_VERSION = 12080


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


@functools.cache
def runtime() -> ctypes.CDLL | None:
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


def _version(lib: ctypes.CDLL) -> int:
    version = ctypes.c_int(0)
    return version.value if lib.cudaRuntimeGetVersion(ctypes.byref(version)) == 0 else 0


class BatchedCopies:
    """``cudaMemcpyBatchAsync`` where this runtime and driver have it; off for good after the first
    call they refuse (the caller then issues its copies one by one, as before)."""

    def __init__(self) -> None:
        lib = runtime()
        self._fn = None
        self._with_fail_index = False
        if lib is not None and hasattr(lib, "cudaMemcpyBatchAsync"):
            version = _version(lib)
            if version >= _BATCH_FROM_VERSION:
                self._fn = lib.cudaMemcpyBatchAsync
                self._fn.restype = ctypes.c_int
                self._with_fail_index = version < 13000
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return self._fn is not None

    def issue(self, copies: Sequence[tuple[int, int, int]], stream: int) -> bool:
        """Issue ``copies`` (destination address, source address, bytes) on ``stream`` in one call,
        in stream order. False when the call is not available or was refused: nothing to wait for
        then, and issuing the same copies again is harmless."""
        fn = self._fn
        if fn is None or not copies:
            return fn is not None
        count = len(copies)
        dsts = (ctypes.c_void_p * count)(*[c[0] for c in copies])
        srcs = (ctypes.c_void_p * count)(*[c[1] for c in copies])
        sizes = (ctypes.c_size_t * count)(*[c[2] for c in copies])
        attrs = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(0, 0), _MemLocation(0, 0), 0)
        first = (ctypes.c_size_t * 1)(0)
        if self._with_fail_index:
            failed_at = ctypes.c_size_t(0)
            status = fn(dsts, srcs, sizes, ctypes.c_size_t(count), ctypes.byref(attrs), first, ctypes.c_size_t(1),
                        ctypes.byref(failed_at), ctypes.c_void_p(stream))  # fmt: skip
        else:
            status = fn(dsts, srcs, sizes, ctypes.c_size_t(count), ctypes.byref(attrs), first, ctypes.c_size_t(1),
                        ctypes.c_void_p(stream))  # fmt: skip
        if status == 0:
            return True
        with self._lock:
            self._fn = None  # refused (an older driver, say): the per-run copies from now on
        logger.warning(
            "event=batched_copies_off status=%d detail=cudaMemcpyBatchAsync refused; copying run by run", status
        )
        lib = runtime()
        if lib is not None:
            lib.cudaGetLastError()  # a refused call leaves no error for torch's next check to report
        return False


@functools.cache
def batched_copies() -> BatchedCopies:
    """This process's batched-copy caller."""
    return BatchedCopies()
