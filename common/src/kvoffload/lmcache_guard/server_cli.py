"""LMCache's own server: its command line, run in this process (warm, behind the restricted
unpickler), and the decorator its server modules register request handlers with."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.lmcache_guard.unpickling import install_restricted_unpickler


def run_lmcache_cli(arguments: Sequence[str]) -> None:
    """Run LMCache's own command line (``lmcache server ...``) in this process."""
    import lmcache.cli.main as cli

    sys.argv = ["lmcache", *arguments]
    cli.main(list(arguments))


def preload_lmcache_server() -> None:
    """Import what ``lmcache server`` imports when it runs (``lmcache.cli.commands.server``) and
    build its parser once, which imports every registered L2 adapter (its ``--help`` lists them),
    then put the restricted unpickler in place: a server forked from this process starts warm."""
    import lmcache.cli.main
    import lmcache.v1.distributed.config
    import lmcache.v1.mp_observability.config
    import lmcache.v1.multiprocess.config
    import lmcache.v1.multiprocess.http_server  # noqa: F401
    from lmcache.cli.commands import register_commands

    register_commands(argparse.ArgumentParser(prog="lmcache").add_subparsers(dest="command"), ["server"])
    install_restricted_unpickler()


def server_module_handler(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """LMCache's decorator that registers a server module's method as the handler of ``method``."""
    from lmcache.v1.multiprocess.ext_server_module import server_module_handler as lmcache_handler

    return lmcache_handler(method)
