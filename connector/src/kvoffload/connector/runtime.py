"""What the scheduler and worker hooks share: TensorRT-LLM's connector API, this engine process
(``engine_process``), this process's rank, the settings their backends start with, and the error a
failed promised load raises. Each side builds its own backend (``scheduler``: the scheduler's
client; ``worker``: the worker's backend); neither imports the other's."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

from kvoffload import contract
from kvoffload.connector import bundle
from kvoffload.connector.backends.base import BackendError
from kvoffload.connector.backends.engine_process import EngineProcess
from kvoffload.connector.load_cost import LoadCosts
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.settings import ConnectorSettings, parse_settings

try:
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
        SchedulerOutput,
    )
except ImportError:  # TensorRT-LLM 1.1/1.2 module path
    from tensorrt_llm._torch.pyexecutor.kv_cache_connector import (
        KvCacheConnectorScheduler,
        KvCacheConnectorWorker,
        SchedulerOutput,
    )

__all__ = [
    "ConnectorRole",
    "KvCacheConnectorScheduler",
    "KvCacheConnectorWorker",
    "KvoffloadLoadError",
    "SchedulerOutput",
    "backend_settings",
    "count_skip",
    "engine_process",
    "kv_rank",
    "on_stream",
    "prompt_tokens",
    "stream_event",
    "timing_event",
    "use_private_stream",
]

logger = logging.getLogger("kvoffload.connector")


class KvoffloadLoadError(RuntimeError):
    """KV promised to TensorRT-LLM could not be loaded; the affected requests must fail, never run on garbage."""


def kv_rank(settings: ConnectorSettings) -> int:
    """Which share of a request's KV heads this process holds: its MPI rank under tensor
    parallelism; 0 under attention DP, where every rank holds whole heads and shares the cache."""
    if settings.attention_dp:
        return 0
    try:
        import tensorrt_llm

        return int(tensorrt_llm.mpi_rank())
    except (ImportError, AttributeError):
        return 0


_PROCESS: EngineProcess | None = None
_PROCESS_LOCK = threading.Lock()


def engine_process() -> EngineProcess:
    """This engine process's ``EngineProcess``, made on first use: the one module-level accessor.

    TensorRT-LLM builds the connector's scheduler and workers from its entry points with no
    arguments, and apart, so they cannot be handed their process; they (and only they, and tests
    standing in for TensorRT-LLM) reach it here. Everything below them is passed it explicitly.
    """
    global _PROCESS
    with _PROCESS_LOCK:
        if _PROCESS is None:
            _PROCESS = EngineProcess()
        return _PROCESS


def backend_settings(process: EngineProcess, settings: ConnectorSettings) -> ConnectorSettings:
    """The settings a backend starts with: the pod's sidecar, or ``process``'s own cache server
    (started here) for the in-process backend. Makes the bundle's LMCache loadable first."""
    bundle.prepare()  # the bundle's deps on sys.path, lmcache loadable here, or one clear error
    if settings.backend == contract.BACKEND_INPROCESS:
        return process.inprocess.settings_for(settings)
    return settings


class ConnectorRole:
    """What the scheduler and each worker start with: settings from the env and ``llm_args``, this
    engine process, this process's KV rank and the metrics; read through the properties. Each side
    starts its own backend after ``_start_role``."""

    def _start_role(self, llm_args: Any, role: str) -> None:
        self._settings = parse_settings(os.environ, llm_args)
        self._rank = kv_rank(self._settings) if role == "worker" else 0
        self._process = engine_process()
        self._metrics = self._process.metrics.for_settings(self._settings)
        self._block = self._settings.tokens_per_block
        self._costs = self._process.load_costs(self._settings.server_url)

    @property
    def process(self) -> EngineProcess:
        """The engine process this role runs in (what its scheduler and workers share)."""
        return self._process

    @property
    def settings(self) -> ConnectorSettings:
        """The settings this role parsed from its env and ``llm_args`` at start."""
        return self._settings

    @property
    def rank(self) -> int:
        """The KV rank (the tensor-parallel rank; 0 under attention DP, and for the scheduler)."""
        return self._rank

    @property
    def metrics(self) -> ConnectorMetrics:
        """This role's metrics (the same families every role of the process shares)."""
        return self._metrics

    @property
    def load_costs(self) -> LoadCosts:
        """The engine's measured load and prefill costs, which the cost guard weighs (``load_cost``)."""
        return self._costs


def count_skip(metrics: ConnectorMetrics, exc: BackendError) -> None:
    """Count operations skipped because the backend is down (failures themselves are counted where they happen)."""
    if exc.reason == "unavailable":
        metrics.error(exc.operation, "unavailable")


def use_private_stream(device: Any) -> None:
    """Make this thread's current CUDA stream its own (no-op off CUDA).

    The saver orders this stream after the forward pass's event (``order_after``); a backend then
    orders its copies after this thread's current stream, which must not be one the engine keeps
    queueing work on.
    """
    if device is not None and getattr(device, "type", None) == "cuda":
        import torch

        torch.cuda.set_stream(torch.cuda.Stream(device=device))


@contextlib.contextmanager
def on_stream(stream: Any) -> Iterator[None]:
    """Run the block with ``stream`` (the one TensorRT-LLM passes a hook: its forward pass's) as this
    thread's current CUDA stream, so what a backend orders after the caller's stream is ordered after
    that pass; no-op without a CUDA stream (CPU, the stand-in's ``None``)."""
    if stream is None or not hasattr(stream, "record_event"):
        yield
        return
    import torch

    with torch.cuda.stream(stream):
        yield


def timing_event(stream: Any) -> Any:
    """A CUDA event that keeps its device time, recorded now on ``stream``; None without a CUDA stream."""
    if stream is None or not hasattr(stream, "record_event"):
        return None
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event


def stream_event(stream: Any) -> Any:
    """A CUDA event recorded now on ``stream`` (the engine's work queued so far), or None without one."""
    return stream.record_event() if stream is not None and hasattr(stream, "record_event") else None


def order_after(event: Any) -> None:
    """This thread's current CUDA stream runs its later work after ``event`` (a CUDA event recorded
    on the engine's stream): ordered on the device, the thread does not wait."""
    import torch

    torch.cuda.current_stream().wait_event(event)


def prompt_tokens(request: Any) -> list[int]:
    tokens = request.get_tokens(0)
    return list(tokens)
