"""A warm standby LMCache server: a process that has already imported LMCache's server and built
its command line (about 4 s of a cold start here, 2 s of it the L2 adapters the parser lists) and
serves once the supervisor writes it one line, the JSON list of ``lmcache`` arguments; end of input
means stand down.

    python -m kvoffload.sidecar.standby
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import argparse

    import lmcache.cli.main as cli

    # What ``lmcache server`` imports when it runs (lmcache.cli.commands.server), imported now.
    import lmcache.v1.distributed.config
    import lmcache.v1.mp_observability.config
    import lmcache.v1.multiprocess.config
    import lmcache.v1.multiprocess.http_server  # noqa: F401
    from lmcache.cli.commands import register_commands

    # The parser ``lmcache server`` builds imports every registered L2 adapter (its --help lists
    # them): build one now, so the real one finds those modules loaded.
    register_commands(argparse.ArgumentParser(prog="lmcache").add_subparsers(dest="command"), ["server"])
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    arguments = json.loads(line)
    sys.argv = ["lmcache", *arguments]
    cli.main(arguments)
    return 0


if __name__ == "__main__":
    sys.exit(main())
