"""The supervisor's drain against a stand-in server: in-flight work first, then SIGTERM, within grace."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from kvoffload import contract
from kvoffload.sidecar import supervisor as supervisor_module
from kvoffload.sidecar.command import ServerCommand
from kvoffload.sidecar.lifecycle import HealthLimits
from kvoffload.sidecar.settings import load_settings
from kvoffload.sidecar.supervisor import Supervisor
from tests.support.sidecar_harness import free_port, wait_for

pytestmark = pytest.mark.sidecar
FAKE = Path(__file__).with_name("fake_lmcache.py")


def _supervisor(state: Path, grace: float, limits: HealthLimits | None = None) -> Supervisor:
    settings = load_settings(
        {
            contract.ENV_REQUEST_PORT: str(free_port()),
            contract.ENV_LMCACHE_HTTP_PORT: str(free_port()),
            contract.ENV_SIDECAR_HTTP_PORT: str(free_port()),
            contract.ENV_GRACE_SECONDS: str(grace),
        },
        None,
    )
    argv = (sys.executable, str(FAKE), str(settings.lmcache_http_port), str(settings.request_port), str(state))
    return Supervisor(settings, lambda: ServerCommand(argv=argv, env=dict(os.environ), uses_shm=False), limits=limits)


def _run(supervisor: Supervisor) -> tuple[threading.Thread, list[int]]:
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(supervisor.run()), daemon=True)
    thread.start()
    try:
        wait_for(lambda: supervisor.verdict().ready, 60, "stand-in server ready")
    except BaseException:
        _stop(supervisor, thread)
        raise
    return thread, codes


def _stop(supervisor: Supervisor, thread: threading.Thread) -> None:
    """Teardown: the drain stops the stand-in (SIGKILL at the latest)."""
    supervisor.request_stop()
    thread.join(timeout=60)


def test_drain_waits_for_inflight_work_then_stops_the_server(tmp_path: Path) -> None:
    supervisor = _supervisor(tmp_path, grace=30)
    thread, codes = _run(supervisor)
    try:
        supervisor.request_stop()
        wait_for(lambda: not supervisor.verdict().ready, 10, "readiness to drop")
        assert supervisor.verdict().live
        assert not (tmp_path / "sigterm").exists(), "no SIGTERM while work is in flight"
        (tmp_path / "done").write_text("")
        thread.join(timeout=30)
    finally:
        _stop(supervisor, thread)
    assert codes == [0]
    assert (tmp_path / "sigterm").read_text() == "True"


def test_drain_gives_up_on_stuck_work_within_the_grace_period(tmp_path: Path) -> None:
    supervisor = _supervisor(tmp_path, grace=4)
    thread, codes = _run(supervisor)
    supervisor.request_stop()
    thread.join(timeout=4)
    assert not thread.is_alive(), "the sidecar must finish within its grace period"
    assert codes == [0]
    assert (tmp_path / "sigterm").read_text() == "False"


def test_a_wedged_server_fails_liveness_and_recovers(tmp_path: Path) -> None:
    limits = HealthLimits(wedged_after_seconds=3.0, start_budget_seconds=60.0, monitor_stale_seconds=30.0)
    supervisor = _supervisor(tmp_path, grace=10, limits=limits)
    thread, _ = _run(supervisor)
    try:
        pid = supervisor.server_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # alive but answering nothing: wedged
        try:
            wait_for(lambda: not supervisor.verdict().ready, 30, "readiness to drop")
            wait_for(lambda: not supervisor.verdict().live, 30, "liveness to fail")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: supervisor.verdict().ready and supervisor.verdict().live, 30, "recovery")
        assert supervisor.server_pid == pid, "the supervisor leaves a wedged server to kubelet"
    finally:
        _stop(supervisor, thread)


def test_a_restarted_server_is_checked_at_once_not_after_the_ready_poll_interval(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The monitor sleeps long between checks of a ready server; a server spawned meanwhile (after
    a crash) is checked at once, so readiness, the next standby and the crash count follow it."""
    monkeypatch.setattr(supervisor_module, "POLL_READY_SECONDS", 3600.0)
    supervisor = _supervisor(tmp_path, grace=5)
    thread, _ = _run(supervisor)
    try:
        old = supervisor.server_pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: supervisor.server_pid not in (None, old), 30, "the restart")
        wait_for(lambda: supervisor.verdict().ready, 30, "the restarted server seen ready")
    finally:
        (tmp_path / "done").write_text("")
        _stop(supervisor, thread)
