"""Runs the LMCache server as a child process: health monitoring, restarts with backoff, drain.

Thin effects only: the decisions (backoff, probe verdicts, the grace-period split, what
counts as in-flight work) live in ``lifecycle`` and ``metrics``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from kvoffload import contract

from .command import ServerCommand
from .lifecycle import (
    BackoffPolicy,
    HealthFacts,
    HealthLimits,
    HealthVerdict,
    Phase,
    crashes_in_a_row,
    judge_health,
    plan_drain,
    restart_delay,
)
from .metrics import SidecarMetricsState, inflight_work, transfer_state
from .parent_death import die_with_parent
from .settings import SidecarSettings
from .standby_handle import ServerProcess, Standby

log = logging.getLogger(__name__)

CHECK_TIMEOUT_SECONDS = 2.0
STANDBY_RETRY_SECONDS = 60.0
"""After a standby exited on its own, the next one waits this long (a broken one never spins)."""
POLL_READY_SECONDS = 5.0
POLL_NOT_READY_SECONDS = 0.1
"""A starting server is checked this often: one forked by the standby serves within about 0.1 s,
and a kill is counted as a crash or not by whether a check saw it ready."""


def shm_free_bytes(shm_name: str, mount: str = contract.SHM_MOUNT_PATH) -> int | None:
    """Free bytes in ``/dev/shm``, counting our own stale L1 segment (LMCache unlinks it on start)."""
    try:
        free = shutil.disk_usage(mount).free
    except OSError:
        return None
    bare = shm_name.lstrip("/")
    segment = bare if bare.startswith("lmcache_l1_pool_") else f"lmcache_l1_pool_{bare}"
    with contextlib.suppress(OSError):
        free += os.stat(os.path.join(mount, segment)).st_blocks * 512
    return free


# Loopback only: never through an HTTP(S)_PROXY the pod may have in its env.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float) -> tuple[int, bytes] | None:
    """Status and body of a GET, or ``None`` when nothing answered in time."""
    try:
        with _DIRECT.open(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except (OSError, ValueError):
        return None


def tcp_accepts(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class Supervisor:
    """Keeps one LMCache server running until asked to stop, then drains and stops it."""

    def __init__(
        self,
        settings: SidecarSettings,
        command_for_spawn: Callable[[], ServerCommand],
        backoff: BackoffPolicy | None = None,
        limits: HealthLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._command_for_spawn = command_for_spawn
        self._backoff = backoff or BackoffPolicy()
        self._limits = limits or HealthLimits()
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._check_now = threading.Event()
        """Set when a server is spawned: the monitor checks it at once, not after a ready server's 5 s."""
        self._stop_received_at: float | None = None
        self._proc: ServerProcess | None = None
        self._standby: Standby | None = None
        self._standby_retry_at = 0.0
        self._phase = Phase.STARTING
        self._phase_since = clock()
        self._spawned_at = clock()
        self._checks_ok = False
        self._last_ok_at: float | None = None
        self._monitor_tick_at = clock()
        self._restarts = 0
        self._crashes = 0
        self._lmcache_base = f"http://127.0.0.1:{settings.lmcache_http_port}"

    # --- read side (HTTP threads) ------------------------------------------------
    def verdict(self) -> HealthVerdict:
        """The probes' answer now."""
        with self._lock:
            facts = HealthFacts(
                phase=self._phase,
                server_alive=self._proc is not None and self._proc.poll() is None,
                checks_ok=self._checks_ok,
                phase_since=self._phase_since,
                last_ok_at=self._last_ok_at,
                monitor_tick_at=self._monitor_tick_at,
            )
        return judge_health(facts, self._clock(), self._limits)

    def metrics_state(self) -> SidecarMetricsState:
        """The sidecar's own numbers for ``/metrics``."""
        with self._lock:
            up = self._checks_ok and self._phase in (Phase.RUNNING, Phase.DRAINING)
            restarts = self._restarts
        answer = http_get(self._lmcache_base + contract.LMCACHE_PATH_STATUS, CHECK_TIMEOUT_SECONDS) if up else None
        transfers = transfer_state(answer[1]) if answer is not None and answer[0] == 200 else None
        return SidecarMetricsState(server_restarts=restarts, server_up=up, config=self.settings.describe(),
                                   transfers=transfers)  # fmt: skip

    def lmcache_metrics_text(self) -> str | None:
        """LMCache's own exposition, ``None`` when the server is not up to answer."""
        with self._lock:
            alive = self._proc is not None and self._proc.poll() is None
        if not alive:
            return None
        answer = http_get(self._lmcache_base + contract.PATH_METRICS, CHECK_TIMEOUT_SECONDS)
        if answer is None or answer[0] != 200:
            return None
        return answer[1].decode("utf-8", "replace")

    @property
    def server_pid(self) -> int | None:
        """PID of the current LMCache server process, if one runs."""
        with self._lock:
            return self._proc.pid if self._proc is not None else None

    # --- control -------------------------------------------------------------------
    def request_stop(self) -> None:
        """Begin the drain (safe to call from a signal handler)."""
        if self._stop_received_at is None:
            self._stop_received_at = self._clock()
        self._stop.set()

    def run(self) -> int:
        """Supervise until stopped; returns the sidecar's exit code."""
        monitor = threading.Thread(target=self._monitor, name="kvo-health-monitor", daemon=True)
        monitor.start()
        self._spawn()
        while True:
            if self._stop.is_set():
                return self._drain_and_stop()
            proc = self._proc
            assert proc is not None
            code = proc.poll()
            if code is None:
                self._keep_standby()
                self._stop.wait(0.2)
                continue
            ran = self._clock() - self._spawned_at
            with self._lock:
                became_ready = self._last_ok_at is not None
            self._crashes = crashes_in_a_row(self._crashes, ran, self._backoff, became_ready)
            delay = restart_delay(self._crashes, self._backoff)
            log.warning(
                "event=server_exited pid=%d code=%s ran_s=%.1f crashes_in_a_row=%d restart_in_s=%.1f",
                proc.pid,
                code,
                ran,
                self._crashes,
                delay,
            )
            self._set_phase(Phase.BACKOFF)
            if self._stop.wait(delay):
                return self._drain_and_stop()
            with self._lock:
                self._restarts += 1
            self._spawn()

    # --- effects ---------------------------------------------------------------------
    def _set_phase(self, phase: Phase) -> None:
        with self._lock:
            if self._phase is not phase:
                self._phase = phase
                self._phase_since = self._clock()
            if phase is not Phase.RUNNING:
                self._checks_ok = False

    def _spawn(self) -> None:
        command = self._command_for_spawn()
        proc = self._promote_standby(command)
        if proc is None:
            proc = subprocess.Popen(list(command.argv), env=command.env, preexec_fn=die_with_parent)
        with self._lock:
            self._proc = proc
            self._spawned_at = self._clock()
            self._last_ok_at = None
            self._checks_ok = False
            self._phase = Phase.STARTING
            self._phase_since = self._spawned_at
        self._check_now.set()
        log.info(
            "event=server_started pid=%d restarts=%d uses_shm=%s argv=%s",
            proc.pid,
            self._restarts,
            command.uses_shm,
            " ".join(command.argv[1:]),
        )

    def _keep_standby(self) -> None:
        """Once the server is ready, have a standby beside it (spawned from the main loop: see
        ``die_with_parent``); it stays through promotions, forking each new server."""
        if not self.settings.warm_standby or (self._standby is not None and self._standby.alive()):
            return
        if self._standby is not None:  # it exited on its own: try again later, not every tick
            log.warning("event=standby_exited pid=%d", self._standby.pid)
            self._stop_standby()
            self._standby_retry_at = self._clock() + STANDBY_RETRY_SECONDS
        with self._lock:
            # A starting server goes first: on few cores a standby's imports would slow it.
            if self._last_ok_at is None or self._clock() < self._standby_retry_at:
                return
        command = self._command_for_spawn()
        if command.lmcache_arguments is None:  # not LMCache's server (tests run stand-ins): nothing to stand in for
            self._standby_retry_at = self._clock() + STANDBY_RETRY_SECONDS
            return
        self._standby = Standby(command.argv[0], command.env, die_with_parent)
        log.info("event=standby_started pid=%d", self._standby.pid)

    def _promote_standby(self, command: ServerCommand) -> ServerProcess | None:
        """A server forked by the standby for ``command``; None (and no standby left) when there is
        none that can: not started, exited, or started with another environment."""
        standby, arguments = self._standby, command.lmcache_arguments
        if standby is None:
            return None
        if arguments is not None and standby.alive() and standby.env == dict(command.env):
            warm = standby.warm
            server = standby.serve(arguments)
            if server is not None:
                log.info("event=standby_promoted pid=%d server=%d warm=%s", standby.pid, server.pid, warm)
                return server
        self._stop_standby()
        return None

    def _stop_standby(self) -> None:
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.stop()

    def _check(self) -> bool:
        answer = http_get(self._lmcache_base + "/healthcheck", CHECK_TIMEOUT_SECONDS)
        if answer is None or answer[0] != 200:
            return False
        return tcp_accepts("127.0.0.1", self.settings.request_port, CHECK_TIMEOUT_SECONDS)

    def _monitor(self) -> None:
        while True:
            with self._lock:
                proc, phase = self._proc, self._phase
            alive = proc is not None and proc.poll() is None
            ok = alive and phase in (Phase.STARTING, Phase.RUNNING, Phase.DRAINING) and self._check()
            now = self._clock()
            with self._lock:
                if self._proc is proc:  # ignore a check that raced with a respawn
                    self._checks_ok = ok
                    if ok:
                        self._last_ok_at = now
                        if self._phase is Phase.STARTING:
                            self._phase = Phase.RUNNING
                            self._phase_since = now
                            log.info("event=server_ready pid=%d", proc.pid if proc else -1)
                self._monitor_tick_at = now
                if self._phase is Phase.STOPPED:
                    return
            self._check_now.wait(POLL_READY_SECONDS if ok else POLL_NOT_READY_SECONDS)
            self._check_now.clear()

    def _drain_and_stop(self) -> int:
        received = self._stop_received_at if self._stop_received_at is not None else self._clock()
        plan = plan_drain(received, self.settings.grace_seconds)
        self._set_phase(Phase.DRAINING)
        proc = self._proc
        log.info("event=drain_started grace_s=%.1f", self.settings.grace_seconds)
        if proc is not None and proc.poll() is None:
            while self._clock() < plan.drain_until:
                text = self.lmcache_metrics_text()
                pending = inflight_work(text) if text is not None else 0
                if pending == 0:
                    break
                log.info("event=drain_waiting inflight=%d", pending)
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=max(0.0, plan.stop_until - self._clock()))
                log.info("event=server_stopped pid=%d code=%s", proc.pid, code)
            except subprocess.TimeoutExpired:
                log.warning("event=server_killed pid=%d reason=grace_exhausted", proc.pid)
                proc.kill()
                proc.wait()
        self._stop_standby()  # after the server: a server it forked dies with it
        self._set_phase(Phase.STOPPED)
        log.info("event=sidecar_stopped restarts=%d", self._restarts)
        return 0
