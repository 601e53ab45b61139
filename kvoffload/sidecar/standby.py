"""A warm standby LMCache server: a process that has already imported LMCache's server and built
its command line (about 4 s of a cold start here, 2 s of it the L2 adapters the parser lists) and
says ``warm`` on stdout once it has, and serves once the supervisor writes it one line, the JSON
list of ``lmcache`` arguments; end of input means stand down.

    python -m kvoffload.sidecar.standby
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys


def warm_up() -> None:
    """Import what ``lmcache server`` imports when it runs (lmcache.cli.commands.server), and build
    its parser once: that imports every registered L2 adapter (its --help lists them), so the real
    one finds those modules loaded."""
    import lmcache.v1.distributed.config
    import lmcache.v1.mp_observability.config
    import lmcache.v1.multiprocess.config
    import lmcache.v1.multiprocess.http_server  # noqa: F401
    from lmcache.cli.commands import register_commands

    register_commands(argparse.ArgumentParser(prog="lmcache").add_subparsers(dest="command"), ["server"])


def main() -> int:
    import lmcache.cli.main as cli

    warm_up()
    # Tell the supervisor (the first line on stdout), then send stdout where stderr goes: nobody
    # reads the pipe again, and the server must never block on it.
    with contextlib.suppress(OSError):  # promoted before it was warm: the supervisor stopped listening
        sys.stdout.write("warm\n")
        sys.stdout.flush()
    os.dup2(2, 1)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    arguments = json.loads(line)
    sys.argv = ["lmcache", *arguments]
    cli.main(arguments)
    return 0


if __name__ == "__main__":
    sys.exit(main())
