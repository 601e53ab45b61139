"""Faults between a lookup and its load: the cache server killed (or restarted) right after the
scheduler answered a lookup, through either of TensorRT-LLM's entry points."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.support.lmcache_server import LMCacheServer

LookupAnswer = tuple[int, bool]


def after_each_lookup(scheduler: Any, then: Callable[[LookupAnswer], None]) -> Callable[[], None]:
    """From now on ``then(answer)`` runs right after each lookup ``scheduler`` answers, before the
    engine sees the answer: ``get_num_new_matched_tokens`` and main's ``reserve_prefix`` (which
    KVCacheManagerV2 calls instead). Returns what puts both entry points back."""
    lookup = scheduler.get_num_new_matched_tokens
    reserve = getattr(scheduler, "reserve_prefix", None)

    def looked_up(request: Any, computed: int) -> LookupAnswer:
        answer = lookup(request, computed)
        then(answer)
        return answer

    def reserved(request: Any, computed: int, reservation_id: int) -> LookupAnswer:
        answer = reserve(request, computed, reservation_id)
        then(answer)
        return answer

    scheduler.get_num_new_matched_tokens = looked_up
    if reserve is not None:
        scheduler.reserve_prefix = reserved

    def restore() -> None:
        scheduler.get_num_new_matched_tokens = lookup
        if reserve is not None:
            scheduler.reserve_prefix = reserve

    return restore


def kill_after_first_hit(executor: Any, server: LMCacheServer) -> list[int]:
    """From now on, the first lookup of ``executor``'s scheduler that answers a hit SIGKILLs ``server``
    right after it (its load was secured); the list gets that hit's token count."""
    killed: list[int] = []

    def kill_on_first_hit(answer: LookupAnswer) -> None:
        if answer[0] > 0 and not killed:
            killed.append(answer[0])
            server.kill()

    after_each_lookup(executor.scheduler, kill_on_first_hit)
    return killed
