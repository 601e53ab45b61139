"""Shared pieces of the CPU benchmarks: statistics, machine and version records, timing loops.

Pure functions (``summarize``, ``percentile``) are unit-tested; the rest reads the machine.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
VERSIONED_PACKAGES = ("torch", "lmcache", "kopf", "kubernetes", "prometheus_client", "pyzmq")


def best_ns_per_call(fn: Callable[[], object], calls: int, after_round: Callable[[], object], rounds: int = 5) -> float:
    """Fastest of ``rounds`` timed rounds of ``calls // rounds`` calls, in ns per call; ``after_round`` runs untimed."""
    per_round = calls // rounds
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(per_round):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / per_round)
        after_round()
    return best


def scattered_block_ids(nblocks: int, seed: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Two disjoint sets of ``nblocks`` block ids from ``range(2 * nblocks)``, shuffled (seeded).

    A pool that has served requests for a while hands out scattered blocks; with shuffled ids
    almost no two neighbours in a request are neighbours in the pool, so every block is its own
    copy (the worst case for block-granular DMA).
    """
    ids = list(range(2 * nblocks))
    random.Random(seed).shuffle(ids)
    return tuple(ids[:nblocks]), tuple(ids[nblocks:])


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between closest ranks; NaN when empty."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return float(ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo))


def summarize(samples: Sequence[float]) -> dict[str, float]:
    """``n``, ``p50``, ``p99``, ``min``, ``max``, ``mean`` of samples (same unit as the input)."""
    if not samples:
        return {"n": 0, "p50": math.nan, "p99": math.nan, "min": math.nan, "max": math.nan, "mean": math.nan}
    return {
        "n": len(samples),
        "p50": percentile(samples, 50),
        "p99": percentile(samples, 99),
        "min": float(min(samples)),
        "max": float(max(samples)),
        "mean": float(sum(samples) / len(samples)),
    }


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _mem_total_gib() -> float:
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return math.nan


def _binary_version(path: Path, *args: str) -> str:
    try:
        out = subprocess.run([str(path), *args], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unavailable"
    return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr).strip() else "unknown"


def machine_info() -> dict[str, Any]:
    """nproc, CPU model, memory, load average and OS of this machine."""
    return {
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_total_gib": _mem_total_gib(),
        "loadavg_at_start": list(os.getloadavg()),
        "os": platform.platform(),
    }


def versions(bin_dir: Path | None = None) -> dict[str, str]:
    """Python, the Python packages that matter here and the Kubernetes binaries' versions."""
    out = {"python": platform.python_version()}
    for name in VERSIONED_PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    if bin_dir is not None:
        out["kube-apiserver"] = _binary_version(bin_dir / "kube-apiserver", "--version")
        out["kwok"] = _binary_version(bin_dir / "kwok", "--version")
    return out


def command_line() -> str:
    """The command that produced these results, as a user would retype it."""
    return " ".join(["python", "-m", "benchmarks.run", *sys.argv[1:]]).strip()


@contextlib.contextmanager
def env_set(**values: str) -> Iterator[None]:
    """Set environment variables for the duration of the block."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def interleaved(
    variants: Sequence[tuple[str, Callable[[int], float | None]]], reps: int, warmup: int = 2
) -> dict[str, list[float]]:
    """Run every variant ``warmup + reps`` times, rotating the order each round (noise hits all alike).

    A variant is ``fn(i) -> seconds`` (it times its own critical section, so setup is excluded);
    warm-up rounds are discarded.
    """
    samples: dict[str, list[float]] = {name: [] for name, _ in variants}
    for i in range(warmup + reps):
        k = i % len(variants)
        for name, fn in [*variants[k:], *variants[:k]]:
            seconds = fn(i)
            if i >= warmup and seconds is not None:
                samples[name].append(seconds)
    return samples


def timed(fn: Callable[[], object]) -> float:
    """Seconds ``fn`` took (perf_counter)."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def standin_on_path() -> None:
    """The TensorRT-LLM stand-in (``tests/standin``) importable as ``tensorrt_llm``: the connector's
    hooks subclass its base classes, as they do TensorRT-LLM's in an engine."""
    from tests.support.trtllm_executor import STANDIN_PATH

    if STANDIN_PATH not in sys.path:
        sys.path.insert(0, STANDIN_PATH)
