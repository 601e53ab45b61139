"""The cost guard: a hit is loaded only where loading it is not measured slower than computing it.

A load costs its securing (the scheduler's PREPARE_RETRIEVE: the server hands out and locks the
chunks, an L2 tier's prefetch included) plus its copy into the pool; computing costs the engine's
prefill. Both are measured in this engine process, as ``seconds = fixed + tokens / rate`` lines
fitted to the recent samples:

- securing: timed by the scheduler around each PREPARE;
- copying: timed by rank 0's worker (a synchronous load until its copies are done, an asynchronous
  one until the worker found it landed), so a busy copy engine shows;
- prefill: the device time of forward passes that compute at least ``MIN_PREFILL_SAMPLE_TOKENS``
  prompt tokens, from CUDA events around the forward; the batch's other work is in that time too, so
  the rate is a lower bound and the guard errs towards loading. Off CUDA nothing is measured; an
  operator may give the rate (``KVOFFLOAD_RECOMPUTE_TOKENS_PER_S``), which then wins.

Until both sides have been measured every hit is loaded (the connector's behaviour without a guard).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

WINDOW = 32
"""Samples kept per side: the newest ones, so the guard follows a copy engine that gets busy."""
MIN_PREFILL_SAMPLE_TOKENS = 256
"""A forward computing fewer prompt tokens is mostly decode: its rate says little about prefill."""


@dataclass(frozen=True)
class LinearCost:
    """``seconds = fixed_s + tokens / tokens_per_s``."""

    fixed_s: float
    tokens_per_s: float

    def seconds(self, tokens: int) -> float:
        return self.fixed_s + tokens / self.tokens_per_s

    def __add__(self, other: LinearCost) -> LinearCost:
        """Two steps one after the other (securing, then copying)."""
        return LinearCost(self.fixed_s + other.fixed_s, 1.0 / (1.0 / self.tokens_per_s + 1.0 / other.tokens_per_s))


def fit(samples: Sequence[tuple[int, float]]) -> LinearCost | None:
    """The least-squares line through ``(tokens, seconds)`` samples; a line through the origin where
    the sizes do not differ or the fit is not a cost (a negative fixed part or slope); None without
    samples."""
    usable = [(n, s) for n, s in samples if n > 0 and s >= 0]
    if not usable:
        return None
    total_n, total_s = sum(n for n, _ in usable), sum(s for _, s in usable)
    through_origin = LinearCost(0.0, total_n / total_s) if total_s > 0 else None
    mean_n, mean_s = total_n / len(usable), total_s / len(usable)
    spread = sum((n - mean_n) ** 2 for n, _ in usable)
    if spread == 0:
        return through_origin
    slope = sum((n - mean_n) * (s - mean_s) for n, s in usable) / spread
    fixed = mean_s - slope * mean_n
    if slope <= 0 or fixed < 0:
        return through_origin
    return LinearCost(fixed, 1.0 / slope)


def load_pays(tokens: int, load: LinearCost | None, recompute_tokens_per_s: float | None) -> bool:
    """Whether to load ``tokens`` rather than compute them: unless both costs are known and the load's
    is higher."""
    if load is None or recompute_tokens_per_s is None or recompute_tokens_per_s <= 0:
        return True
    return load.seconds(tokens) <= tokens / recompute_tokens_per_s


class LoadCosts:
    """The recent securing, copy and prefill samples of one engine (scheduler and rank 0's worker
    record into it from their threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._secured: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._copied: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self._prefill_rates: deque[float] = deque(maxlen=WINDOW)
        self._cold_forward_seen = False

    def secured(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._secured.append((tokens, seconds))

    def copied(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._copied.append((tokens, seconds))

    def computed(self, prompt_tokens: int, seconds: float) -> None:
        """One forward pass computed ``prompt_tokens`` prompt tokens in ``seconds`` of device time. The
        first such forward is not a sample: on a cold device (kernels loading, the allocator growing)
        it ran several times slower than the next on an H100 (140 ms against 29 for 4,096 tokens)."""
        if prompt_tokens >= MIN_PREFILL_SAMPLE_TOKENS and seconds > 0:
            with self._lock:
                if self._cold_forward_seen:
                    self._prefill_rates.append(prompt_tokens / seconds)
                self._cold_forward_seen = True

    def load_cost(self) -> LinearCost | None:
        """Securing plus copying, as measured; None until both were."""
        with self._lock:
            secured, copied = fit(self._secured), fit(self._copied)
        return secured + copied if secured is not None and copied is not None else None

    def recompute_tokens_per_s(self) -> float | None:
        """The median prefill rate of the measured forwards; None before one was measured."""
        with self._lock:
            rates = list(self._prefill_rates)
        return statistics.median(rates) if rates else None

    def load_pays(self, tokens: int, given_recompute_tokens_per_s: float | None = None) -> bool:
        """:func:`load_pays` with this engine's measured costs; the operator's prefill rate, if given,
        in place of the measured one."""
        rate = given_recompute_tokens_per_s or self.recompute_tokens_per_s()
        return load_pays(tokens, self.load_cost(), rate)
