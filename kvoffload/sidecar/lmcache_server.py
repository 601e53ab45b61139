"""The sidecar's LMCache server: LMCache's own CLI run behind kvoffload's restricted unpickler
(``kvoffload.lmcache_guard``), so no client of the request port can make it run code.

    python -m kvoffload.sidecar.lmcache_server server --host 127.0.0.1 ...
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvoffload.lmcache_guard import LMCacheVersionError, install_restricted_unpickler


def run_server(arguments: Sequence[str]) -> None:
    """Run LMCache's CLI (``server ...``) in this process with the restricted unpickler."""
    install_restricted_unpickler()
    import lmcache.cli.main as cli

    sys.argv = ["lmcache", *arguments]
    cli.main(list(arguments))


if __name__ == "__main__":
    try:
        run_server(sys.argv[1:])
    except LMCacheVersionError as exc:
        print(f"kvoffload: {exc}", file=sys.stderr)
        sys.exit(2)
