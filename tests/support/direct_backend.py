"""A connector backend driven directly (no stand-in engine), for tests of its own timing and ordering."""

from __future__ import annotations

import threading

import torch

from kvoffload.connector.backends.base import KvGeometry
from kvoffload.connector.backends.commits import DeferredCommit
from kvoffload.connector.backends.engine_process import EngineProcess
from kvoffload.connector.backends.scheduler_client import SchedulerClient
from kvoffload.connector.backends.worker_backend import WorkerBackend
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.settings import ConnectorSettings, parse_settings
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import BLOCK, connector_llm_args

HEADS, HEAD_DIM, LAYERS = 2, 8, 2
"""The pool geometry of these tests (small: they time nothing)."""


def pool_for(blocks: int) -> torch.Tensor:
    """A CPU pool in TensorRT-LLM's layout with room for ``blocks`` blocks."""
    return torch.randn(blocks, LAYERS, 2, HEADS * BLOCK * HEAD_DIM)


def _settings(server: LMCacheServer, model: str, env: dict[str, str]) -> ConnectorSettings:
    return parse_settings(env, connector_llm_args(model, server.url, block=BLOCK))


def direct_worker(
    server: LMCacheServer,
    model: str,
    env: dict[str, str],
    pool: torch.Tensor | None = None,
    process: EngineProcess | None = None,
) -> WorkerBackend:
    """A worker backend of ``model`` on ``server`` with the connector settings ``env``, in engine
    process ``process`` (a new one if None); given ``pool`` it registers it."""
    metrics = ConnectorMetrics(model, "sidecar", enabled=False)
    backend = WorkerBackend(_settings(server, model, env), rank=0, metrics=metrics, process=process or EngineProcess())
    if pool is not None:
        backend.register(pool, KvGeometry(HEADS, BLOCK, HEAD_DIM))
    return backend


def direct_scheduler(
    server: LMCacheServer, model: str, env: dict[str, str], process: EngineProcess | None = None
) -> SchedulerClient:
    """A scheduler's client of ``model`` on ``server`` with the connector settings ``env``, in engine
    process ``process`` (a new one if None: then it has no worker to secure loads through)."""
    metrics = ConnectorMetrics(model, "sidecar", enabled=False)
    return SchedulerClient(_settings(server, model, env), metrics=metrics, process=process or EngineProcess())


def backend_pair(
    server: LMCacheServer, model: str, env: dict[str, str], blocks: int
) -> tuple[WorkerBackend, SchedulerClient]:
    """A worker (its pool registered, room for ``blocks`` blocks) and a scheduler of ``model`` on
    ``server``, in one engine process (the scheduler secures loads through that worker)."""
    process = EngineProcess()
    return (direct_worker(server, model, env, pool_for(blocks + 1), process),
            direct_scheduler(server, model, env, process))  # fmt: skip


def hold_store_commits(worker: WorkerBackend, timeout_s: float) -> tuple[threading.Event, threading.Event]:
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


def stop_heartbeat(backend: WorkerBackend | SchedulerClient) -> None:
    """Stop ``backend``'s heartbeat thread, so that the test alone calls ``heartbeat_once`` (a woken
    thread would reconnect or PING beside it)."""
    backend.stop_heartbeat()
