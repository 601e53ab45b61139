"""Prefix reservations (TensorRT-LLM main's KVCacheManagerV2 path): the engine asks ``reserve_prefix``
instead of ``get_num_new_matched_tokens``, hands each accepted load over as a ``prefix_loads`` item
and finishes it by its reservation id once every rank reported it (``get_finished_prefix_loads``).
Against a real LMCache server: every load bit-exact, every reserved range released exactly once (a
trimmed tail at once, the rest after the load or unstarted), and the server left holding no read lock
of ours; a request cancelled while its load runs keeps its pages until the load finished."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest

from kvoffload import contract
from kvoffload.connector.backends.pool_copies import PoolCopies
from kvoffload.connector.backends.securing import Securing
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import CHUNK, PromptRequest, make_prompt

pytestmark = pytest.mark.connector

V2 = {"kv_cache_manager_v2": True}


def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Wait (bounded) for ``condition``: the loads' COMMITs go out on the connector's own thread."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


def released_once_each(ex: Any) -> dict[int, list[tuple[int, int]]]:
    """Each reservation that offered tokens was released range by range, exactly covering what it
    reserved, no range twice; nothing was released that was never reserved; and no rank reported a
    reservation it was not loading (TensorRT-LLM ignores those). Returns the releases."""
    assert ex.ignored_prefix_completions == 0, "a rank reported a reservation no dispatched load carried"
    reserved = {rid: (start, start + n) for rid, start, (n, _is_async) in ex.reservations_asked if n}
    releases: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for rid, start, end in ex.reservation_releases:
        releases[rid].append((start, end))
    assert set(releases) == set(reserved), f"released {sorted(releases)}, reserved {sorted(reserved)}"
    for rid, (start, end) in reserved.items():
        covered = sorted(releases[rid])
        assert covered[0][0] == start and covered[-1][1] == end, (rid, covered, (start, end))
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered)), f"overlap or gap in {covered}"
    return dict(releases)


def test_a_hit_on_mains_v2_is_reserved_loaded_by_its_reservation_and_released_once(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    ex = executor_factory("reservation-hit-model", lmcache_server.url, llm_args=V2)
    assert ex.reservations, "main's KVCacheManagerV2 runs the connector through prefix reservations"
    prompt = make_prompt(41, 4 * CHUNK + 20)
    first = ex.run([PromptRequest(1, prompt, 3)])[0]
    ex.evict_device_cache()
    before = lmcache_server.held()
    again = ex.run([PromptRequest(2, prompt, 3)])[0]
    assert again.connector_matched_tokens == 4 * CHUNK and again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0
    assert ex.reservations_asked[-1][1:] == (0, (4 * CHUNK, False))
    released_once_each(ex)
    eventually(lambda: lmcache_server.held() == before, "the load's read locks released")
    assert ex.scheduler.tracked_request_ids == frozenset()


def test_a_reservation_trimmed_by_a_failed_grow_releases_its_tail_at_once_and_loads_the_rest(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """A tight pool: V2 serves 48 of the 256 offered tokens; the other 208 are released before the
    load, the 48 after it, and only the 48 are copied."""
    ex = executor_factory("reservation-trim-model", lmcache_server.url, num_blocks=32, context_chunk_size=CHUNK,
                          llm_args=V2)  # fmt: skip
    prompt = make_prompt(42, 4 * CHUNK + 40)
    ex.run([PromptRequest(1, prompt, 1)])
    ex.evict_device_cache()
    before = lmcache_server.held()
    holder = PromptRequest(2, make_prompt(43, 300), 3)
    served = PromptRequest(3, prompt, 3, arrive_after=5)
    results = ex.run([holder, served])
    assert results[1].connector_matched_tokens == 48 and ex.kv_mismatches == 0
    releases = released_once_each(ex)
    trimmed = next(rid for rid, _start, (n, _a) in ex.reservations_asked if n == 4 * CHUNK)
    assert releases[trimmed] == [(48, 4 * CHUNK), (0, 48)], "the tail first, the loaded range after the load"
    eventually(lambda: lmcache_server.held() == before, "every read lock released")


def test_a_candidate_whose_pages_do_not_fit_is_reserved_released_whole_and_reserved_again(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """Main asks ``reserve_prefix`` in the scheduling pass, before the candidate's pages are known to
    fit: one that does not fit is not scheduled, its whole range goes back
    (``release_unused_connector_reservations``) and a later pass asks again under a newer id. Here a
    holder takes most of the pool; the hit is reserved and released while it waits, then loaded."""
    ex = executor_factory("reservation-unfit-model", lmcache_server.url, num_blocks=32, llm_args=V2)
    prompt = make_prompt(50, 4 * CHUNK + 20)
    first = ex.run([PromptRequest(1, prompt, 3)])[0]
    ex.evict_device_cache()
    before = lmcache_server.held()
    asked_before = len(ex.reservations_asked)
    holder = PromptRequest(2, make_prompt(51, 300), 3)
    results = ex.run([holder, PromptRequest(3, prompt, 3, arrive_after=1)])
    served = results[1]
    assert served.connector_matched_tokens == 4 * CHUNK and served.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0
    offers = [(rid, n) for rid, _start, (n, _a) in ex.reservations_asked[asked_before:] if n]
    assert len(offers) >= 2, "reserved while its pages did not fit, then again once they did"
    assert [rid for rid, _n in offers] == sorted(rid for rid, _n in offers), "each time under a newer id"
    releases = released_once_each(ex)
    for rid, n in offers[:-1]:
        assert releases[rid] == [(0, n)], "a candidate that was not scheduled gives its whole range back"
    eventually(lambda: lmcache_server.held() == before, "every read lock released")
    assert ex.scheduler.tracked_request_ids == frozenset()


@pytest.fixture
def parked_loads(monkeypatch: pytest.MonkeyPatch, connector_env: dict[str, str]) -> None:
    """Loads of a chunk or more run asynchronously (the request parks), each 0.3 s long."""
    monkeypatch.setenv(contract.ENV_ASYNC_LOAD_MIN_TOKENS, str(CHUNK))
    start = PoolCopies.start_async_load

    def slow(self: PoolCopies, op: Any) -> Any:
        time.sleep(0.3)
        return start(self, op)

    monkeypatch.setattr(PoolCopies, "start_async_load", slow)


@pytest.mark.usefixtures("parked_loads")
def test_a_parked_load_resumes_its_request_when_its_reservation_finished_and_a_cancel_waits_for_it(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """One parked request runs to the end bit-exact; another, cancelled in the iteration it parked,
    keeps its pages until its load finished (TensorRT-LLM's ``defer_load_termination``); a third
    request reusing its prefix on the device reads right KV."""
    ex = executor_factory("reservation-parked-model", lmcache_server.url, num_blocks=96, llm_args=V2)
    prompts = [make_prompt(44 + i, 3 * CHUNK + 5) for i in range(2)]
    seeded = ex.run([PromptRequest(1 + i, p, 2) for i, p in enumerate(prompts)])
    ex.evict_device_cache()
    before = lmcache_server.held()
    loaded, cancelled = ex.run([PromptRequest(10, prompts[0], 2), PromptRequest(11, prompts[1], 2, cancel_after=1)])
    assert ex.async_loads == 2 and all(answer == (3 * CHUNK, True) for _r, _s, answer in ex.reservations_asked[-2:])
    assert loaded.connector_matched_tokens == 3 * CHUNK and loaded.output_tokens == seeded[0].output_tokens
    assert cancelled.cancelled
    reuse = ex.run([PromptRequest(12, prompts[1][: 3 * CHUNK] + make_prompt(49, 30), 2)])[0]
    assert reuse.device_reused_tokens > 0, "the cancelled request's loaded blocks were kept for reuse"
    assert ex.kv_mismatches == 0
    released_once_each(ex)
    eventually(lambda: lmcache_server.held() == before, "every read lock released")
    assert ex.scheduler.tracked_request_ids == frozenset()


def test_a_replayed_allocation_releases_its_unstarted_load_and_is_reserved_again(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """MAX_UTILIZATION destroys the first allocation before its load started: that reservation goes
    back whole, the replay is asked again under a newer id and loads into its new pages."""
    ex = executor_factory("reservation-replay-model", lmcache_server.url, llm_args=V2)
    prompt = make_prompt(45, 4 * CHUNK + 20)
    first = ex.run([PromptRequest(1, prompt, 3)])[0]
    ex.evict_device_cache()
    before = lmcache_server.held()
    replayed, other = ex.run(
        [PromptRequest(2, prompt, 3, replay_on_admission=True), PromptRequest(3, make_prompt(46, 100), 3)]
    )
    assert not replayed.failed and not other.failed
    assert replayed.connector_matched_tokens == 4 * CHUNK and replayed.output_tokens == first.output_tokens
    offered = [rid for rid, _start, (n, _a) in ex.reservations_asked if n]
    assert len(offered) == 2 and offered[1] > offered[0], "asked again, under a newer id"
    assert ex.reservation_releases[0] == (offered[0], 0, 4 * CHUNK), "the unstarted load went back whole"
    released_once_each(ex)
    assert ex.kv_mismatches == 0
    eventually(lambda: lmcache_server.held() == before, "every read lock released")


def test_a_tp2_engine_finishes_each_reservation_once_both_ranks_loaded_it(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    ex = executor_factory("reservation-tp2-model", lmcache_server.url, llm_args={**V2, "tp": 2})
    prompt = make_prompt(47, 4 * CHUNK + 20)
    first = ex.run([PromptRequest(1, prompt, 2)])[0]
    ex.evict_device_cache()
    again = ex.run([PromptRequest(2, prompt, 2)])[0]
    assert again.connector_matched_tokens == 4 * CHUNK and again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0
    released_once_each(ex)


def test_under_tp2_a_long_hit_parks_and_its_chunks_go_back_only_once_every_rank_copied(
    lmcache_server: LMCacheServer,
    executor_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    connector_env: dict[str, str],
) -> None:
    """Reservations finish a load once every rank reported it, so under tensor parallelism a long hit
    loads asynchronously (the batch goes on) too; its secured chunks are given back to the server
    after the reservation closed, never when rank 0 alone finished copying."""
    monkeypatch.setenv(contract.ENV_ASYNC_LOAD_MIN_TOKENS, str(CHUNK))
    given_back: list[tuple[str, list[tuple[int, int, int]]]] = []
    """Each give-back of secured chunks: its session, and the reservation releases made before it."""
    executor: list[Any] = []
    commit = Securing.commit

    def recorded_commit(self: Securing, session_id: str, *args: Any) -> None:
        given_back.append((session_id, list(executor[0].reservation_releases)))
        commit(self, session_id, *args)

    monkeypatch.setattr(Securing, "commit", recorded_commit)
    ex = executor_factory("reservation-tp2-async-model", lmcache_server.url, llm_args={**V2, "tp": 2})
    executor.append(ex)
    prompt = make_prompt(48, 4 * CHUNK + 20)
    first = ex.run([PromptRequest(1, prompt, 2)])[0]
    ex.evict_device_cache()
    before = lmcache_server.held()
    again = ex.run([PromptRequest(2, prompt, 2)])[0]
    assert ex.async_loads == 1, "the TP2 hit parked on an asynchronous load"
    assert again.connector_matched_tokens == 4 * CHUNK and again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0
    rid = ex.reservations_asked[-1][0]
    mine = [releases for session, releases in given_back if session == ex.scheduler.session_id(2)]
    assert mine, "the load's chunks were never given back"
    assert all((rid, 0, 4 * CHUNK) in releases for releases in mine), "given back before every rank finished it"
    released_once_each(ex)
    eventually(lambda: lmcache_server.held() == before, "every read lock released")
