"""The supervisor's side of the warm standby (``kvoffload.sidecar.standby``): the process, what it
reported, and a handle for each server it forked that behaves like the ``subprocess.Popen`` of a
cold-started one (``pid``, ``poll``, ``wait``, ``send_signal``, ``kill``)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from .standby_wire import EXITED, SERVING, WARM

log = logging.getLogger("kvoffload.sidecar.supervisor")

STANDBY_MODULE = "kvoffload.sidecar.standby"
SERVING_REPORT_TIMEOUT_S = 30.0
"""How long a promotion waits for the standby to say it forked (its warm-up may still run)."""


class ServerProcess(Protocol):
    """What the supervisor needs of a server process, cold-started or forked by the standby."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class Standby:
    """A running standby process and what it has reported so far (read on its own thread)."""

    def __init__(self, python: str, env: Mapping[str, str], preexec_fn: Callable[[], None]) -> None:
        self.env = dict(env)
        self._proc = subprocess.Popen(
            [python, "-m", STANDBY_MODULE], env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            preexec_fn=preexec_fn,
        )  # fmt: skip
        self._cond = threading.Condition()
        self._warm = False
        self._serving: list[int] = []
        self._exits: dict[int, int] = {}
        self._gone = False
        threading.Thread(target=self._read_reports, name="kvo-standby-reports", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def warm(self) -> bool:
        with self._cond:
            return self._warm

    def alive(self) -> bool:
        return self._proc.poll() is None

    def _read_reports(self) -> None:
        assert self._proc.stdout is not None
        for raw in self._proc.stdout:
            words = raw.decode("utf-8", "replace").split()
            with self._cond:
                if words == [WARM]:
                    self._warm = True
                    log.info("event=standby_warm pid=%d", self._proc.pid)
                elif len(words) == 2 and words[0] == SERVING:
                    self._serving.append(int(words[1]))
                elif len(words) == 3 and words[0] == EXITED:
                    self._exits[int(words[1])] = int(words[2])
                self._cond.notify_all()
        self._proc.wait()
        with self._cond:
            self._gone = True  # its servers got SIGKILL with it (PR_SET_PDEATHSIG)
            self._cond.notify_all()

    def serve(self, arguments: Sequence[str]) -> ForkedServer | None:
        """Have the standby fork a server with ``arguments``; None if it cannot (gone, or no answer
        within ``SERVING_REPORT_TIMEOUT_S``)."""
        if self._proc.stdin is None or not self.alive():
            return None
        try:
            self._proc.stdin.write(json.dumps(list(arguments)).encode() + b"\n")
            self._proc.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + SERVING_REPORT_TIMEOUT_S
        with self._cond:
            while not self._serving and not self._gone and time.monotonic() < deadline:
                self._cond.wait(timeout=max(0.0, deadline - time.monotonic()))
            if not self._serving:
                return None
            return ForkedServer(self._serving.pop(0), self)

    def exit_code(self, pid: int) -> int | None:
        """The exit code the standby reported for its server ``pid``; -9 once the standby is gone."""
        with self._cond:
            if pid in self._exits:
                return self._exits[pid]
            return -signal.SIGKILL if self._gone else None

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while pid not in self._exits and not self._gone:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(timeout=left)
        return self.exit_code(pid)

    def stop(self) -> None:
        """Stand down: end of input, then SIGKILL if it has not exited within a few seconds."""
        if self.alive() and self._proc.stdin is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if self.alive():
            self._proc.kill()
        self._proc.wait()


class ForkedServer:
    """A server the standby forked: the supervisor's ``Popen`` for it (the standby reaps it)."""

    def __init__(self, pid: int, standby: Standby) -> None:
        self._pid = pid
        self._standby = standby
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._standby.exit_code(self._pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        code = self._standby.wait_exit(self._pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked LMCache server {self._pid}", timeout or 0.0)
        self.returncode = code
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
