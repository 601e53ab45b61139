"""Harness for the sidecar as a real process: the sidecar, a Redis server, an LMCache client.

Every process started here is stopped in teardown (process groups, killed by id).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hack.localpod import http_get
from hack.polling import wait_until
from hack.ports import free_port
from kvoffload import contract

READY_TIMEOUT_S = 180.0
"""Bound on start-up: LMCache imports torch and pins L1 on a shared 2-core machine."""
CLIENT = Path(__file__).with_name("lmcache_client.py")


def wait_for(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.25) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` after ``timeout`` seconds (``hack.polling``)."""
    wait_until(predicate, timeout, what, interval)


def metric_value(body: str, name: str, labels: str = "") -> float | None:
    """The value of the sample ``name{labels}`` in an exposition, ``None`` when absent."""
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in body.splitlines():
        if line.startswith("#"):
            continue
        sample, _, value = line.rpartition(" ")
        if sample == wanted:
            return float(value)
    return None


def children_of(pid: int) -> list[int]:
    """Direct child PIDs of ``pid`` (Linux ``/proc``)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` has a TCP socket listening on ``port``."""
    import psutil

    try:
        connections = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in connections)


@dataclass
class Sidecar:
    """One ``python -m kvoffload.sidecar`` process and its ports."""

    workdir: Path
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.workdir / "sidecar.log"

    @property
    def port(self) -> int:
        return int(self.env[contract.ENV_SIDECAR_HTTP_PORT])

    @property
    def request_port(self) -> int:
        return int(self.env[contract.ENV_REQUEST_PORT])

    @property
    def lmcache_http_port(self) -> int:
        return int(self.env[contract.ENV_LMCACHE_HTTP_PORT])

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> Sidecar:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvoffload.sidecar"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def ready(self) -> bool:
        return http_get(self.url(contract.PATH_READY), timeout=2)[0] == 200

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        assert self.proc is not None
        wait_for(
            lambda: self.proc is not None and (self.proc.poll() is not None or self.ready()),
            timeout,
            "sidecar readiness",
        )
        assert self.proc.poll() is None, f"sidecar exited {self.proc.returncode}:\n{self.log_tail()}"

    def metrics(self) -> str:
        status, body = http_get(self.url(contract.PATH_METRICS))
        assert status == 200, body
        return body

    def server_pid(self) -> int:
        """The LMCache server serving now: the process listening on the request port, the sidecar's
        child (a cold start) or the standby's (forked by it); the standby listens on nothing."""
        import psutil

        assert self.proc is not None
        kids = children_of(self.proc.pid)
        # a cold-started server is the sidecar's child, one forked by the standby its grandchild
        serving = [p for p in [*kids, *(g for k in kids for g in children_of(k))] if listens_on(p, self.request_port)]
        assert len(serving) == 1, (
            f"expected one LMCache child listening on {self.request_port}, found {serving} of {kids}"
        )
        assert len(kids) <= 2, (
            f"more children than a server and its standby: {[psutil.Process(k).cmdline() for k in kids]}"
        )
        return serving[0]

    def standby_pid(self) -> int | None:
        """The warm standby LMCache server, if one waits."""
        kids = (
            [kid for kid in children_of(self.proc.pid) if not listens_on(kid, self.request_port)] if self.proc else []
        )
        return kids[0] if kids else None

    def standby_is_warm(self) -> bool:
        """Whether a standby waits with its warm-up done (the supervisor logs its report)."""
        pid = self.standby_pid()
        return pid is not None and f"event=standby_warm pid={pid}" in self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc is None:
            return
        # The whole group: the sidecar and its LMCache child (the sidecar may already be gone).
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


def sidecar_env(workdir: Path, **extra: str) -> dict[str, str]:
    """Env for a sidecar with free ports, a small L1 and its own dirs under ``workdir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env.pop(contract.ENV_PROMETHEUS_MULTIPROC_DIR, None)
    env.update(
        {
            contract.ENV_REQUEST_PORT: str(free_port()),
            contract.ENV_LMCACHE_HTTP_PORT: str(free_port()),
            contract.ENV_SIDECAR_HTTP_PORT: str(free_port()),
            contract.ENV_L1_SIZE: "256Mi",
            contract.ENV_MAX_WORKERS: "2",
            contract.ENV_INSTANCE_ID: f"test-{workdir.name}"[-60:].strip("-_.") or "test",
            contract.ENV_PROMETHEUS_MULTIPROC_DIR: str(workdir / "metrics"),
            contract.ENV_POLICY_FILE: "",
            contract.ENV_GRACE_SECONDS: "20",
        }
    )
    env.update(extra)
    return env


@pytest.fixture
def make_sidecar(tmp_path: Path) -> Iterator[Callable[..., Sidecar]]:
    """Factory: ``make_sidecar(**env)`` starts a sidecar; all are killed in teardown."""
    started: list[Sidecar] = []

    def make(**extra: str) -> Sidecar:
        workdir = tmp_path / f"sidecar{len(started)}"
        workdir.mkdir()
        sidecar = Sidecar(workdir=workdir, env=sidecar_env(workdir, **extra))
        started.append(sidecar)
        return sidecar.start()

    yield make
    for sidecar in started:
        sidecar.stop()


@dataclass
class RedisServer:
    port: int
    password: str
    proc: subprocess.Popen[bytes]

    def dbsize(self) -> int:
        import redis

        return int(redis.Redis(host="127.0.0.1", port=self.port, password=self.password).dbsize())


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real ``redis-server`` (Debian package) on a free port, with a password; stopped afterwards."""
    port = free_port()
    password = "kvo-test-pw"
    proc = subprocess.Popen(
        [
            "/usr/bin/redis-server",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--requirepass",
            password,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(tmp_path),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    server = RedisServer(port=port, password=password, proc=proc)

    def answers() -> bool:
        try:
            server.dbsize()
            return True
        except Exception:
            return False

    try:
        wait_for(answers, 30, "redis-server")
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def lmcache_client(sidecar: Sidecar, op: str, sequence: int | str) -> dict[str, object]:
    """STORE or LOOKUP synthetic requests (one, or a range "a-b") with LMCache's own client, in a fresh process."""
    return lmcache_client_on(sidecar.request_port, sidecar.lmcache_http_port, op, sequence)


def lmcache_client_on(
    request_port: int, http_port: int, op: str, argument: int | str, keys_dir: Path | None = None
) -> dict[str, object]:
    """``lmcache_client.py`` against any LMCache server's ports (see its usage), in a fresh process;
    with ``keys_dir``, its connections authenticate with the CURVE client keys there."""
    env = {k: v for k, v in os.environ.items() if k != contract.ENV_CACHE_KEYS_DIR}
    if keys_dir is not None:
        env[contract.ENV_CACHE_KEYS_DIR] = str(keys_dir)
    out = subprocess.run(
        [sys.executable, str(CLIENT), str(request_port), str(http_port), op, str(argument)],
        capture_output=True,
        timeout=180,
        check=False,
        env=env,
    )
    lines = [ln for ln in out.stdout.decode().splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, f"client {op} failed ({out.returncode}):\n{out.stderr.decode()[-3000:]}"
    result: dict[str, object] = json.loads(lines[-1])
    return result


def sample_sum(body: str, name: str) -> float | None:
    """Sum over all label sets of sample ``name``; ``None`` if there is none."""
    values = [s.value for f in text_string_to_metric_families(body) for s in f.samples if s.name == name]
    return sum(values) if values else None
