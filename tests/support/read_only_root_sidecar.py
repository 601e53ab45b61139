"""Run a sidecar (its warm standby and LMCache server too) on a read-only root filesystem, with the
cache container's TMPDIR and NUMBA_CACHE_DIR pointed into its writable run directory as the operator
sets them, then store and look up through it. Prints one JSON line.

Usage (as root, in a private mount namespace that made ``/`` read-only): ``python -m
tests.support.read_only_root_sidecar WRITABLE_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvoffload import contract
from tests.support.sidecar_harness import Sidecar, lmcache_client, sidecar_env


def main() -> int:
    writable = Path(sys.argv[1])
    run = writable / "run"  # stands in for the run volume at /var/run/kvoffload
    run.mkdir(parents=True)
    env = sidecar_env(run, **{contract.ENV_TMPDIR: str(run), contract.ENV_NUMBA_CACHE_DIR: str(run / "numba")})
    env["HOME"] = "/nonexistent"
    sidecar = Sidecar(workdir=run, env=env).start()
    try:
        sidecar.wait_ready()
        result = {"store": lmcache_client(sidecar, "store", 3), "lookup": lmcache_client(sidecar, "lookup", 3)}
    finally:
        sidecar.stop()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
