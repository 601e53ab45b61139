"""The sidecar as a real process around a real LMCache server: probes, /metrics, restarts, drain, L2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvoffload import contract
from tests.support.sidecar_harness import (
    RedisServer,
    Sidecar,
    children_of,
    http_get,
    lmcache_client,
    metric_value,
    sample_sum,
    wait_for,
)

pytestmark = pytest.mark.sidecar

CONNECTOR = f"""
import fcntl, os, sys
from prometheus_client import Counter, Gauge
directory = os.environ["PROMETHEUS_MULTIPROC_DIR"]
lock = os.open(os.path.join(directory, {contract.METRICS_LIVE_LOCK_TEMPLATE!r}.format(pid=os.getpid())), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(lock, fcntl.LOCK_EX)  # held for life: the sidecar's liveness signal
requests = Counter({contract.M_LOOKUP_REQUESTS!r}, "lookups", ["model", "backend"])
up = Gauge({contract.M_BACKEND_UP!r}, "backend up", ["model", "backend"], multiprocess_mode="livesum")
requests.labels("m", "sidecar").inc(int(sys.argv[1]))
up.labels("m", "sidecar").set(1)
print("ready", flush=True)
sys.stdin.read()
"""


def listening_addresses(port: int) -> set[str]:
    """Local addresses (hex, as in /proc/net/tcp) with a LISTEN socket on ``port``."""
    found: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            address, hex_port = fields[1].rsplit(":", 1)
            if int(hex_port, 16) == port and fields[3] == "0A":
                found.add(address)
    return found


def start_connector(env: dict[str, str], count: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CONNECTOR, str(count)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


def test_ready_probes_admin_api_on_loopback_and_one_metrics_with_three_families(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    sidecar = make_sidecar()
    sidecar.wait_ready()
    for path in (contract.PATH_STARTUP, contract.PATH_READY, contract.PATH_LIVE):
        assert http_get(sidecar.url(path))[0] == 200, path
    assert http_get(sidecar.url("/nope"))[0] == 404
    assert listening_addresses(sidecar.lmcache_http_port) == {"0100007F"}  # 127.0.0.1 only
    assert listening_addresses(sidecar.request_port) == {"0100007F"}
    assert listening_addresses(sidecar.port) == {"00000000"}  # kubelet reaches the pod IP

    env = dict(sidecar.env)
    connectors = [start_connector(env, 3), start_connector(env, 4)]
    try:
        body = sidecar.metrics()
        # LMCache's own series, re-exposed; its process/GC series are not.
        assert "lmcache_mp_l1_usage_ratio" in body
        assert "python_gc_objects_collected_total" not in body
        # The sidecar's own.
        assert metric_value(body, contract.M_SIDECAR_SERVER_RESTARTS + "_total") == 0
        assert metric_value(body, contract.M_SIDECAR_SERVER_UP) == 1
        assert sample_sum(body, contract.M_SIDECAR_CONFIG_INFO + "_info") == 1
        # The connector's, summed across its processes.
        assert sample_sum(body, contract.M_LOOKUP_REQUESTS + "_total") == 7
        assert sample_sum(body, contract.M_BACKEND_UP) == 2

        connectors[1].kill()
        connectors[1].wait()
        body = sidecar.metrics()
        assert sample_sum(body, contract.M_LOOKUP_REQUESTS + "_total") == 7, "a dead process's counts stay"
        assert sample_sum(body, contract.M_BACKEND_UP) == 1, "a dead process's live gauge goes"
        assert metric_value(body, contract.M_SIDECAR_SERVER_UP) == 1
    finally:
        for proc in connectors:
            proc.kill()
            proc.wait()


def test_without_a_warm_standby_a_killed_server_is_started_cold(make_sidecar: Callable[..., Sidecar]) -> None:
    sidecar = make_sidecar(**{contract.ENV_WARM_STANDBY: "false"})
    sidecar.wait_ready()
    old = sidecar.server_pid()
    time.sleep(3)  # a standby would have started by now
    assert sidecar.standby_pid() is None
    os.kill(old, signal.SIGKILL)
    assert sidecar.proc is not None
    wait_for(lambda: sidecar.ready() and old not in children_of(sidecar.proc.pid), 180, "a cold restart")
    assert sidecar.server_pid() != old and sidecar.standby_pid() is None


STANDBY_PROBE = """
import contextlib, io, sys
from kvoffload.lmcache_guard.server_cli import preload_lmcache_server
preload_lmcache_server()
import lmcache.cli.main as cli
before = set(sys.modules)
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
    cli.main(["server", "--help"])  # the command line a promotion parses, without serving
print(len(set(sys.modules) - before), sorted(set(sys.modules) - before)[:5])
"""


def test_a_warm_standby_has_imported_what_the_server_command_line_needs() -> None:
    """A promotion pays the server's own start only: parsing ``lmcache server``'s command line
    imports nothing the standby's warm-up did not (LMCache's L2 adapters were 2 s of it)."""
    out = subprocess.run([sys.executable, "-c", STANDBY_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1].startswith("0 "), out.stdout


def test_sigterm_drains_and_exits_zero_within_the_grace_period(make_sidecar: Callable[..., Sidecar]) -> None:
    grace = 30.0
    sidecar = make_sidecar(**{contract.ENV_GRACE_SECONDS: str(grace)})
    sidecar.wait_ready()
    server = sidecar.server_pid()
    assert sidecar.proc is not None
    # With nothing in flight LMCache stops in about 1.5 s, a window a poll can miss on a busy machine.
    # Held stopped (SIGTERMed or about to be), the server keeps the sidecar draining until the test
    # has seen the answer; it stops once continued (the stop share of a 30 s grace is 9.7 s).
    sidecar.proc.send_signal(signal.SIGTERM)
    os.kill(server, signal.SIGSTOP)
    seen: list[tuple[int, str]] = []
    try:

        def not_ready() -> bool:
            seen.append(http_get(sidecar.url(contract.PATH_READY), timeout=2))
            return seen[-1][0] != 200

        wait_for(not_ready, 10, "readiness to drop")
    finally:
        os.kill(server, signal.SIGCONT)
    assert seen[-1] == (503, "fail: draining\n"), "the sidecar itself answers not-ready while it drains"
    assert sidecar.proc.wait(timeout=grace) == 0
    assert not Path(f"/proc/{server}").exists() or "Z" in Path(f"/proc/{server}/stat").read_text().split()[2]
    log = sidecar.log_path.read_text(errors="replace")
    assert "MPCacheServer closed" in log, "LMCache must stop through its own graceful shutdown"
    shm = Path(contract.SHM_MOUNT_PATH) / f"lmcache_l1_pool_kvoffload_{sidecar.env[contract.ENV_INSTANCE_ID]}"
    assert not shm.exists()


def _kill_server_and_wait_for_restart(sidecar: Sidecar) -> None:
    """SIGKILL the serving LMCache server; the warm standby (started once the server was ready)
    forks the next one and stays, warm, for the next crash."""
    old = sidecar.server_pid()
    wait_for(sidecar.standby_is_warm, 120, "a warm standby beside the ready server")
    standby = sidecar.standby_pid()
    os.kill(old, signal.SIGKILL)
    live_statuses: list[int] = []

    def restarted() -> bool:
        live_statuses.append(http_get(sidecar.url(contract.PATH_LIVE), timeout=2)[0])
        body = http_get(sidecar.url(contract.PATH_METRICS))[1]
        return metric_value(body, contract.M_SIDECAR_SERVER_RESTARTS + "_total") == 1 and sidecar.ready()

    wait_for(restarted, 180, "the LMCache server's supervised restart")
    assert set(live_statuses) == {200}, "liveness stays OK during a supervised restart"
    server = sidecar.server_pid()
    assert server != old and server in children_of(standby), "the standby forked the new server"
    assert sidecar.standby_pid() == standby, "the standby stays for the next crash"


def test_kill9_restarts_counted_and_fs_l2_serves_earlier_kv(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    l2 = tmp_path / "l2"
    sidecar = make_sidecar(**{contract.ENV_L2_FS_PATH: str(l2)})
    sidecar.wait_ready()
    assert lmcache_client(sidecar, "store", 11) == {"stored": True, "chunks": 2}
    wait_for(lambda: len(list(l2.glob("*.data"))) >= 2, 60, "both chunks written to the fs L2")
    assert lmcache_client(sidecar, "lookup", 11)["hit"] == 2

    _kill_server_and_wait_for_restart(sidecar)

    assert lmcache_client(sidecar, "lookup", 11) == {"hit": 2, "total": 2, "error": None}
    assert lmcache_client(sidecar, "lookup", 12)["hit"] == 0
    body = sidecar.metrics()
    assert (sample_sum(body, "lmcache_mp_lookup_hit_l2_tokens_total") or 0) >= 512, "served from L2"


def _gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_a_server_the_standby_forked_drains_on_sigterm_then_the_standby_stops(
    make_sidecar: Callable[..., Sidecar],
) -> None:
    grace = 20.0
    sidecar = make_sidecar(**{contract.ENV_GRACE_SECONDS: str(grace)})
    sidecar.wait_ready()
    _kill_server_and_wait_for_restart(sidecar)
    standby, server = sidecar.standby_pid(), sidecar.server_pid()
    assert standby is not None and sidecar.proc is not None
    sidecar.proc.send_signal(signal.SIGTERM)
    assert sidecar.proc.wait(timeout=grace) == 0
    log = sidecar.log_path.read_text(errors="replace")
    # The first server was SIGKILLed: a graceful close can only be the forked one's.
    assert "MPCacheServer closed" in log, "the forked server stops through LMCache's own shutdown"
    assert f"event=server_stopped pid={server} code=" in log
    wait_for(lambda: _gone(server) and _gone(standby), 10, "the server and the standby to exit")


def test_redis_l2_serves_earlier_kv_after_restart(
    make_sidecar: Callable[..., Sidecar], redis_server: RedisServer
) -> None:
    sidecar = make_sidecar(
        **{
            contract.ENV_L2_REDIS_URL: f"redis://127.0.0.1:{redis_server.port}/0",
            contract.ENV_L2_REDIS_PASSWORD: redis_server.password,
        }
    )
    sidecar.wait_ready()
    assert redis_server.password not in Path(f"/proc/{sidecar.server_pid()}/cmdline").read_text()
    assert lmcache_client(sidecar, "store", 21) == {"stored": True, "chunks": 2}
    wait_for(lambda: redis_server.dbsize() >= 2, 60, "both chunks written to Redis")

    _kill_server_and_wait_for_restart(sidecar)

    assert lmcache_client(sidecar, "lookup", 21) == {"hit": 2, "total": 2, "error": None}
    assert lmcache_client(sidecar, "lookup", 22)["hit"] == 0
    assert (sample_sum(sidecar.metrics(), "lmcache_mp_lookup_hit_l2_tokens_total") or 0) >= 512


def test_sized_fs_l2_stays_bounded_and_serves_after_restart(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    # A chunk here is 128 KiB (256 tokens x 2 layers x 2 x 2 heads x 32 x fp16); 16 chunks = 2 MiB.
    l2 = tmp_path / "l2"
    sidecar = make_sidecar(**{contract.ENV_L2_FS_PATH: str(l2), contract.ENV_L2_FS_SIZE: "1Mi"})
    sidecar.wait_ready()
    assert lmcache_client(sidecar, "store", 31) == {"stored": True, "chunks": 2}
    wait_for(lambda: len(list(l2.glob("*.data"))) >= 2, 60, "the first request's chunks in the fs L2")

    _kill_server_and_wait_for_restart(sidecar)
    assert lmcache_client(sidecar, "lookup", 31)["hit"] == 2, "sized tier serves earlier KV after a restart"

    assert lmcache_client(sidecar, "store", "40-47") == {"stored": True, "chunks": 16}

    def bounded() -> bool:
        body = sidecar.metrics()
        evicted = sample_sum(body, "lmcache_mp_l2_evicted_objects_chunks_total") or 0
        return evicted > 0 and (sample_sum(body, "lmcache_mp_l2_usage_bytes") or 0) <= 2**20 - 2 * 2**17

    # LMCache evicts 20% per 1 s tick once above its 0.8 watermark of its capacity.
    wait_for(bounded, 120, "L2 eviction to bring this server's share under its capacity")
    # The 2 chunks from before the restart were kept (under half the size), so this server got
    # 1Mi - 256Ki: old files + new ones stay within the 1Mi (8 chunks) on disk.
    assert len(list(l2.glob("*.data"))) <= 8
