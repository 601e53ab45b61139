"""Start and stop a real ``lmcache server`` (LMCache 0.5.6 MP server) for tests.

The server runs as a child process on free ports with the flags the connector's
data path needs: worker-driven transfer (``--supported-transfer-mode auto``)
over POSIX shared memory (``--shm-name`` plus ``--no-l1-use-lazy``: LMCache
only advertises its SHM pool when L1 is allocated eagerly, otherwise it falls
back to pickling every chunk through ZMQ).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hack.ports import free_port
from kvoffload.sidecar.metrics import ServerTransferState, transfer_state


@dataclass
class LMCacheServer:
    """One ``lmcache server`` child process; ``start()``/``stop()`` may repeat on the same ports."""

    chunk_size: int
    log_dir: Path
    l1_size_gb: float = 0.25
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    shm_name: str = field(default_factory=lambda: f"kvo_test_{uuid.uuid4().hex[:10]}")
    extra_args: Sequence[str] = ()
    guarded: bool = False
    """Run it as the sidecar does: LMCache's CLI behind kvoffload's restricted unpickler."""
    shm: bool = True
    """L1 in a named SHM segment; without it clients fall back to the pickle transport."""
    argv: Sequence[str] | None = None
    """The whole command line instead of this class's (a test that starts the server as the sidecar does)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Set in the server's environment over this process's (the sidecar's ``ServerCommand.env``)."""
    _proc: subprocess.Popen[bytes] | None = None
    _starts: int = 0

    @property
    def url(self) -> str:
        """ZMQ request URL the connector uses."""
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"lmcache-server-{self.port}-{self._starts}.log"

    def command(self) -> list[str]:
        """The server command line (``lmcache server`` through its module entry point)."""
        if self.argv is not None:
            return list(self.argv)
        entry = (
            ["kvoffload.sidecar.lmcache_server", "server"] if self.guarded else ["lmcache.v1.multiprocess.http_server"]
        )
        shm = ["--no-l1-use-lazy", "--shm-name", self.shm_name] if self.shm else []
        return [
            sys.executable,
            "-m",
            *entry,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--http-port",
            str(self.http_port),
            "--chunk-size",
            str(self.chunk_size),
            "--l1-size-gb",
            str(self.l1_size_gb),
            "--eviction-policy",
            "LRU",
            "--max-workers",
            "1",
            "--supported-transfer-mode",
            "auto",
            *shm,
            *self.extra_args,
        ]

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the server and wait until ``/healthcheck`` answers 200."""
        if self._proc is not None and self._proc.poll() is None:
            return
        self._starts += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env}
        env.setdefault("LMCACHE_TRACK_USAGE", "false")
        env.setdefault("DO_NOT_TRACK", "1")
        env.setdefault("PYTHONHASHSEED", "0")
        log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"lmcache server exited with {self._proc.returncode}; log: {self.log_path}\n"
                    + self.log_path.read_text(errors="replace")[-4000:]
                )
            if self.healthy():
                return
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"lmcache server not healthy after {timeout_s}s; log: {self.log_path}")

    def healthy(self) -> bool:
        """Whether ``GET /healthcheck`` answers 200 right now."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthcheck", timeout=1) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def status(self) -> dict[str, Any]:
        """The server's ``GET /status`` (LMCache's own report of its modules and storage)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/status", timeout=10) as resp:
            body: dict[str, Any] = json.loads(resp.read())
        return body

    def held(self) -> ServerTransferState:
        """Read-locked chunks, live store reservations and prefetch jobs the server holds now (its
        ``/status`` read as the sidecar's metrics read it)."""
        state = transfer_state(json.dumps(self.status()).encode())
        assert state is not None, "the server's /status lost the fields the sidecar reads"
        return state

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP the server for the block: alive (its socket accepts) but answering nothing, as
        one stalled by a long collection or a swapped-out page; SIGCONT after."""
        assert self._proc is not None and self._proc.poll() is None, "the server is not running"
        os.killpg(self._proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.killpg(self._proc.pid, signal.SIGCONT)

    def process_state(self) -> str:
        """The server process's scheduler state as ``/proc`` reports it (``T (stopped)`` while paused)."""
        assert self._proc is not None
        with open(f"/proc/{self._proc.pid}/status", encoding="ascii") as status:
            return next((line.split(":", 1)[1].strip() for line in status if line.startswith("State:")), "?")

    def kill(self) -> None:
        """SIGKILL the server (a crash, not a graceful stop)."""
        self._signal_and_wait(signal.SIGKILL)

    def stop(self) -> None:
        """SIGTERM the server (SIGKILL after 15 s) and remove its SHM segment, also after a ``kill()``."""
        self._signal_and_wait(signal.SIGTERM)
        (Path("/dev/shm") / f"lmcache_l1_pool_{self.shm_name}").unlink(missing_ok=True)

    def _signal_and_wait(self, sig: int) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=15)
        # A killed server leaves its SHM segment behind: a restart on the same name replaces it,
        # and stop() removes it.
        self._proc = None

    def log_text(self) -> str:
        """All logs of this server's starts, concatenated."""
        parts = sorted(self.log_dir.glob(f"lmcache-server-{self.port}-*.log"))
        return "\n".join(p.read_text(errors="replace") for p in parts)


def sidecar_events_server(
    log_dir: Path, chunk_size: int, l1_size: str, events_port: int, instance_id: str, extra_env: dict[str, str]
) -> LMCacheServer:
    """An LMCache server on the sidecar's own command line and environment (``build_server_command``)
    with KV events published on ``events_port``; ``extra_env`` goes over the sidecar env it is built
    from (the server reads some of it itself: ``KVOFFLOAD_CACHE_KEYS_DIR`` puts it behind CURVE)."""
    import shutil

    from kvoffload import contract
    from kvoffload.sidecar.command import build_server_command
    from kvoffload.sidecar.settings import load_settings

    env = {
        contract.ENV_REQUEST_PORT: str(free_port()),
        contract.ENV_LMCACHE_HTTP_PORT: str(free_port()),
        contract.ENV_SIDECAR_HTTP_PORT: str(free_port()),
        contract.ENV_INSTANCE_ID: instance_id,
        contract.ENV_KV_EVENTS_PORT: str(events_port),
        **extra_env,
    }
    settings = load_settings(env, {"cache": {"l1Size": l1_size, "chunkSize": chunk_size, "maxWorkers": 1}})
    command = build_server_command(settings, env, shutil.disk_usage("/dev/shm").free)
    assert command.uses_shm and "--server-module" in command.argv, command.argv
    return LMCacheServer(
        chunk_size=chunk_size,
        log_dir=log_dir,
        port=settings.request_port,
        http_port=settings.lmcache_http_port,
        shm_name=settings.shm_name,
        argv=command.argv,
        env=command.env,
    )
