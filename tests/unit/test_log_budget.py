"""Log lines a peer can cause are on a budget: a few per interval, then a count carried by the next
line that goes out; the cache server's CURVE refusals use it."""

from __future__ import annotations

import logging

import pytest

from kvoffload.lmcache_guard.curve import AllowedClients
from kvoffload.log_budget import LINES_PER_INTERVAL, LogBudget

LOGGER = "kvoffload.test_log_budget"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_lines_over_the_budget_are_counted_and_the_next_line_after_the_interval_says_how_many(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    budget = LogBudget(logging.getLogger(LOGGER), lines=3, interval_s=10.0, clock=clock)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sent = [budget.log(logging.WARNING, "event=refused n=%d", n) for n in range(100)]
        assert sent == [True] * 3 + [False] * 97
        clock.now = 9.9
        assert not budget.warning("event=refused n=%d", 100)
        clock.now = 10.0
        assert budget.warning("event=refused n=%d", 101)
        assert budget.warning("event=refused n=%d", 102)
    assert _lines(caplog) == ["event=refused n=0", "event=refused n=1", "event=refused n=2",
                              "event=refused n=101 suppressed=98", "event=refused n=102"]  # fmt: skip


def test_a_level_the_logger_drops_spends_no_budget(caplog: pytest.LogCaptureFixture) -> None:
    budget = LogBudget(logging.getLogger(LOGGER), lines=1, clock=_Clock())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert not budget.log(logging.DEBUG, "event=quiet")
        assert budget.warning("event=loud")
    assert _lines(caplog) == ["event=loud"]


def test_a_line_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    budget = LogBudget(logging.getLogger(LOGGER), clock=_Clock())
    with caplog.at_level(logging.INFO, logger=LOGGER):
        try:
            raise ValueError("boom")
        except ValueError:
            budget.log(logging.ERROR, "event=failed", exc_info=True)
    assert caplog.records[-1].exc_info is not None


def test_a_stranger_retrying_its_curve_handshake_gets_a_few_warnings_not_one_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    known = "k" * 40
    clients = AllowedClients(frozenset({known}))
    with caplog.at_level(logging.INFO, logger="kvoffload.lmcache_guard"):
        assert clients.callback("kvoffload", known.encode())
        refused = [clients.callback("kvoffload", b"s" * 40) for _ in range(10_000)]
    assert not any(refused)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert 1 <= len(warnings) <= LINES_PER_INTERVAL, len(warnings)
    assert warnings[0] == "event=cache_client_refused reason=unknown_key domain=kvoffload"
