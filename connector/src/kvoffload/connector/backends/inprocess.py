"""In-process backend: an LMCache engine inside the TensorRT-LLM process.

LMCache's own in-process TensorRT-LLM adapter (``tensorrt_adapter.py``) builds an
``LMCacheEngine`` around ``TRTLLMGPUConnector``, which needs CUDA streams and so
cannot run on CPU. This backend hosts LMCache's MP cache engine
(``run_cache_server(..., return_engine=True)``) in this process instead, bound to
a free loopback port, and talks to it with exactly the sidecar data path (same
keys, same worker-driven transfer, same SHM L1). One engine per process, shared
by rank 0's scheduler and worker; it lives and dies with the engine process, and
its L1 is sized by ``KVOFFLOAD_L1_SIZE`` (``ConnectorSettings.l1_bytes``). Tensor parallelism needs one shared
store, so this backend requires ``tensor_parallel_size == 1``.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import socket
import threading
import uuid
from typing import Any

from kvoffload import contract
from kvoffload.connector.settings import DEFAULT_L1_BYTES, ConnectorSettings, SettingsError
from kvoffload.quantity import bytes_to_gb

logger = logging.getLogger("kvoffload.connector")

DEFAULT_CHUNK_SIZE = 256


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


class InProcessServer:
    """LMCache's cache engine in this engine process: started once, shared by rank 0's scheduler and
    worker, stopped when the process exits (closing the engine unlinks its SHM segment)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: tuple[str, Any, Any] | None = None
        """(url, server, engine) once started."""

    def start(self, settings: ConnectorSettings) -> str:
        """Start the engine (once; later calls answer the same URL); returns its ZMQ URL."""
        if settings.world_size != 1:
            raise SettingsError(
                f"{contract.ENV_BACKEND}={contract.BACKEND_INPROCESS!r} needs tensor_parallel_size=1 "
                f"(got world size {settings.world_size}); use {contract.BACKEND_SIDECAR!r}"
            )
        with self._lock:
            if self._running is not None:
                return self._running[0]
            from kvoffload.connector.lmcache_seam import run_inprocess_server
            from kvoffload.lmcache_guard import install_server_guards
            from kvoffload.lmcache_guard.secured_lookups import with_secured_lookups

            install_server_guards()  # the engine's own server is guarded as the sidecar's is
            port = _free_port()
            l1 = settings.l1_bytes or DEFAULT_L1_BYTES
            shm_name = f"kvo_inproc_{uuid.uuid4().hex[:10]}"
            server, engine = run_inprocess_server(
                with_secured_lookups(server_args(port, settings.chunk_size or DEFAULT_CHUNK_SIZE, l1, shm_name))
            )
            url = contract.server_url(port)
            self._running = (url, server, engine)
            atexit.register(self.stop)
            logger.info("event=inprocess_engine_started url=%s l1_bytes=%d", url, l1)
            return url

    def settings_for(self, settings: ConnectorSettings) -> ConnectorSettings:
        """Settings pointing the backend at this process's own engine (which publishes no KV events:
        it loads no server module, so reports would only be refused)."""
        return dataclasses.replace(settings, server_url=self.start(settings), kv_events=False)

    def stop(self) -> None:
        """Stop the engine (tests; TensorRT-LLM simply exits)."""
        with self._lock:
            running, self._running = self._running, None
        if running is not None:
            _url, server, engine = running
            server.close()
            engine.close()
