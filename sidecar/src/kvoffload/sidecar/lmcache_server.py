"""The sidecar's LMCache server: LMCache's own CLI run behind kvoffload's restricted unpickler
(``kvoffload.lmcache_guard``), so no client of the request port can make it run code, behind its
transfer guard, so no store that was not finished is ever admitted, and, where
``KVOFFLOAD_CACHE_KEYS_DIR`` names the policy's keys (node mode), behind CURVE: only the policy's
client key completes a connection. Its PREPARE_RETRIEVE describes slots without building tensor
views (``kvoffload.lmcache_guard.retrieve_slots``), and it looks a hit up and secures it in one call
(``kvoffload.lmcache_guard.secured_lookups``, loaded as a server module).

    python -m kvoffload.sidecar.lmcache_server server --host 0.0.0.0 ...
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence

from kvoffload import contract
from kvoffload.cache_keys import CacheKeysError, read_server_keys
from kvoffload.lmcache_guard import LMCacheVersionError, install_server_guards
from kvoffload.lmcache_guard.curve import require_curve_clients
from kvoffload.lmcache_guard.secured_lookups import with_secured_lookups
from kvoffload.lmcache_guard.server_cli import run_lmcache_cli


def guard_server(env: Mapping[str, str]) -> None:
    """Put this process's LMCache server behind the guards ``env`` asks for (before it starts)."""
    install_server_guards()
    keys_dir = env.get(contract.ENV_CACHE_KEYS_DIR)
    if keys_dir:
        require_curve_clients(read_server_keys(keys_dir))


def run_server(arguments: Sequence[str], env: Mapping[str, str] = os.environ) -> None:
    """Run LMCache's CLI (``server ...``) in this process behind ``guard_server``, with secured lookups."""
    guard_server(env)
    arguments = list(arguments)
    run_lmcache_cli(with_secured_lookups(arguments) if arguments[:1] == ["server"] else arguments)


if __name__ == "__main__":
    try:
        run_server(sys.argv[1:])
    except (LMCacheVersionError, CacheKeysError) as exc:
        print(f"kvoffload: {exc}", file=sys.stderr)
        sys.exit(2)
