"""Fixtures for connector tests against a real ``lmcache server`` and the TensorRT-LLM stand-in."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from tests.support.connector_env import set_connector_env
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import CHUNK, STANDIN_PATH

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


@pytest.fixture
def connector_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Connector env as the operator injects it (timeouts short so failure tests stay quick)."""
    return set_connector_env(monkeypatch, lookup_ms=2000, retrieve_ms=5000, store_ms=5000)
