"""COMMITs sent off the engine's path, and the count lookups wait on so they read this process's writes."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey


class PendingCommits:
    """COMMITs queued in this process and not yet answered; lookups wait for none to be left."""

    def __init__(self) -> None:
        self._count = 0
        self._idle = threading.Condition()

    def add(self) -> None:
        with self._idle:
            self._count += 1

    def done(self) -> None:
        with self._idle:
            self._count -= 1
            if self._count == 0:
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """True when none is pending (at once, or within ``timeout_s``)."""
        with self._idle:
            return self._idle.wait_for(lambda: self._count == 0, timeout=timeout_s)


PENDING_COMMITS = PendingCommits()


@dataclass(frozen=True)
class DeferredCommit:
    """A COMMIT the committer thread sends after the engine moved on."""

    operation: str
    transfer: Any
    key: IPCCacheServerKey
