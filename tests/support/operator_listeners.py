"""The real operator process (``python -m kvoffload.operator``) against a stand-in apiserver that
serves API discovery and nothing else: kopf starts, finds no resources to watch and idles, while
the operator's own listeners (``/metrics`` and kopf's ``/healthz``) serve on 127.0.0.1. For tests
that attack those listeners: the process's threads and memory are its own to measure."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from hack.ports import free_port
from kvoffload import contract as c

ROOT = Path(__file__).resolve().parents[2]
DISCOVERY = {
    "/api": {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": []},
    "/api/v1": {"kind": "APIResourceList", "groupVersion": "v1", "resources": []},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
}


class _Discovery(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        found = DISCOVERY.get(self.path.split("?")[0])
        body = json.dumps(found or {"kind": "Status", "code": 404}).encode()
        self.send_response(200 if found else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


class OperatorListeners:
    """The operator in a child process: its metrics and health ports, and its thread count and
    memory as the kernel reports them."""

    def __init__(self, workdir: Path, apiserver_port: int) -> None:
        kubeconfig = workdir / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "standin",
            "clusters": [{"name": "standin", "cluster": {"server": f"http://127.0.0.1:{apiserver_port}"}}],
            "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin"}}],
            "users": [{"name": "standin", "user": {"token": "standin"}}],
        }))  # fmt: skip
        self.metrics_port, self.health_port = free_port(), free_port()
        self.log = workdir / "operator.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvoffload.operator", "--kubeconfig", str(kubeconfig),
                 "--native-sidecars", "true", "--leader-election", "false", "--resync-seconds", "0",
                 "--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port)],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip

    def get(self, port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as reply:
            return reply.status, reply.read()

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.get(self.metrics_port, c.PATH_METRICS, 1.0)
                self.get(self.health_port, "/healthz", 1.0)
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the operator did not serve: {self.log.read_text()[-2000:]}") from None
                time.sleep(0.2)

    def status(self, field: str) -> int:
        """A number from ``/proc/PID/status`` (``Threads``, ``VmRSS`` in KiB, ``VmHWM``...)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise KeyError(field)


@contextlib.contextmanager
def operator_listeners(workdir: Path) -> Iterator[OperatorListeners]:
    """The operator serving its listeners, with the stand-in apiserver it talks to."""
    apiserver = ThreadingHTTPServer(("127.0.0.1", 0), _Discovery)
    apiserver.daemon_threads = True
    threading.Thread(target=apiserver.serve_forever, name="standin-apiserver", daemon=True).start()
    operator = OperatorListeners(workdir, apiserver.server_address[1])
    try:
        operator.wait_serving()
        yield operator
    finally:
        operator.proc.terminate()
        try:
            operator.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            operator.proc.kill()
            operator.proc.wait()
        apiserver.shutdown()
        apiserver.server_close()


def idle_connections(port: int, count: int, timeout: float = 120.0) -> list[socket.socket]:
    """``count`` TCP connections to ``port`` that send nothing, each taken by the server: opened a
    backlog's worth at a time, the next once the listener has accepted those (a connect that finds
    the accept queue full stays half open, and never reaches the server while it sends nothing).
    Raises if they are not all accepted within ``timeout``."""
    opened: list[socket.socket] = []
    deadline = time.monotonic() + timeout
    try:
        while len(opened) < count:
            waiting, backlog = _accept_queue(port)
            if waiting:
                if time.monotonic() > deadline:
                    raise AssertionError(f"port {port} accepted fewer than {len(opened)} connections in {timeout} s")
                time.sleep(0.002)
                continue
            for _ in range(min(max(1, backlog - 1), count - len(opened))):
                opened.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except BaseException:
        for sock in opened:
            sock.close()
        raise
    return opened


def _accept_queue(port: int) -> tuple[bool, int]:
    """(whether a connection to ``port`` is half open or waits in the accept queue, the listener's backlog)."""
    shown = subprocess.run(["ss", "-Hnt", "state", "syn-recv", "state", "listening", f"sport = :{port}"],
                           check=True, capture_output=True, text=True).stdout  # fmt: skip
    waiting, backlog = False, 1
    for line in shown.splitlines():
        state, queued, limit = line.split()[:3]
        waiting = waiting or state == "SYN-RECV" or (state == "LISTEN" and int(queued) > 0)
        backlog = int(limit) if state == "LISTEN" else backlog
    return waiting, backlog
