"""Fixtures for connector tests against a real ``lmcache server`` and the TensorRT-LLM stand-in."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload import contract
from tests.support.connector_env import SHARED_CORES_LOOKUP_TIMEOUT_MS, set_connector_env
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import CHUNK, STANDIN_PATH, StandinExecutor, connector_llm_args

if STANDIN_PATH not in sys.path:
    sys.path.insert(0, STANDIN_PATH)


@pytest.fixture(scope="module")
def lmcache_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LMCacheServer]:
    """One real LMCache MP server per test module (tests isolate themselves by model name)."""
    server = LMCacheServer(chunk_size=CHUNK, log_dir=tmp_path_factory.mktemp("lmcache"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def plain_and_sidecar_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, LMCacheServer]]:
    """A plain LMCache server (``"lmcache"``) and one behind kvoffload's guards, as the sidecar runs it
    (``"sidecar"``), per test module."""
    started = {
        "lmcache": LMCacheServer(chunk_size=CHUNK, log_dir=tmp_path_factory.mktemp("plain")),
        "sidecar": LMCacheServer(chunk_size=CHUNK, log_dir=tmp_path_factory.mktemp("guarded"), guarded=True),
    }
    for server in started.values():
        server.start()
    try:
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture
def connector_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Connector env as the operator injects it (timeouts short so failure tests stay quick)."""
    return set_connector_env(monkeypatch, lookup_ms=SHARED_CORES_LOOKUP_TIMEOUT_MS, retrieve_ms=5000, store_ms=5000)


@pytest.fixture
def doomed_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, connector_env: dict[str, str]
) -> Iterator[LMCacheServer]:
    """A server of the test's own, which the test kills; loads time out after 1 s (over ``connector_env``)."""
    monkeypatch.setenv(contract.ENV_RETRIEVE_TIMEOUT_MS, "1000")
    server = LMCacheServer(chunk_size=CHUNK, log_dir=tmp_path / "lmcache")
    server.start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def no_commit_left_pending() -> Iterator[None]:
    """Every COMMIT a test queued is answered or dropped by its end: one left pending in this process
    would fail every later test's ``settle_commits`` instead of this one."""
    from kvoffload.connector.runtime import engine_process

    yield
    pending = engine_process().pending
    if not pending.wait_idle(15.0):
        pytest.fail(f"COMMITs still pending after the test, sessions {pending.sessions()}")


@pytest.fixture
def executor_factory(connector_env: dict[str, str]) -> Iterator[Any]:
    """Build stand-in executors; all are closed at teardown."""
    made: list[StandinExecutor] = []

    def make(model: str, url: str | None, **kwargs: Any) -> StandinExecutor:
        llm_args = connector_llm_args(model, url, **kwargs.pop("llm_args", {}))
        ex = StandinExecutor(llm_args, num_blocks=kwargs.pop("num_blocks", 64), **kwargs)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.close()
