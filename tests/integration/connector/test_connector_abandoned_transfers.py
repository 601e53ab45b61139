"""A failed or abandoned transfer leaves nothing behind (issue 49), against the real LMCache 0.5.6
server run as the sidecar runs it (behind ``kvoffload.lmcache_guard``):

- a store that fails between PREPARE_STORE and COMMIT (its copy raises at the first or a later chunk
  group, its PREPARE times out on a stalled server, its engine is killed) publishes nothing: the next
  engines are offered only what was committed and read it bit-exact; the server's L1 is back to its
  level before the store;
- a lookup answered too late, and two identical prompts loading at once, leave no read lock and no
  prefetch job on the server once their requests ended.

The server's numbers come from its own ``GET /status`` (read as the sidecar's metrics read it).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvoffload.connector.backends import pool_transfers
from kvoffload.connector.backends.base import BackendError
from kvoffload.connector.wire import TransferOp
from tests.support.direct_backend import backend_pair, direct_worker, pool_for
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import (
    BLOCK,
    CHUNK,
    REPO_ROOT,
    PromptRequest,
    StandinExecutor,
    connector_llm_args,
    make_prompt,
)

pytestmark = pytest.mark.connector

PROMPT_TOKENS = 8 * CHUNK
"""Eight chunks: a store of them goes in four groups of two (``STORE_PIPELINE_GROUPS``)."""
REAP_S = 30
"""The server's worker reap timeout (LMCache's floor): a killed engine's registration goes after it."""
ENV = {
    "KVOFFLOAD_STORE_TIMEOUT_MS": "5000",
    "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "5000",
    "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "2000",
    "KVOFFLOAD_HEARTBEAT_INTERVAL_MS": "200",
}


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    """The sidecar's server: LMCache's CLI behind kvoffload's guards; dead workers reaped after 30 s."""
    server = LMCacheServer(
        chunk_size=CHUNK,
        log_dir=tmp_path_factory.mktemp("lmcache"),
        guarded=True,
        extra_args=("--worker-reap-timeout-seconds", str(REAP_S), "--worker-registration-grace-seconds", str(REAP_S)),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def l1_used_bytes(server: LMCacheServer) -> int:
    return int(server.status()["storage_manager"]["l1_manager"]["memory_used_bytes"])


def registered_workers(server: LMCacheServer) -> set[str]:
    """The instance ids of the workers the server holds registered."""
    return {str(worker) for worker in server.status()["registered_non_cuda_instance_ids"]}


def run_then_close(model: str, server: LMCacheServer, prompt: list[int]) -> None:
    """One engine runs ``prompt``, then closes (its connector unregisters its context)."""
    engine = StandinExecutor(connector_llm_args(model, server.url), num_blocks=64)
    try:
        engine.run([PromptRequest(1, prompt)])
    finally:
        engine.close()


def eventually(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Wait (bounded) for ``condition``: releases go out on the connector's own threads."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.1)


@pytest.mark.parametrize("failing_copy", [1, 2], ids=["first-group", "later-group"])
def test_a_store_whose_copy_raises_publishes_nothing_and_the_next_engines_read_only_right_kv(
    guarded_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch, failing_copy: int
) -> None:
    model = f"copy-raises-{failing_copy}"
    prompt = make_prompt(90 + failing_copy, PROMPT_TOKENS)
    used_before, held_before = l1_used_bytes(guarded_server), guarded_server.held()
    copies = 0
    gather = pool_transfers.gather_chunks

    def gather_failing(*args: Any, **kwargs: Any) -> Any:
        nonlocal copies
        copies += 1
        if copies == failing_copy:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return gather(*args, **kwargs)

    monkeypatch.setattr(pool_transfers, "gather_chunks", gather_failing)
    run_then_close(model, guarded_server, prompt)  # its close unregisters: nothing pending may be published
    assert copies >= failing_copy, "the store never reached the failing copy"
    monkeypatch.setattr(pool_transfers, "gather_chunks", gather)

    assert guarded_server.held().reserved_chunks == held_before.reserved_chunks
    assert l1_used_bytes(guarded_server) == used_before, "the failed store's slots stayed in L1"
    second = executor_factory(model, guarded_server.url)
    [computed] = second.run([PromptRequest(2, prompt)])
    assert computed.connector_matched_tokens == 0, "offered chunks nobody committed"
    assert second.kv_mismatches == 0
    third = executor_factory(model, guarded_server.url)
    [loaded] = third.run([PromptRequest(3, prompt)])
    assert loaded.connector_matched_tokens > 0  # what the second engine stored, committed
    assert third.kv_mismatches == 0


def test_a_store_whose_prepare_timed_out_on_a_stalled_server_is_never_published(
    guarded_server: LMCacheServer,
) -> None:
    """The commonest trigger: the server stalls (a CPU-throttled container) during a store; the
    PREPARE_STORE times out here, the server makes the reservation once it runs again."""
    tokens, blocks = CHUNK, CHUNK // BLOCK
    env = {**ENV, "KVOFFLOAD_STORE_TIMEOUT_MS": "300"}
    worker = direct_worker(guarded_server, "stalled-store", env, pool_for(blocks + 1))
    prompt = tuple(make_prompt(97, tokens))
    used_before = l1_used_bytes(guarded_server)
    try:
        with guarded_server.paused():
            with pytest.raises(BackendError):
                worker.copies.store(TransferOp(0, "stalled", prompt, 0, tokens, tuple(range(blocks)), 0, "t"))
            time.sleep(0.5)  # the server stays stopped past the PREPARE's timeout
        eventually(lambda: worker.is_up() and worker.committer.unaborted == 0, "the abort answered")
    finally:
        worker.close()
    eventually(lambda: guarded_server.held().reserved_chunks == 0, "the reservation dropped")
    assert l1_used_bytes(guarded_server) == used_before
    next_worker, scheduler = backend_pair(guarded_server, "stalled-store", ENV, blocks)  # the engine after it
    try:
        assert scheduler.lookup("after-stall", prompt, tokens, "t") == 0, "an uncopied reservation was published"
    finally:
        scheduler.end_session("after-stall")
        scheduler.close()
        next_worker.close()


def test_an_engine_killed_between_prepare_and_commit_leaves_nothing_its_successor_could_read(
    guarded_server: LMCacheServer, executor_factory: Any
) -> None:
    model = "killed-mid-store"
    used_before = l1_used_bytes(guarded_server)
    workers_before = registered_workers(guarded_server)
    dying = subprocess.run(
        [sys.executable, "-m", "tests.support.dying_engine", guarded_server.url, model, "95", str(PROMPT_TOKENS)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert dying.returncode == -signal.SIGKILL, dying.stdout + dying.stderr
    assert guarded_server.held().reserved_chunks > 0  # its reservation outlives it, staged
    # The server reaps the silent worker: what it had reserved goes with it, unpublished. (By its ids:
    # an earlier test's worker still registered may be reaped meanwhile, so a count can stay off.)
    eventually(lambda: registered_workers(guarded_server) <= workers_before, "the dead engine reaped",
               timeout_s=3 * REAP_S)  # fmt: skip
    assert guarded_server.held().reserved_chunks == 0
    assert l1_used_bytes(guarded_server) == used_before
    successor = executor_factory(model, guarded_server.url)
    [result] = successor.run([PromptRequest(1, make_prompt(95, PROMPT_TOKENS))])
    assert result.connector_matched_tokens == 0, "offered what the killed engine never committed"
    assert successor.kv_mismatches == 0


def test_a_lookup_answered_too_late_leaves_no_read_lock_and_no_prefetch_job_behind_its_request(
    guarded_server: LMCacheServer,
) -> None:
    tokens, blocks = PROMPT_TOKENS, PROMPT_TOKENS // BLOCK
    env = {**ENV, "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "300"}
    worker, scheduler = backend_pair(guarded_server, "late-lookup", env, blocks)
    prompt = tuple(make_prompt(98, tokens))
    try:
        worker.copies.store(TransferOp(0, "stored", prompt, 0, tokens, tuple(range(blocks)), 0, "t"))
        assert worker.wait_commits(10.0)
        before = guarded_server.held()
        with guarded_server.paused(), pytest.raises(BackendError):
            scheduler.lookup("late", prompt, tokens, "t")
        # Running again, the server starts the prefetch and read-locks every chunk of the prompt.
        eventually(lambda: guarded_server.held().read_locked_chunks == before.read_locked_chunks + 8,
                   "the late prefetch's locks")  # fmt: skip
        # The session's next lookup settles the late one first, then hits; its own locks go with its free.
        assert scheduler.lookup("late", prompt, tokens, "t") == tokens
        scheduler.free_lookup_locks("late", prompt, ((0, tokens),), "t")
        scheduler.end_session("late")
        eventually(lambda: guarded_server.held() == before, "the late lookup's locks and job released")
        # Late again, and the request ends: its end settles it.
        with guarded_server.paused(), pytest.raises(BackendError):
            scheduler.lookup("late-then-ended", prompt, tokens, "t")
        scheduler.end_session("late-then-ended")
        eventually(lambda: guarded_server.held() == before, "the ended request's locks and job released")
    finally:
        scheduler.close()
        worker.close()


def test_two_identical_prompts_loading_at_once_leave_no_read_lock_behind(
    guarded_server: LMCacheServer, executor_factory: Any
) -> None:
    prompt = make_prompt(99, PROMPT_TOKENS)
    run_then_close("twin-loads", guarded_server, prompt)
    before = guarded_server.held()
    reader = executor_factory("twin-loads", guarded_server.url, num_blocks=128)
    results = reader.run([PromptRequest(2, prompt), PromptRequest(3, prompt)])
    matched = [r.connector_matched_tokens for r in results]
    assert matched[0] > 0 and matched[0] == matched[1], f"both loads read the stored prefix: {matched}"
    assert reader.kv_mismatches == 0
    eventually(lambda: guarded_server.held() == before, "both loads' locks released")
