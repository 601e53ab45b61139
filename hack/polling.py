"""Polling for the developer tooling: wait until a condition holds, or fail naming it.

The journey, the workload helpers and the tests all wait the same way; this module sits below them
all (it imports nothing of ``hack``), so none of them has to import another to wait.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class WaitTimedOut(RuntimeError):
    """A polled condition did not hold in time; the message names it and the last value seen."""


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    """Poll until ``predicate`` returns something truthy, else raise naming ``what``."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise WaitTimedOut(f"timed out after {timeout:.0f} s waiting for {what} (last: {str(last)[:300]})")
