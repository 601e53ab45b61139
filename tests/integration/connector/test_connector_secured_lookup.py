"""A hit is looked up and secured in one call to the sidecar's server (``kvoffload.secured_lookup``),
with the slots and the lock accounting of looking up and securing apart, against the real LMCache
0.5.6 server run as the sidecar runs it (and a plain one, which gets the requests apart).

The server's counts come from its own ``GET /status``: the module's calls, and the read locks,
reservations and prefetch jobs it holds (read as the sidecar's metrics read them).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvoffload import secured_lookup
from kvoffload.connector.backends.engine_process import EngineProcess
from kvoffload.connector.backends.scheduler_client import SchedulerClient
from kvoffload.connector.backends.worker_backend import WorkerBackend
from kvoffload.connector.lmcache_seam import ServerModuleCallRequest
from kvoffload.connector.wire import TransferOp
from tests.support.direct_backend import direct_scheduler, direct_worker, pool_for
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import BLOCK, CHUNK, PromptRequest, make_prompt

pytestmark = pytest.mark.connector

CHUNKS = 4
TOKENS = CHUNKS * CHUNK
BLOCKS = TOKENS // BLOCK
ENV = {
    "KVOFFLOAD_STORE_TIMEOUT_MS": "5000",
    "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "5000",
    "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "2000",
    "KVOFFLOAD_HEARTBEAT_INTERVAL_MS": "200",
}


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def module_counts(server: LMCacheServer) -> dict[str, int]:
    counts: dict[str, int] = server.status()["kvoffload_secured_lookups"]
    return counts


class Engine:
    """One engine process's worker (its pool registered) and scheduler on a server, a prompt stored."""

    def __init__(self, server: LMCacheServer, model: str, seed: int) -> None:
        self.pool, process = pool_for(3 * BLOCKS), EngineProcess()
        self.worker: WorkerBackend = direct_worker(server, model, ENV, self.pool, process)
        self.scheduler: SchedulerClient = direct_scheduler(server, model, ENV, process)
        self.prompt = tuple(make_prompt(seed, TOKENS + 1))
        self.source = tuple(range(BLOCKS))
        self.worker.copies.store(TransferOp(1, f"store-{model}", self.prompt[:TOKENS], 0, TOKENS, self.source, 0, ""))
        assert self.worker.wait_commits(10.0), "the store's COMMIT was never answered"

    def load(self, secured: Any, start: int, end: int, target_first: int) -> bool:
        """Copy the secured chunks ``[start, end)`` into the pool from block ``target_first``: bit-exact?"""
        target = tuple(range(target_first, target_first + (end - start) // BLOCK))
        op = TransferOp(2, "load", self.prompt[:end], start, end, target, 0, "", secured=secured)
        (result,) = self.worker.copies.load_secured([op])
        assert result.error is None, result.error
        return torch.equal(self.pool[list(target)], self.pool[list(self.source[start // BLOCK : end // BLOCK])])

    def release(self, session: str, load: Any, start: int = 0, end: int = TOKENS) -> None:
        """Give a secured load of ``[start, end)`` back and end its session."""
        self.scheduler.release_secured(session, self.prompt[:end], start, end, "", load)
        self.scheduler.end_session(session)

    def close(self) -> None:
        self.scheduler.close()
        self.worker.close()


@pytest.fixture
def engine(plain_and_sidecar_servers: dict[str, LMCacheServer], request: pytest.FixtureRequest) -> Iterator[Engine]:
    made = Engine(
        plain_and_sidecar_servers["sidecar"], f"secured-{request.node.name[:40]}", seed=len(request.node.name)
    )
    eventually(lambda: made.scheduler.looks_up_in_one_call, "the scheduler learned the server has secured lookups")
    try:
        yield made
    finally:
        made.close()


def test_a_hit_is_looked_up_and_secured_in_one_call_with_the_slots_of_the_requests_apart_and_loads_bit_exact(
    plain_and_sidecar_servers: dict[str, LMCacheServer], engine: Engine
) -> None:
    server, scheduler, prompt = plain_and_sidecar_servers["sidecar"], engine.scheduler, engine.prompt
    before, calls = server.held(), module_counts(server)["calls"]
    apart_hit = scheduler.lookup("apart", prompt, TOKENS, "")
    apart = scheduler.secure("apart", prompt[:TOKENS], 0, TOKENS, "")
    assert apart_hit == TOKENS and apart is not None
    engine.release("apart", apart)
    eventually(lambda: server.held() == before, "the load secured apart gave its chunks back")

    t0 = time.perf_counter()
    found = scheduler.lookup_and_secure("one", prompt, TOKENS, "", 0, TOKENS)
    waited = time.perf_counter() - t0
    assert module_counts(server)["calls"] == calls + 1, "the hit went to the server in one call"
    assert found is not None and 0 < found.prepare_s < found.server_s < waited, "the server says what it spent"
    assert found is not None and found.hit == TOKENS and (found.start, found.end) == (0, TOKENS)
    assert found.load is not None and found.load.slots == apart.slots
    assert engine.load(found.load, 0, TOKENS, BLOCKS), "the load through the secured slots is not bit-exact"
    engine.release("one", found.load)
    eventually(lambda: server.held() == before, "the one call's read locks and prefetch job released")


def test_a_device_prefix_and_the_promise_cap_leave_no_lookup_lock_outside_the_secured_range(
    plain_and_sidecar_servers: dict[str, LMCacheServer], engine: Engine
) -> None:
    server, scheduler, prompt = plain_and_sidecar_servers["sidecar"], engine.scheduler, engine.prompt
    before = server.held()
    found = scheduler.lookup_and_secure("inside", prompt, TOKENS, "", CHUNK, 3 * CHUNK)
    assert found is not None and found.hit == TOKENS and (found.start, found.end) == (CHUNK, 3 * CHUNK)
    assert found.load is not None and len(found.load.slots[0]) == 2
    assert engine.load(found.load, CHUNK, 3 * CHUNK, BLOCKS), "the middle chunks did not load bit-exact"
    engine.release("inside", found.load, CHUNK, 3 * CHUNK)
    eventually(lambda: server.held() == before, "the chunks before and after the load were freed by the server")
    # A hit that ends where the device's prefix does secures nothing, and frees every lock.
    nothing = scheduler.lookup_and_secure("device-has-it", prompt, TOKENS, "", TOKENS, TOKENS)
    assert nothing is not None and nothing.hit == TOKENS and nothing.load is None
    scheduler.end_session("device-has-it")
    eventually(lambda: server.held() == before, "a hit the device holds already left no lock")


def test_a_second_load_of_a_key_still_held_shares_its_slots_and_leaves_no_read_lock_behind(
    plain_and_sidecar_servers: dict[str, LMCacheServer], engine: Engine
) -> None:
    server, scheduler, prompt = plain_and_sidecar_servers["sidecar"], engine.scheduler, engine.prompt
    before, held = server.held(), module_counts(server)["held"]
    first = scheduler.lookup_and_secure("first", prompt, TOKENS, "", 0, TOKENS)
    second = scheduler.lookup_and_secure("second", prompt, TOKENS, "", 0, TOKENS)
    assert first is not None and second is not None and first.load is not None
    assert module_counts(server)["held"] == held + 1, "the server refused a second PREPARE of the held key"
    assert second.load is first.load, "the second load reads the slots the first secured"
    for session, found in (("first", first), ("second", second)):
        assert found.load is not None
        assert engine.load(found.load, 0, TOKENS, BLOCKS), f"{session}: not bit-exact"
        engine.release(session, found.load)
    eventually(lambda: server.held() == before, "both loads' read locks released, once")
    third = scheduler.lookup_and_secure("third", prompt, TOKENS, "", 0, TOKENS)
    assert third is not None and third.load is not None and third.load is not first.load
    engine.release("third", third.load)
    eventually(lambda: server.held() == before, "a load of the key after both went back secured it afresh")


def test_a_load_secured_after_its_caller_stopped_waiting_is_given_back_by_the_server(
    plain_and_sidecar_servers: dict[str, LMCacheServer], engine: Engine
) -> None:
    server, scheduler, prompt = plain_and_sidecar_servers["sidecar"], engine.scheduler, engine.prompt
    before = server.held()
    keys = engine.worker.chunk_keys
    lookup_key = keys.key("late", prompt, 0, TOKENS, "", worker=False)
    fields = secured_lookup.KEY_FIELDS
    request = secured_lookup.SecuredLookupRequest(
        lookup_key={name: getattr(lookup_key, name) for name in fields},
        rank_keys=tuple({name: getattr(k, name) for name in fields} for k in keys.of_every_rank("late", prompt, 0, 0, "")),
        token_ids=prompt[:TOKENS], start=0, cap=TOKENS, instance_id=engine.worker.instance_id,
        wait_s=2.0, budget_s=2.0, give_back_s=0.0,
    )  # fmt: skip
    call = ServerModuleCallRequest(method=secured_lookup.METHOD, payload=secured_lookup.encode_request(request))
    response = scheduler.connection.client.server_module_call(call).result(timeout=10)
    answer = secured_lookup.decode_answer(response.payload)
    assert answer.given_back and answer.hit == TOKENS and answer.slots == ()
    scheduler.end_session("late")
    eventually(lambda: server.held() == before, "the server gave back what nobody waited for")
    found = scheduler.lookup_and_secure("after", prompt, TOKENS, "", 0, TOKENS)
    assert found is not None and found.load is not None, "no pending read of the key was left behind"
    engine.release("after", found.load)
    eventually(lambda: server.held() == before, "the load after it gave its chunks back")


def test_a_plain_lmcache_server_is_looked_up_and_secured_apart(
    plain_and_sidecar_servers: dict[str, LMCacheServer],
) -> None:
    made = Engine(plain_and_sidecar_servers["lmcache"], "secured-plain", seed=7)
    try:
        time.sleep(1.0)  # the scheduler asked the server at start; the heartbeat asks again each connection
        assert not made.scheduler.looks_up_in_one_call
        assert made.scheduler.lookup_and_secure("plain", made.prompt, TOKENS, "", 0, TOKENS) is None
        assert made.scheduler.lookup("plain", made.prompt, TOKENS, "") == TOKENS
        secured = made.scheduler.secure("plain", made.prompt[:TOKENS], 0, TOKENS, "")
        assert secured is not None and made.load(secured, 0, TOKENS, BLOCKS)
        made.release("plain", secured)
    finally:
        made.close()


def test_the_engines_hits_on_the_sidecars_server_go_in_one_call_and_load_bit_exact(
    plain_and_sidecar_servers: dict[str, LMCacheServer], executor_factory: Any
) -> None:
    server = plain_and_sidecar_servers["sidecar"]
    prompt = make_prompt(123, 6 * CHUNK + 5)
    writer = executor_factory("secured-engine", server.url, num_blocks=128)
    writer.run([PromptRequest(1, prompt)])
    reader = executor_factory("secured-engine", server.url, num_blocks=128)
    eventually(lambda: reader.scheduler.backend.looks_up_in_one_call, "the reader's scheduler asked its server")
    calls = module_counts(server)["calls"]
    results = reader.run([PromptRequest(2, prompt)])
    assert results[0].connector_matched_tokens == 6 * CHUNK
    assert reader.kv_mismatches == 0
    assert module_counts(server)["calls"] == calls + 1


def test_the_sidecars_server_logs_no_line_per_request_and_keeps_its_others(
    plain_and_sidecar_servers: dict[str, LMCacheServer], executor_factory: Any
) -> None:
    prompt = make_prompt(321, 4 * CHUNK + 3)
    for name, server in plain_and_sidecar_servers.items():
        executor_factory(f"logs-{name}", server.url, num_blocks=64).run([PromptRequest(1, prompt)])
        executor_factory(f"logs-{name}", server.url, num_blocks=64).run([PromptRequest(2, prompt)])
    per_request = ("Prefetch request completed", "Stored ", "Retrieved ")
    logs = {name: server.log_path.read_text(errors="replace") for name, server in plain_and_sidecar_servers.items()}
    assert "Retrieved " in logs["lmcache"] and "Stored " in logs["lmcache"], "LMCache logs them itself"
    assert not any(line in logs["sidecar"] for line in per_request), "the sidecar's server leaves them out"
    assert "Registered non-GPU context for instance" in logs["sidecar"], "its other INFO lines stay"
