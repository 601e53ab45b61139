"""Backoff, probe verdicts and the grace-period split."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.sidecar.lifecycle import (
    BackoffPolicy,
    HealthFacts,
    HealthLimits,
    Phase,
    crashes_in_a_row,
    judge_health,
    plan_drain,
    restart_delay,
)

pytestmark = pytest.mark.sidecar
POLICY = BackoffPolicy(base_seconds=0.5, cap_seconds=30.0, stable_after_seconds=60.0)
LIMITS = HealthLimits(wedged_after_seconds=30.0, start_budget_seconds=600.0, monitor_stale_seconds=30.0)


@pytest.mark.parametrize(("crashes", "delay"), [(1, 0.5), (2, 1.0), (3, 2.0), (6, 16.0), (7, 30.0), (500, 30.0)])
def test_restart_delay_doubles_up_to_the_cap(crashes: int, delay: float) -> None:
    assert restart_delay(crashes, POLICY) == delay


def test_a_stable_run_resets_the_crash_count() -> None:
    assert crashes_in_a_row(5, ran_seconds=3.0, policy=POLICY) == 6
    assert crashes_in_a_row(5, ran_seconds=60.0, policy=POLICY) == 1


def test_a_server_that_was_serving_restarts_at_once_and_only_failed_starts_back_off() -> None:
    assert crashes_in_a_row(7, ran_seconds=2.0, policy=POLICY, became_ready=True) == 0
    assert restart_delay(0, POLICY) == 0.0
    assert restart_delay(crashes_in_a_row(0, ran_seconds=1.0, policy=POLICY), POLICY) == 0.5


def facts(
    phase: Phase, alive: bool = True, ok: bool = False, since: float = 0.0, last_ok: float | None = None
) -> HealthFacts:
    return HealthFacts(
        phase=phase, server_alive=alive, checks_ok=ok, phase_since=since, last_ok_at=last_ok, monitor_tick_at=100.0
    )


@pytest.mark.parametrize(
    ("f", "now", "started", "ready", "live"),
    [
        (facts(Phase.RUNNING, ok=True, last_ok=99.0), 100.0, True, True, True),
        (facts(Phase.STARTING), 100.0, False, False, True),
        (facts(Phase.STARTING, since=0.0), 700.0, False, False, False),  # never healthy: wedged
        (facts(Phase.BACKOFF, alive=False), 100.0, False, False, True),  # supervised restart stays live
        (facts(Phase.RUNNING, ok=False, last_ok=90.0), 100.0, False, False, True),  # a blip
        (facts(Phase.RUNNING, ok=False, last_ok=60.0), 100.0, False, False, False),  # wedged
        (facts(Phase.DRAINING, ok=True, last_ok=99.0), 100.0, True, False, True),  # SIGTERM: not ready
        (facts(Phase.RUNNING, ok=True, last_ok=99.0), 131.0, False, False, False),  # monitor stalled
    ],
)
def test_probe_verdicts(f: HealthFacts, now: float, started: bool, ready: bool, live: bool) -> None:
    v = judge_health(f, now, LIMITS)
    assert (v.started, v.ready, v.live) == (started, ready, live), v.reason


@given(st.floats(0.1, 3600.0), st.floats(0.0, 1e6))
def test_drain_plan_fits_inside_the_grace_period(grace: float, received: float) -> None:
    plan = plan_drain(received, grace)
    assert received <= plan.drain_until <= plan.stop_until < received + grace + 1e-6
    assert plan.stop_until - plan.drain_until > 0
