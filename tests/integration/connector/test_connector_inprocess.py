"""The in-process backend: LMCache's engine inside the (stand-in) TensorRT-LLM process."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator

import pytest

from hack.ports import free_port
from kvoffload import contract
from kvoffload.connector.runtime import engine_process
from tests.support.trtllm_executor import CHUNK, PromptRequest, StandinExecutor, connector_llm_args, make_prompt

pytestmark = pytest.mark.connector


@pytest.fixture
def inprocess_env(connector_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv(contract.ENV_BACKEND, contract.BACKEND_INPROCESS)
    monkeypatch.setenv(contract.ENV_CHUNK_SIZE, str(CHUNK))
    monkeypatch.setenv(contract.ENV_L1_SIZE, "128Mi")
    yield
    engine_process().inprocess.stop()


@pytest.mark.usefixtures("inprocess_env")
def test_inprocess_store_evict_load_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Request 1 stores into the in-process engine; after eviction request 2 loads the prefix bit-exact.
    No sidecar serves the pod's /metrics here: the connector does, on the port the operator sets."""
    port = free_port()
    monkeypatch.setenv(contract.ENV_METRICS_PORT, str(port))
    ex = StandinExecutor(connector_llm_args("inproc-model", None), num_blocks=64)
    try:
        p1 = make_prompt(11, 170)
        (r1,) = ex.run([PromptRequest(1, p1, 3)])
        assert ex.evict_device_cache() > 0
        p2 = p1 + make_prompt(12, 50)
        (r2,) = ex.run([PromptRequest(2, p2, 3)])
        expected = (len(p1) // CHUNK) * CHUNK
        assert not r1.failed and not r2.failed
        assert r2.connector_matched_tokens == expected
        assert r2.computed_prompt_tokens == len(p2) - expected
        assert ex.kv_mismatches == 0
        engine_process().metrics.flush_all()
        served = _endpoint_port()
        with urllib.request.urlopen(f"http://127.0.0.1:{served}{contract.PATH_METRICS}", timeout=5) as resp:
            text = resp.read().decode()
        labels = f'{{backend="{contract.BACKEND_INPROCESS}",model="inproc-model"}}'
        assert f"{contract.M_LOOKUP_HIT_TOKENS}_total{labels} {float(expected)}" in text
        assert f"{contract.M_RETRIEVE_REQUESTS}_total{labels} 1.0" in text
        from kvoffload.lmcache_guard.unpickling import unpickler_is_restricted

        assert unpickler_is_restricted(), "the engine's own LMCache server unpickles through kvoffload's guard"
    finally:
        ex.close()


def _endpoint_port() -> int:
    """The port this process serves on (the first test to set one bound it for the process)."""
    endpoint = engine_process().metrics.endpoint
    assert endpoint is not None and endpoint.serving, "the connector serves /metrics without a sidecar"
    return endpoint.port


def test_inprocess_rejects_tensor_parallel(connector_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """TP>1 needs one store shared by all ranks: the in-process backend refuses with a precise error."""
    from kvoffload.connector.backends.inprocess import InProcessServer
    from kvoffload.connector.settings import SettingsError, parse_settings

    monkeypatch.setenv(contract.ENV_BACKEND, contract.BACKEND_INPROCESS)
    settings = parse_settings(dict(os.environ), connector_llm_args("m", None, tp=2))
    with pytest.raises(SettingsError, match="tensor_parallel_size=1"):
        InProcessServer().start(settings)
