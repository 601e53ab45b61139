"""The injected cache container runs with ``readOnlyRootFilesystem``: shown by running the sidecar,
its standby and the real LMCache server on a read-only ``/`` (a private mount namespace) with only
the env the operator adds for it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload import contract

pytestmark = pytest.mark.sidecar

SCRIPT = """
set -e
mount -t tmpfs tmpfs {writable}
mount -o remount,bind,ro /
exec env {client_env} {python} -m tests.support.read_only_root_sidecar {writable}
"""


def _can_remount_root_read_only() -> bool:
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", "mount -o remount,bind,ro /"],
                           capture_output=True, timeout=30, check=False)  # fmt: skip
    return probe.returncode == 0


def test_the_sidecar_and_its_lmcache_server_serve_on_a_read_only_root(tmp_path: Path) -> None:
    if not _can_remount_root_read_only():
        pytest.skip("needs root and mount namespaces (unshare -m)")
    writable = tmp_path / "writable"
    writable.mkdir()
    # The test's own client processes need somewhere to write too; the sidecar gets only its run dir.
    client_env = f"TMPDIR={writable} {contract.ENV_NUMBA_CACHE_DIR}={writable}/client-numba PYTHONDONTWRITEBYTECODE=1"
    script = SCRIPT.format(writable=writable, client_env=client_env, python=sys.executable)
    out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                         capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    result = json.loads(lines[-1])
    assert result["store"] == {"stored": True, "chunks": 2}
    assert result["lookup"]["hit"] == 2
