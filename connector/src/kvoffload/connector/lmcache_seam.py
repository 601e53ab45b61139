"""The connector's one seam to LMCache: every ``lmcache`` import of the connector, and every use of
something LMCache does not publish, for the LMCache versions in ``SUPPORTED_LMCACHE_VERSIONS``.

Public API the connector uses, re-exported: ``RequestClientFactory`` (the ZMQ client),
``create_transfer_context`` with ``MPTransferMode.ENGINE_DRIVEN`` (register, PREPARE/COMMIT through
its ``engine_driven_context``), ``IPCCacheServerKey``, ``EngineType``, ``ServerModuleCallRequest``
(reports to the KV-event module), and the in-process server's argument parsers and
``run_cache_server`` (:func:`run_inprocess_server`).

Private names it uses, each behind one function here (checked against LMCache 0.5.6's source):

- ``RequestClient._message_queue_client.pending_futures`` and ``.cancel_streams``
  (:func:`fail_requests_on_disconnect`): LMCache's ZMQ polling loop sees the socket's disconnect
  but wakes only subscription streams; waiting requests would sit out their timeouts.
- ``TransferContext._engine_driven_context._shm_name`` (:func:`shm_segment_name`): the server's L1
  segment this context mapped, how a restart is told from a reconnect to the same server.
- ``EngineDrivenContextShm._make_tensor_view(offset, length, shape, dtype_str)`` (:func:`slot_view`):
  views of slots a lookup secured, copied into later, outside the PREPARE that returned them.

An LMCache upgrade starts here: :func:`check_lmcache_version` refuses a version these were not
checked against, in one line, when the connector starts (``bundle.load_lmcache``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Any

import lmcache
from lmcache.utils import EngineType
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallRequest
from lmcache.v1.multiprocess.transfer_context import MPTransferMode, create_transfer_context
from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

from kvoffload import lmcache_guard
from kvoffload.lmcache_guard import SUPPORTED_LMCACHE_VERSIONS, LMCacheVersionError

__all__ = [
    "SUPPORTED_LMCACHE_VERSIONS",
    "EngineType",
    "IPCCacheServerKey",
    "LMCacheVersionError",
    "MPTransferMode",
    "RequestClientFactory",
    "ServerDisconnected",
    "ServerModuleCallRequest",
    "check_lmcache_version",
    "create_transfer_context",
    "fail_requests_on_disconnect",
    "run_inprocess_server",
    "shm_segment_name",
    "slot_view",
]


MODULES = (
    "lmcache.utils",
    "lmcache.v1.multiprocess.custom_types",
    "lmcache.v1.multiprocess.protocols.server_module",
    "lmcache.v1.multiprocess.transfer_context",
    "lmcache.v1.multiprocess.transport.factory",
)
"""The lmcache modules this seam imports on the engine's path (the bundle checks each loads)."""


def installed_lmcache_version() -> str:
    """The version of the lmcache package imported here (its own ``__version__``, else its metadata)."""
    version = getattr(lmcache, "__version__", None)
    return str(version) if version else importlib.metadata.version("lmcache")


def check_lmcache_version() -> str:
    """The imported LMCache's version; raises ``LMCacheVersionError`` (one line) when the private
    names this seam uses were not checked against it (``lmcache_guard.check_lmcache_version``)."""
    return lmcache_guard.check_lmcache_version(
        "connector",
        "connector/src/kvoffload/connector/lmcache_seam.py lists what to re-check",
        installed_lmcache_version(),
    )


class ServerDisconnected(ConnectionError):
    """The LMCache server's connection dropped (it died or restarted) while a request waited on it."""


def fail_requests_on_disconnect(client: Any, on_disconnect: Callable[[], None] | None = None) -> bool:
    """Make requests waiting on ``client`` fail (``ServerDisconnected``) as soon as its connection to
    the server drops, rather than at their timeouts, then call ``on_disconnect``.

    Extends the ZMQ polling loop's disconnect callback (``cancel_streams``), on the loop's own thread
    (the one that owns ``pending_futures``). False where the client is not LMCache 0.5's ZMQ client
    (then requests wait for their timeouts).
    """
    mq: Any = getattr(client, "_message_queue_client", None)
    pending = getattr(mq, "pending_futures", None)
    original = getattr(mq, "cancel_streams", None)
    if not isinstance(pending, dict) or original is None:
        return False

    def cancel_streams_and_requests() -> None:
        original()
        waiting = list(pending.values())
        pending.clear()
        for future, _spec in waiting:
            future.set_exception(ServerDisconnected("the LMCache server's connection dropped"))
        if on_disconnect is not None:
            on_disconnect()

    mq.cancel_streams = cancel_streams_and_requests
    return True


def shm_segment_name(transfer: Any) -> str | None:
    """The name of the server L1 segment ``transfer`` mapped; None in pickle mode."""
    name = getattr(getattr(transfer, "_engine_driven_context", None), "_shm_name", None)
    return str(name) if name else None


def slot_view(engine_driven_context: Any, offset: int, length: int, shape: Sequence[int], dtype: str) -> Any:
    """A tensor over one slot of the mapped segment (``dtype`` as LMCache names it on the wire)."""
    return engine_driven_context._make_tensor_view(offset=offset, length=length, shape=list(shape), dtype_str=dtype)


def run_inprocess_server(argv: Sequence[str]) -> tuple[Any, Any]:
    """Start LMCache's cache server in this process from its command-line ``argv``; returns
    ``(server, engine)``, each with ``close()``."""
    from lmcache.v1.distributed.config import add_storage_manager_args, parse_args_to_config
    from lmcache.v1.mp_observability.config import add_observability_args, parse_args_to_observability_config
    from lmcache.v1.multiprocess.config import (
        add_coordinator_args,
        add_mp_server_args,
        parse_args_to_coordinator_config,
        parse_args_to_mp_server_config,
    )
    from lmcache.v1.multiprocess.server import run_cache_server

    parser = argparse.ArgumentParser()
    add_mp_server_args(parser)
    add_storage_manager_args(parser)
    add_observability_args(parser)
    add_coordinator_args(parser)
    args = parser.parse_args(list(argv))
    server, engine = run_cache_server(
        mp_config=parse_args_to_mp_server_config(args),
        storage_manager_config=parse_args_to_config(args),
        obs_config=parse_args_to_observability_config(args),
        coordinator_config=parse_args_to_coordinator_config(args),
        return_engine=True,
        start_prometheus_http_server=False,
    )
    return server, engine
