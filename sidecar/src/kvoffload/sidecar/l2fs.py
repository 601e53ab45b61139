"""Keeping a sized filesystem L2 tier within its size across LMCache server restarts.

LMCache's ``fs_native`` adapter bounds only what the running server wrote: its usage
count starts at zero, so files left by an earlier server are invisible to its eviction.
With the tier on an ``emptyDir`` whose ``sizeLimit`` is the tier size, going over means
kubelet evicts the pod. So before each start the sidecar (LMCache not running) trims the
oldest files until at most ``KEEP_RATIO`` of the size is left, and gives LMCache the rest
as its capacity: old files + LMCache's share <= size.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)

KEEP_RATIO = 0.5
DATA_SUFFIX = ".data"


@dataclass(frozen=True)
class CacheFile:
    """One KV file of the tier."""

    name: str
    size: int
    mtime: float


@dataclass(frozen=True)
class TrimPlan:
    """Files to delete before a start, and the capacity left for the new server."""

    delete: tuple[str, ...]
    kept_bytes: int
    capacity_bytes: int


def plan_trim(files: Iterable[CacheFile], size_bytes: int, keep_ratio: float = KEEP_RATIO) -> TrimPlan:
    """Oldest-first deletions that leave at most ``keep_ratio * size_bytes``; the rest is LMCache's."""
    ordered = sorted(files, key=lambda f: (f.mtime, f.name))
    total = sum(f.size for f in ordered)
    budget = int(size_bytes * keep_ratio)
    delete: list[str] = []
    for f in ordered:
        if total <= budget:
            break
        delete.append(f.name)
        total -= f.size
    return TrimPlan(delete=tuple(delete), kept_bytes=total, capacity_bytes=size_bytes - total)


def scan(directory: str) -> list[CacheFile]:
    """The tier's KV files (``*.data`` directly in ``directory``); none when it does not exist yet."""
    found: list[CacheFile] = []
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return found
    for entry in entries:
        if entry.name.endswith(DATA_SUFFIX) and entry.is_file(follow_symlinks=False):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            found.append(CacheFile(entry.name, st.st_size, st.st_mtime))
    return found


def trim_before_start(directory: str, size_bytes: int) -> int:
    """Apply ``plan_trim`` to ``directory``; returns the capacity (bytes) to give LMCache."""
    plan = plan_trim(scan(directory), size_bytes)
    for name in plan.delete:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))
    if plan.delete or plan.kept_bytes:
        log.info(
            "event=l2_fs_trimmed deleted=%d kept_bytes=%d capacity_bytes=%d",
            len(plan.delete),
            plan.kept_bytes,
            plan.capacity_bytes,
        )
    return plan.capacity_bytes
