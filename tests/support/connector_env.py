"""The engine env the operator injects for the connector, set on a test process."""

from __future__ import annotations

import pytest

from kvoffload import contract

SHARED_CORES_LOOKUP_TIMEOUT_MS = 2000
"""Lookup deadline for connectors under test. The product's 100 ms is for an engine on a host of its
own; on two shared CI cores (the server, the ranks, the control plane) one lookup can exceed it,
and a timed-out lookup answers 0, a miss a test would misread."""


def set_connector_env(
    monkeypatch: pytest.MonkeyPatch, lookup_ms: int, retrieve_ms: int, store_ms: int, heartbeat_ms: int = 200
) -> dict[str, str]:
    """Set the sidecar-backend connector env (timeouts in ms) and clear what tests vary; returns it."""
    env = {
        contract.ENV_PYTHONHASHSEED: "0",
        contract.ENV_BACKEND: contract.BACKEND_SIDECAR,
        contract.ENV_LOOKUP_TIMEOUT_MS: str(lookup_ms),
        contract.ENV_RETRIEVE_TIMEOUT_MS: str(retrieve_ms),
        contract.ENV_STORE_TIMEOUT_MS: str(store_ms),
        contract.ENV_HEARTBEAT_INTERVAL_MS: str(heartbeat_ms),
    }
    for name in (contract.ENV_SERVER_URL, contract.ENV_CHUNK_SIZE, contract.ENV_MODEL_NAME, contract.ENV_ASYNC_SAVE):
        monkeypatch.delenv(name, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env
