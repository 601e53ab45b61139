"""The transfer context registered with an LMCache server, the shared-memory segment it mapped, and
the replaced ones that stay mapped while something may still read them.

A segment is named by ``(name, inode)``: a restarted server creates a new segment under the same
name. A replaced context stays mapped until the end of the engine's iteration, or ``RETIRED_GRACE_S``
when the engine is idle, and in any case while copies are in flight or a load secured in its
segment is open (rank 0 counts them): those may still copy from it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from typing import Any

from kvoffload.connector.backends.commits import Segment
from kvoffload.connector.lmcache_seam import shm_segment_name

logger = logging.getLogger("kvoffload.connector")

SHM_DIR = "/dev/shm"
RETIRED_GRACE_S = 10.0
COMMIT_AWAITS_REGISTRATION_S = 15.0
"""How long after a reset COMMITs queued before it wait for the next registration, which says
whether the server that prepared them is still there (same segment: send them there) or gone (drop
them). Dropping one for a live server would keep its reservation, and LMCache would refuse to store
those chunks again until the reservation's write lock expires (600 s by default). One deadline for
all of them: a long outage holds the queue this long once, not once per COMMIT."""


def segment_of(transfer: Any) -> Segment | None:
    """(segment name, inode) of the server L1 segment a transfer context mapped; None in pickle mode."""
    name = shm_segment_name(transfer)
    if not name:
        return None
    try:
        return name, os.stat(os.path.join(SHM_DIR, name.lstrip("/"))).st_ino
    except OSError:
        return name, -1


class Segments:
    """The current transfer context (under ``lock``, which transfers hold while they use it) and
    the retired ones (under a lock of their own: the heartbeat and the engine both close them)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._registered = threading.Condition(self.lock)
        """Notified when a context is registered (or the backend closes): a COMMIT queued during a
        reset waits on it to learn whether its server is still there."""
        self.transfer: Any = None
        self.segment: Segment | None = None
        self.generation = 0
        """How many transfer contexts were registered."""
        self._closing = False
        self._lost_at = 0.0
        """When a reset last dropped the transfer context (monotonic)."""
        self._retired: list[tuple[Any, Segment | None, float]] = []
        self._retired_lock = threading.Lock()
        self._secured_open: Counter[Segment] = Counter()
        """Secured loads handed out and not yet given back, per segment."""
        self._copies_in_flight = 0
        """Stores whose copies were issued and not yet waited for, and asynchronous loads announced
        and not yet finished or dropped: while any is, no retired segment is unmapped."""

    # --- the current context (callers hold ``lock``) ------------------------------------
    def install(self, transfer: Any) -> None:
        """Make a newly registered context current (``lock`` held); the one it replaces is retired."""
        old, old_segment = self.transfer, self.segment
        self.transfer, self.segment = transfer, segment_of(transfer)
        self.generation += 1
        self._registered.notify_all()
        if old is not None:
            self.retire(old, old_segment)

    def drop(self) -> None:
        """The connection was reset (``lock`` held): the context goes, retired until nothing reads it."""
        transfer, segment = self.transfer, self.segment
        self.transfer, self.segment = None, None
        if transfer is not None:
            self._lost_at = time.monotonic()
            self.retire(transfer, segment)

    def replaced_on_server(self) -> bool:
        """Whether the server's segment is no longer the one mapped (the server restarted)."""
        segment = self.segment
        if segment is None:
            return False
        try:
            return os.stat(os.path.join(SHM_DIR, segment[0].lstrip("/"))).st_ino != segment[1]
        except OSError:
            return True

    def commit_target(self, transfer: Any, segment: Segment | None) -> Any:
        """The context to send a COMMIT prepared on ``transfer`` in ``segment`` through: that one while
        it is current; the current one where it was replaced on the same server segment (a
        re-registration with the server that prepared it: without the COMMIT it would keep the
        reservation, and refuse to store those chunks again, for good); None once that server is
        gone. During a reset it waits for the next registration, which tells which."""
        if transfer is None and segment is None:
            return None
        with self._registered:
            wait_s = self._lost_at + COMMIT_AWAITS_REGISTRATION_S - time.monotonic()
            self._registered.wait_for(lambda: self.transfer is not None or self._closing, timeout=max(0.0, wait_s))
            current, current_segment = self.transfer, self.segment
        if current is None:
            return None
        if transfer is current or (segment is not None and segment == current_segment):
            return current
        return None

    def is_current(self, transfer: Any) -> bool:
        with self.lock:
            return transfer is self.transfer

    def mapping(self, segment: Segment) -> Any:
        """The context (current or retired) that maps ``segment``, or None."""
        if segment == self.segment:
            return self.transfer
        with self._retired_lock:
            return next((t for t, s, _ in self._retired if s == segment), None)

    def stop_waiting(self) -> None:
        """The backend closes: COMMITs waiting for a registration give up."""
        with self._registered:
            self._closing = True
            self._registered.notify_all()

    def detach(self) -> Any:
        """Unmap every retired context nothing reads and hand back the current one (now detached)."""
        self.close_retired(0.0)
        with self.lock:
            transfer, self.transfer = self.transfer, None
        return transfer

    # --- retired contexts ------------------------------------------------------------------
    def retire(self, transfer: Any, segment: Segment | None) -> None:
        """Keep a replaced context mapped for a while (secured loads and copies may still read it)."""
        with self._retired_lock:
            self._retired.append((transfer, segment, time.monotonic()))

    @property
    def any_retired(self) -> bool:
        return bool(self._retired)

    def close_retired(self, older_than_s: float) -> None:
        """Unmap the retired contexts older than ``older_than_s`` that nothing may read any more."""
        with self._retired_lock:
            if self._copies_in_flight:  # copies may still use a retired segment
                return
            now = time.monotonic()
            keep = []
            for transfer, segment, since in self._retired:
                if now - since < older_than_s or (segment is not None and self._secured_open[segment] > 0):
                    keep.append((transfer, segment, since))
                    continue
                try:
                    transfer.close()
                except Exception:  # a view still exported: try again next time
                    logger.debug("event=retired_close_failed segment=%s", segment, exc_info=True)
                    keep.append((transfer, segment, since))
            self._retired = keep

    def secured_opened(self, segment: Segment) -> None:
        """A load secured in ``segment`` was handed out: the segment stays mapped until it is given back."""
        with self._retired_lock:
            self._secured_open[segment] += 1

    def secured_closed(self, segment: Segment) -> None:
        with self._retired_lock:
            self._secured_open[segment] -= 1
            if self._secured_open[segment] <= 0:
                del self._secured_open[segment]

    def copies_started(self) -> None:
        """Copies that may read or write a segment are (or will be) in flight: none is unmapped."""
        with self._retired_lock:
            self._copies_in_flight += 1

    def copies_finished(self, count: int = 1) -> None:
        with self._retired_lock:
            self._copies_in_flight -= count
