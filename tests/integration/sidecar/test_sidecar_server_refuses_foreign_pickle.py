"""The LMCache server the sidecar runs unpickles no stranger's code: against the real server, a
registered foreign client's COMMIT_STORE that would run a command is refused before it runs,
while LMCache's own traffic (shared memory, and the pickle transport) still stores and hits."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.lmcache_server import LMCacheServer
from tests.support.sidecar_harness import Sidecar, lmcache_client, lmcache_client_on

pytestmark = pytest.mark.sidecar


def test_a_strangers_pickle_that_would_run_code_is_refused_and_the_cache_keeps_serving(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    sidecar = make_sidecar()
    sidecar.wait_ready()
    marker = tmp_path / "code-ran"
    answer = lmcache_client(sidecar, "foreign-commit", str(marker))
    assert answer["committed"] is not True, answer
    assert not marker.exists(), "the stranger's pickle ran a command in the cache server"
    assert "kvoffload refused a pickled global posix.system" in sidecar.log_path.read_text(errors="replace")
    assert sidecar.ready()
    assert lmcache_client(sidecar, "store", 7) == {"stored": True, "chunks": 2}
    assert lmcache_client(sidecar, "lookup", 7)["hit"] == 2


def test_the_pickle_transport_of_a_server_without_shared_memory_still_stores_through_the_guard(
    tmp_path: Path,
) -> None:
    server = LMCacheServer(chunk_size=256, log_dir=tmp_path, guarded=True, shm=False)
    server.start()
    try:
        assert lmcache_client_on(server.port, server.http_port, "store", 3) == {"stored": True, "chunks": 2}
        assert lmcache_client_on(server.port, server.http_port, "lookup", 3)["hit"] == 2
        log = server.log_path.read_text(errors="replace")
        assert "pickle" in log.lower() and "refused" not in log
    finally:
        server.stop()


WARM_STANDBY_PROBE = """
from kvoffload.lmcache_guard.server_cli import preload_lmcache_server
from kvoffload.lmcache_guard.unpickling import unpickler_is_restricted
preload_lmcache_server()
print(unpickler_is_restricted())
"""


def test_the_servers_a_warm_standby_forks_unpickle_through_the_guard() -> None:
    out = subprocess.run([sys.executable, "-c", WARM_STANDBY_PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "True"
