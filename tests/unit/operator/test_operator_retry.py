"""The operator's own retry queue: backoff per key, newest action wins, success forgets."""

from __future__ import annotations

import pytest

from kvoffload.operator.api.retry import RETRY_MAX_DELAY_S, RetryQueue, retry_delay


def test_backoff_doubles_from_one_second_and_is_capped() -> None:
    assert [retry_delay(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    assert retry_delay(100) == RETRY_MAX_DELAY_S
    with pytest.raises(ValueError, match="attempt"):
        retry_delay(0)


def test_an_action_runs_once_when_due_and_not_again_until_rescheduled() -> None:
    queue = RetryQueue()
    ran: list[str] = []
    assert queue.schedule("a", lambda: ran.append("a"), now=100.0) == 1.0
    assert queue.take_due(100.5) == []
    for action in queue.take_due(101.0):
        action()
    assert ran == ["a"] and len(queue) == 1  # still pending: neither success nor a new failure yet
    assert queue.take_due(1e9) == []


def test_repeated_failures_grow_the_delay_and_success_resets_it() -> None:
    queue = RetryQueue()
    delays = [queue.schedule("k", lambda: None, now=0.0) for _ in range(4)]
    assert delays == [1.0, 2.0, 4.0, 8.0]
    queue.succeeded("k")
    assert len(queue) == 0
    assert queue.schedule("k", lambda: None, now=0.0) == 1.0


def test_the_newest_action_for_a_key_replaces_the_older_one() -> None:
    queue = RetryQueue()
    ran: list[str] = []
    queue.schedule("k", lambda: ran.append("old"), now=0.0)
    queue.schedule("k", lambda: ran.append("new"), now=0.0)
    queue.schedule("other", lambda: ran.append("other"), now=0.0)
    for action in queue.take_due(10.0):
        action()
    assert sorted(ran) == ["new", "other"]
