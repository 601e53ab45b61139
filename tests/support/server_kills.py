"""Faults between a lookup and its load: the cache server killed right after the scheduler secured a load."""

from __future__ import annotations

from typing import Any

from tests.support.lmcache_server import LMCacheServer


def kill_after_first_hit(executor: Any, server: LMCacheServer) -> list[int]:
    """From now on, the first lookup of ``executor``'s scheduler that answers a hit SIGKILLs ``server``
    right after it (its load was secured); the list gets that hit's token count. Both of TensorRT-LLM's
    lookup entry points are covered: ``get_num_new_matched_tokens`` and main's ``reserve_prefix``."""
    scheduler = executor.scheduler
    killed: list[int] = []

    def kill_on_first_hit(result: tuple[int, bool]) -> tuple[int, bool]:
        if result[0] > 0 and not killed:
            killed.append(result[0])
            server.kill()
        return result

    lookup = scheduler.get_num_new_matched_tokens
    scheduler.get_num_new_matched_tokens = lambda request, computed: kill_on_first_hit(lookup(request, computed))
    reserve = getattr(scheduler, "reserve_prefix", None)
    if reserve is not None:
        scheduler.reserve_prefix = lambda request, computed, reservation_id: kill_on_first_hit(
            reserve(request, computed, reservation_id)
        )
    return killed
