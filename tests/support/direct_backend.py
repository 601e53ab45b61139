"""A connector backend driven directly (no stand-in engine), for tests of its own timing and ordering."""

from __future__ import annotations

import threading

import torch

from kvoffload.connector.backends.base import KvGeometry
from kvoffload.connector.backends.cache_server import CacheServerBackend
from kvoffload.connector.backends.commits import DeferredCommit
from kvoffload.connector.backends.engine_process import EngineProcess
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
    server: LMCacheServer,
    model: str,
    role: str,
    env: dict[str, str],
    pool: torch.Tensor | None = None,
    process: EngineProcess | None = None,
) -> CacheServerBackend:
    """A ``role`` backend of ``model`` on ``server`` with the connector settings ``env``, in engine
    process ``process`` (a new one if None); a worker given ``pool`` registers it."""
    settings = parse_settings(env, connector_llm_args(model, server.url, block=BLOCK))
    backend = CacheServerBackend(settings, rank=0, role=role, metrics=ConnectorMetrics(model, "sidecar", enabled=False),
                                 process=process or EngineProcess())  # fmt: skip
    if pool is not None:
        backend.register(pool, KvGeometry(HEADS, BLOCK, HEAD_DIM))
    return backend


def backend_pair(
    server: LMCacheServer, model: str, env: dict[str, str], blocks: int
) -> tuple[CacheServerBackend, CacheServerBackend]:
    """A worker (its pool registered, room for ``blocks`` blocks) and a scheduler of ``model`` on
    ``server``, in one engine process (the scheduler secures loads through that worker)."""
    process = EngineProcess()
    return (direct_backend(server, model, "worker", env, pool_for(blocks + 1), process),
            direct_backend(server, model, "scheduler", env, process=process))  # fmt: skip


def hold_store_commits(worker: CacheServerBackend, timeout_s: float) -> tuple[threading.Event, threading.Event]:
    """Hold ``worker``'s store COMMITs at its committer until ``release`` is set (at most ``timeout_s``
    each); ``held`` is set when the first one arrives. Returns ``(held, release)``."""
    held, release = threading.Event(), threading.Event()
    send = worker.committer.send

    def hold(item: DeferredCommit) -> None:
        if item.operation == "store":
            held.set()
            release.wait(timeout_s)
        send(item)

    worker.committer.send = hold  # type: ignore[method-assign]
    return held, release


def stop_heartbeat(backend: CacheServerBackend) -> None:
    """Stop ``backend``'s heartbeat thread, so that the test alone calls ``heartbeat_once`` (a woken
    thread would reconnect or PING beside it)."""
    backend.stop_heartbeat()
