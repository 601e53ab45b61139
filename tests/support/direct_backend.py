"""A connector backend driven directly (no stand-in engine), for tests of its own timing and ordering."""

from __future__ import annotations

import torch

from kvoffload.connector.backends.base import KvGeometry
from kvoffload.connector.backends.cache_server import CacheServerBackend
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.settings import parse_settings
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import BLOCK, connector_llm_args

HEADS, HEAD_DIM, LAYERS = 2, 8, 2
"""The pool geometry of these tests (small: they time nothing)."""


def pool_for(blocks: int) -> torch.Tensor:
    """A CPU pool in TensorRT-LLM's layout with room for ``blocks`` blocks."""
    return torch.randn(blocks, LAYERS, 2, HEADS * BLOCK * HEAD_DIM)


def direct_backend(
    server: LMCacheServer, model: str, role: str, env: dict[str, str], pool: torch.Tensor | None = None
) -> CacheServerBackend:
    """A ``role`` backend of ``model`` on ``server`` with the connector settings ``env``; a worker
    given ``pool`` registers it."""
    settings = parse_settings(env, connector_llm_args(model, server.url, block=BLOCK))
    backend = CacheServerBackend(settings, rank=0, role=role, metrics=ConnectorMetrics(model, "sidecar", enabled=False))
    if pool is not None:
        backend.register(pool, KvGeometry(HEADS, BLOCK, HEAD_DIM))
    return backend
