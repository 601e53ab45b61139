"""Fixtures for connector tests against a real ``lmcache server`` and the TensorRT-LLM stand-in."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

from kvoffload import contract
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
    env = {
        contract.ENV_PYTHONHASHSEED: "0",
        contract.ENV_BACKEND: contract.BACKEND_SIDECAR,
        contract.ENV_LOOKUP_TIMEOUT_MS: "2000",
        contract.ENV_RETRIEVE_TIMEOUT_MS: "5000",
        contract.ENV_STORE_TIMEOUT_MS: "5000",
        contract.ENV_HEARTBEAT_INTERVAL_MS: "200",
    }
    for name in (contract.ENV_SERVER_URL, contract.ENV_CHUNK_SIZE, contract.ENV_MODEL_NAME, contract.ENV_ASYNC_SAVE):
        monkeypatch.delenv(name, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env
