"""Log lines a peer can cause, on a budget: a refused handshake or a malformed request is logged,
but a peer that repeats it thousands of times a second gets a few lines and a count, not a flood."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

LINES_PER_INTERVAL = 10
INTERVAL_S = 60.0


class LogBudget:
    """At most ``lines`` lines per ``interval_s`` through ``logger``; the lines over budget are
    counted, and the next line that goes out says how many with ``suppressed=N``."""

    def __init__(
        self,
        logger: logging.Logger,
        lines: int = LINES_PER_INTERVAL,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger, self._lines, self._interval_s, self._clock = logger, lines, interval_s, clock
        self._lock = threading.Lock()
        self._window_start = clock()
        self._used = 0
        self._suppressed = 0

    def log(self, level: int, message: str, *args: object, exc_info: bool = False) -> bool:
        """Log ``message % args`` at ``level`` if the budget allows; False when it was suppressed."""
        if not self._logger.isEnabledFor(level):
            return False
        with self._lock:
            now = self._clock()
            if now - self._window_start >= self._interval_s:
                self._window_start, self._used = now, 0
            if self._used >= self._lines:
                self._suppressed += 1
                return False
            self._used += 1
            suppressed, self._suppressed = self._suppressed, 0
        if suppressed:
            message, args = f"{message} suppressed=%d", (*args, suppressed)
        self._logger.log(level, message, *args, exc_info=exc_info)
        return True

    def warning(self, message: str, *args: object) -> bool:
        return self.log(logging.WARNING, message, *args)
