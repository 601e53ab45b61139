"""Faults between a lookup and its load: the cache server killed right after the scheduler secured a load."""

from __future__ import annotations

from typing import Any

from tests.support.lmcache_server import LMCacheServer


def kill_after_first_hit(executor: Any, server: LMCacheServer) -> list[int]:
    """From now on, the first lookup of ``executor``'s scheduler that answers a hit SIGKILLs ``server``
    right after it (its load was secured); the list gets that hit's token count."""
    lookup = executor.scheduler.get_num_new_matched_tokens
    killed: list[int] = []

    def lookup_then_kill(request: Any, computed: int) -> tuple[int, bool]:
        result = lookup(request, computed)
        if result[0] > 0 and not killed:
            killed.append(result[0])
            server.kill()
        return result

    executor.scheduler.get_num_new_matched_tokens = lookup_then_kill
    return killed
