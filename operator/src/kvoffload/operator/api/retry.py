"""Retries for passes that failed on the API (timeout, 5xx, quota, RBAC not yet granted).

kopf's ``on.event`` handlers are fire-and-forget: a pass that fails is not run again until the
object changes. A workload whose status settled, or a policy whose engines are all scheduled,
may never change again, so the operator keeps its own queue: each failed key is retried with
exponential backoff until a pass succeeds (or a newer event's pass does).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

RETRY_FIRST_DELAY_S = 1.0
RETRY_MAX_DELAY_S = 30.0


def retry_delay(attempt: int, first: float = RETRY_FIRST_DELAY_S, cap: float = RETRY_MAX_DELAY_S) -> float:
    """Seconds to wait before retry number ``attempt`` (1-based): 1, 2, 4, ... capped at ``cap``."""
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return float(min(cap, first * 2 ** (attempt - 1)))


@dataclass
class _Pending:
    attempt: int
    due: float
    action: Callable[[], None]


@dataclass
class RetryQueue:
    """Failed passes by key; the newest action per key wins and its backoff keeps growing."""

    _pending: dict[Hashable, _Pending] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def schedule(self, key: Hashable, action: Callable[[], None], now: float) -> float:
        """Queue ``action`` for ``key``; returns the delay chosen."""
        with self._lock:
            previous = self._pending.get(key)
            attempt = previous.attempt + 1 if previous else 1
            delay = retry_delay(attempt)
            self._pending[key] = _Pending(attempt, now + delay, action)
        return delay

    def succeeded(self, key: Hashable) -> None:
        """A pass for ``key`` worked: forget its backoff."""
        with self._lock:
            self._pending.pop(key, None)

    def take_due(self, now: float) -> list[Callable[[], None]]:
        """Remove and return the actions due at ``now`` (the attempt count stays until success)."""
        with self._lock:
            due = [key for key, pending in self._pending.items() if pending.due <= now]
            actions = []
            for key in due:
                pending = self._pending[key]
                actions.append(pending.action)
                pending.due = float("inf")  # not taken again until it is rescheduled or succeeds
        return actions

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
