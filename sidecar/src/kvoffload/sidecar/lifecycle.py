"""Pure decisions of the sidecar's lifecycle: restart backoff, probe verdicts, drain.

The supervisor and the HTTP endpoints only gather facts (clock, child process state,
the last health check) and ask these functions what they mean.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(str, enum.Enum):
    """Where the supervised LMCache server is in its life."""

    STARTING = "starting"
    """Spawned, not yet healthy."""
    RUNNING = "running"
    """Has answered a health check since it was spawned."""
    BACKOFF = "backoff"
    """Exited unexpectedly; waiting before the next start."""
    DRAINING = "draining"
    """SIGTERM received: no new work, finishing in-flight work, then stopping."""
    STOPPED = "stopped"


@dataclass(frozen=True)
class BackoffPolicy:
    """Exponential restart backoff: ``base * 2**(n-1)`` seconds, capped; resets after a stable run."""

    base_seconds: float = 0.5
    cap_seconds: float = 30.0
    stable_after_seconds: float = 60.0
    """A server that ran this long before crashing starts the count again."""


def crashes_in_a_row(previous: int, ran_seconds: float, policy: BackoffPolicy, became_ready: bool = False) -> int:
    """The consecutive failed starts after a server exited that ran ``ran_seconds``.

    A server that became ready was not failing to start (it was killed or crashed while serving):
    the count is 0 and it restarts at once, its own start-up (about 4 s) bounding the rate. Only
    servers that never became ready back off.
    """
    if became_ready:
        return 0
    if ran_seconds >= policy.stable_after_seconds:
        return 1
    return previous + 1


def restart_delay(crashes: int, policy: BackoffPolicy) -> float:
    """Seconds to wait before restarting after ``crashes`` failed starts in a row (0: at once)."""
    if crashes <= 0:
        return 0.0
    exponent = min(crashes - 1, 32)
    return float(min(policy.cap_seconds, policy.base_seconds * 2**exponent))


@dataclass(frozen=True)
class HealthLimits:
    """How long the server may go without a good health check before liveness fails."""

    wedged_after_seconds: float = 30.0
    """A server that was healthy and has not answered for this long is wedged."""
    start_budget_seconds: float = 600.0
    """A spawned server that never answered for this long is wedged (eager L1 pinning is slow)."""
    monitor_stale_seconds: float = 30.0
    """The health monitor thread itself must have ticked within this."""


@dataclass(frozen=True)
class HealthFacts:
    """What the supervisor knows right now (times are monotonic seconds)."""

    phase: Phase
    server_alive: bool
    checks_ok: bool
    """The last check saw ``/healthcheck`` answer 200 and the request port accept TCP."""
    phase_since: float
    last_ok_at: float | None
    """When checks last passed during the current server's life, ``None`` if never."""
    monitor_tick_at: float


@dataclass(frozen=True)
class HealthVerdict:
    """Answers for the three kubelet probes."""

    started: bool
    ready: bool
    live: bool
    reason: str


def judge_health(facts: HealthFacts, now: float, limits: HealthLimits) -> HealthVerdict:
    """Startup, readiness and liveness for ``facts`` at ``now``.

    Ready only while the server answers and no drain is in progress. Live unless the
    server process is up but wedged, or the monitor stopped ticking: a supervised restart
    (backoff, starting again) stays live, so kubelet does not kill the pod for a crash the
    sidecar is already handling.
    """
    if now - facts.monitor_tick_at > limits.monitor_stale_seconds:
        return HealthVerdict(False, False, False, "health monitor stalled")
    if facts.phase in (Phase.DRAINING, Phase.STOPPED):
        return HealthVerdict(True, False, True, f"{facts.phase.value}")
    if facts.phase is Phase.BACKOFF or not facts.server_alive:
        return HealthVerdict(False, False, True, "server restarting")
    ready = facts.phase is Phase.RUNNING and facts.checks_ok
    if ready:
        return HealthVerdict(True, True, True, "ok")
    if facts.last_ok_at is None:
        if now - facts.phase_since > limits.start_budget_seconds:
            return HealthVerdict(False, False, False, "server never became healthy")
        return HealthVerdict(False, False, True, "server starting")
    if now - facts.last_ok_at > limits.wedged_after_seconds:
        return HealthVerdict(False, False, False, "server stopped answering health checks")
    return HealthVerdict(False, False, True, "server not answering health checks")


@dataclass(frozen=True)
class DrainPlan:
    """How the grace period is split on SIGTERM."""

    drain_until: float
    """Until then, wait for in-flight work to finish."""
    stop_until: float
    """Until then, wait for LMCache to stop after its SIGTERM; then SIGKILL."""


def plan_drain(received_at: float, grace_seconds: float) -> DrainPlan:
    """Split ``grace_seconds`` from ``received_at``: in-flight work first, then LMCache's own shutdown.

    LMCache closes in about 1.5 s on CPU; its share is a third of the grace (at most 10 s),
    and one second stays in reserve for the sidecar's own exit.
    """
    reserve = min(1.0, grace_seconds / 10)
    stop_share = min(10.0, (grace_seconds - reserve) / 3)
    drain_share = max(0.0, grace_seconds - reserve - stop_share)
    return DrainPlan(
        drain_until=received_at + drain_share,
        stop_until=received_at + drain_share + stop_share,
    )
