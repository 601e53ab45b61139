"""The warm standby: a process that has imported LMCache's server and built its command line once
(about 5 s of a cold start here, 2 s of it the L2 adapters the parser lists), then forks a server
from that state each time the supervisor asks: a crashed server is replaced in about 0.1 s, and
the standby stays, warm, for the next crash.

    python -m kvoffload.sidecar.standby

Protocol (``standby_handle``, the words in ``standby_wire``): each line on stdin is the JSON list of ``lmcache`` arguments of
one server; end of input means stand down. On stdout it reports ``warm`` once, then
``serving PID`` for each server it forked and ``exited PID CODE`` when one exits (it is their
parent and reaps them). Its servers get SIGKILL if it dies (``PR_SET_PDEATHSIG``), as it does if
the sidecar dies, so none outlives the sidecar.

The standby starts no thread before it forks (LMCache's server starts its own, in the child).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
from typing import Any, TextIO

from kvoffload.lmcache_guard.server_cli import preload_lmcache_server

from .lmcache_server import run_server
from .parent_death import die_with_parent
from .standby_wire import EXITED, SERVING, WARM

_REAP_EVERY_S = 0.05


def _report(out: TextIO, *words: object) -> None:
    out.write(" ".join(str(w) for w in words) + "\n")
    out.flush()


def _serve(arguments: list[str], standby_pid: int) -> None:  # pragma: no cover - runs in the forked child
    """The forked child: die with the standby, default signal handling, then LMCache's server."""
    code = 1
    try:
        die_with_parent()
        if os.getppid() != standby_pid:  # the standby died before the prctl
            os._exit(1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.close(0)
        run_server(arguments)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _reap(out: TextIO, children: set[int]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _report(out, EXITED, pid, os.waitstatus_to_exitcode(status))


def main() -> int:
    preload_lmcache_server()
    # Reports go on a copy of stdout; stdout itself goes where stderr goes (the sidecar's log), so
    # nothing a server prints can interleave with them.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    _report(out, WARM)
    children: set[int] = set()
    stdin: Any = sys.stdin.buffer
    me = os.getpid()
    try:
        while True:
            readable, _w, _x = select.select([stdin], [], [], _REAP_EVERY_S)
            _reap(out, children)
            if not readable:
                continue
            line = stdin.readline()
            if not line.strip():
                return 0
            arguments = [str(a) for a in json.loads(line)]
            pid = os.fork()
            if pid == 0:
                out.close()
                _serve(arguments, me)
            children.add(pid)
            _report(out, SERVING, pid)
    finally:
        for pid in children:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    sys.exit(main())
