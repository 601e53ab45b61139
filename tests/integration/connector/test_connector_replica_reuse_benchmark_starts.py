"""The replica-reuse benchmark's documented command starts and serves every request, node mode
included (its cache server on all addresses behind the policy's CURVE keys, as the operator starts a
node's cache pod). Tiny sizes; nothing about its numbers is asserted (benchmarks are not tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sidecar, pytest.mark.connector]
REPO = Path(__file__).resolve().parents[3]


def test_the_documented_command_runs_node_mode_to_the_end() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.replica_reuse", "--conversations", "2", "--turns", "2",
         "--setups", "node_mode", "--layers", "2", "--kv-heads", "2", "--head-dim", "8"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(proc.stdout)
    (node,) = report["results"]
    assert node["setup"] == "node_mode" and node["requests"] == 4
    assert node["engine_agrees"] and node["kv_mismatches"] == 0
    assert node["by_source"]["cache"] > 0  # a replica loaded what another computed, through the one server
    assert node["loads"]["copy"]["count"] > 0
