"""In-process backend: an LMCache engine inside the TensorRT-LLM process.

LMCache's own in-process TensorRT-LLM adapter (``tensorrt_adapter.py``) builds an
``LMCacheEngine`` around ``TRTLLMGPUConnector``, which needs CUDA streams and so
cannot run on CPU. This backend hosts LMCache's MP cache engine
(``run_cache_server(..., return_engine=True)``) in this process instead, bound to
a free loopback port, and talks to it with exactly the sidecar data path (same
keys, same worker-driven transfer, same SHM L1). One engine per process, shared
by rank 0's scheduler and worker; it lives and dies with the engine process, and
its L1 is sized by ``KVOFFLOAD_L1_SIZE``. Tensor parallelism needs one shared
store, so this backend requires ``tensor_parallel_size == 1``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
import threading
import uuid
from typing import Any

from kvoffload import contract
from kvoffload.connector.settings import ConnectorSettings, SettingsError
from kvoffload.quantity import bytes_to_gb, parse_bytes

logger = logging.getLogger("kvoffload.connector")

DEFAULT_L1_SIZE = "1Gi"
DEFAULT_CHUNK_SIZE = 256
_LOCK = threading.Lock()
_ENGINE: dict[str, Any] = {}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_args(port: int, chunk_size: int, l1_bytes: int, shm_name: str) -> list[str]:
    """LMCache MP server flags for the in-process engine (same data path as the sidecar)."""
    return [
        "--host", "127.0.0.1",
        "--port", str(port),
        "--chunk-size", str(chunk_size),
        "--l1-size-gb", f"{bytes_to_gb(l1_bytes):.6f}",
        "--no-l1-use-lazy",
        "--eviction-policy", "LRU",
        "--supported-transfer-mode", "auto",
        "--shm-name", shm_name,
        "--worker-reap-timeout-seconds", "0",
        "--disable-observability",
    ]  # fmt: skip


def start_engine(settings: ConnectorSettings) -> str:
    """Start (once per process) LMCache's cache engine in this process; returns its ZMQ URL."""
    if settings.world_size != 1:
        raise SettingsError(
            f"{contract.ENV_BACKEND}={contract.BACKEND_INPROCESS!r} needs tensor_parallel_size=1 "
            f"(got world size {settings.world_size}); use {contract.BACKEND_SIDECAR!r}"
        )
    with _LOCK:
        if "url" in _ENGINE:
            return str(_ENGINE["url"])
        from kvoffload.connector.lmcache_seam import run_inprocess_server
        from kvoffload.lmcache_guard import install_restricted_unpickler

        install_restricted_unpickler()  # the engine's own server unpickles no stranger's code either
        port = _free_port()
        l1 = parse_bytes(os.environ.get(contract.ENV_L1_SIZE, DEFAULT_L1_SIZE), contract.ENV_L1_SIZE)
        server, engine = run_inprocess_server(
            server_args(port, settings.chunk_size or DEFAULT_CHUNK_SIZE, l1, f"kvo_inproc_{uuid.uuid4().hex[:10]}")
        )
        url = contract.server_url(port)
        _ENGINE.update(url=url, server=server, engine=engine)
        atexit.register(stop_engine)  # closing the engine unlinks its SHM segment
        logger.info("event=inprocess_engine_started url=%s l1_bytes=%d", url, l1)
        return url


def inprocess_settings(settings: ConnectorSettings) -> ConnectorSettings:
    """Settings pointing the sidecar client at this process's own engine (which publishes no KV
    events: it loads no server module, so reports would only be refused)."""
    return dataclasses.replace(settings, server_url=start_engine(settings), kv_events=False)


def stop_engine() -> None:
    """Stop this process's engine (tests; TensorRT-LLM simply exits)."""
    with _LOCK:
        server, engine = _ENGINE.pop("server", None), _ENGINE.pop("engine", None)
        _ENGINE.clear()
    if server is not None:
        server.close()
    if engine is not None:
        engine.close()
