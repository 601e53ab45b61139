"""A store waits for its copies after it has released the transfer context (the copies may wait for
a forward pass on the device), so the server can restart and the backend re-register in between:
that store's COMMITs belong to the server that prepared it, which is gone."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from kvoffload.connector.backends.engine_process import EngineProcess
from kvoffload.connector.wire import TransferOp
from tests.support.direct_backend import direct_scheduler, direct_worker, pool_for
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import BLOCK, CHUNK, make_prompt

ENV = {
    "KVOFFLOAD_STORE_TIMEOUT_MS": "5000",
    "KVOFFLOAD_RETRIEVE_TIMEOUT_MS": "5000",
    "KVOFFLOAD_LOOKUP_TIMEOUT_MS": "2000",
    "KVOFFLOAD_HEARTBEAT_INTERVAL_MS": "200",
}


PROCESS = EngineProcess()
"""The test's engine process: its scheduler looks up with the layout of the pool its worker registered."""


MODEL = "store-across-restart"


def _wait(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_store_whose_server_restarted_before_its_commit_is_dropped_not_committed_to_the_new_server(
    doomed_server: LMCacheServer, caplog: pytest.LogCaptureFixture
) -> None:
    tokens = 4 * CHUNK
    blocks = tokens // BLOCK
    pool = pool_for(2 * blocks + 1)
    worker = direct_worker(doomed_server, MODEL, ENV, pool, PROCESS)
    assert worker.is_up()
    assert worker.transfers is not None
    prepared_on = worker.registration_generation
    finish = worker.transfers.finish_store

    def restart_then_finish(issued: Any, commit: bool) -> None:
        # Between the PREPAREs and the copy wait: the server restarts and the heartbeat re-registers.
        doomed_server.kill()
        doomed_server.start()
        _wait(lambda: worker.is_up() and worker.registration_generation > prepared_on, "the re-registration")
        finish(issued, commit)

    worker.transfers.finish_store = restart_then_finish  # type: ignore[method-assign]
    token_ids = tuple(make_prompt(7, tokens))
    caplog.set_level(logging.WARNING, logger="kvoffload.connector")
    try:
        worker.copies.store(TransferOp(0, "restarted-store", token_ids, 0, tokens, tuple(range(blocks)), 0, "t"))
        assert worker.wait_commits(10.0), "the store's COMMITs were never sent or dropped"
        logged = caplog.text
        assert "event=commit_dropped operation=store" in logged
        assert "commit_refused" not in logged and "operation=store reason=" not in logged, logged
        scheduler = direct_scheduler(doomed_server, MODEL, ENV, PROCESS)
        try:
            _wait(scheduler.is_up, "the scheduler's connection")
            assert scheduler.lookup("after-restart", token_ids, tokens, "t") == 0  # the new server holds none of it
        finally:
            scheduler.close()
        assert worker.is_up()
    finally:
        worker.close()
