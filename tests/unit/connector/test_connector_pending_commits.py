"""Deferred COMMITs: a lookup in the process waits until its own stores are published."""

from __future__ import annotations

import threading
import time

from kvoffload.connector.backends.commits import PendingCommits


def test_waiting_returns_at_once_when_nothing_is_pending() -> None:
    assert PendingCommits().wait_idle(0.0)


def test_waiting_ends_when_the_last_commit_is_answered() -> None:
    pending = PendingCommits()
    pending.add()
    pending.add()
    assert not pending.wait_idle(0.05)
    answered = threading.Timer(0.05, pending.done)
    pending.done()
    answered.start()
    started = time.monotonic()
    assert pending.wait_idle(5.0)
    assert time.monotonic() - started < 4.0


def test_waiting_gives_up_after_its_timeout() -> None:
    pending = PendingCommits()
    pending.add()
    started = time.monotonic()
    assert not pending.wait_idle(0.1)
    assert 0.09 <= time.monotonic() - started < 2.0
