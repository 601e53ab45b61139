"""Settings -> the ``lmcache server`` command line and environment (pure).

Why each fixed flag is there:

- ``--host 127.0.0.1`` / ``--http-host 127.0.0.1``: the connector reaches the server over
  the pod's loopback; LMCache's admin HTTP API has no authentication, so nothing of it
  is reachable on the pod IP. Kubelet probes hit the sidecar's own port instead.
- ``--worker-reap-timeout-seconds`` / ``--worker-registration-grace-seconds``
  ``contract.WORKER_SILENCE_LIMIT_S``: kvoffload's connector PINGs from each worker every 2 s
  by default, at least every 30 s (its heartbeat), so a registration silent for two minutes is an
  engine process that died
  (SIGKILL, OOM). Reaping it releases what it held; the transfer guard
  (``lmcache_guard.install_transfer_guard``) discards, never publishes, the store
  reservations it left, so their keys can be stored again by the engines still there (a
  kept reservation blocks every later PREPARE_STORE of its chunks until its 600 s write TTL).
  A live worker reaped after a longer stall fails its next call and registers again.
- ``--supported-transfer-mode auto``: serves both server-driven (STORE/RETRIEVE) and
  engine-driven (PREPARE/COMMIT) clients.
- ``--shm-name`` + ``--no-l1-use-lazy``: LMCache only puts L1 in a named POSIX SHM
  segment (needed for engine-driven transfer without pickling) when L1 is allocated
  eagerly; with lazy allocation it silently ignores the name. It also falls back to
  pickle when ``/dev/shm`` has less free space than L1. So the sidecar asks for SHM
  only when ``/dev/shm`` can hold all of L1 (the caller measures the free space).
- ``--l2-prefetch-policy retain`` (only with an L2): a chunk LMCache loads from L2 stays in L1,
  evicted later like a stored one, so the next request for that prefix is an L1 hit and the KV
  events can announce it there (LMCache 0.5.6's ``default`` policy copies it through L1 and drops it).
- ``--server-module`` (only with ``KVOFFLOAD_KV_EVENTS_PORT``): kvoffload's KV-event publisher
  (``kv_events_module``), loaded into the server process, bound on all addresses: routers on other
  pods subscribe to it; it answers nothing but subscriptions.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from kvoffload import contract
from kvoffload.quantity import bytes_to_gb

from .settings import SidecarSettings

LMCACHE_ENV_RESP_PASSWORD = "LMCACHE_RESP_PASSWORD"
"""LMCache's RESP adapter reads the Redis password from here when its JSON spec has none."""
LMCACHE_ENV_RESP_USERNAME = "LMCACHE_RESP_USERNAME"
LOOPBACK = "127.0.0.1"

# Env the sidecar reads that must not leak into LMCache: the metrics dir would switch
# any prometheus_client metric in the server to multiprocess files, and the password
# is handed over under LMCache's own name only.
_NOT_INHERITED = (
    contract.ENV_PROMETHEUS_MULTIPROC_DIR,
    "prometheus_multiproc_dir",
    contract.ENV_L2_REDIS_PASSWORD,
)

L2_PREFETCH_POLICY = "retain"
"""LMCache's prefetch policy with an L2: what it loads from L2 stays in L1 (``RetainPrefetchPolicy``)."""
KV_EVENTS_MODULE = "kvoffload.sidecar.kv_events_module"
"""The server module publishing KV events (``--server-module``), loaded into the server process."""

LMCACHE_CLI_MODULE = "kvoffload.sidecar.lmcache_server"
"""The module ``python -m`` runs for ``lmcache server``: LMCache's CLI behind the restricted
unpickler (``lmcache_server``), so no client of the request port can make it run code."""


@dataclass(frozen=True)
class ServerCommand:
    """What to exec for the LMCache server."""

    argv: tuple[str, ...]
    env: dict[str, str]
    uses_shm: bool
    """Whether L1 lives in the named SHM segment (engine-driven transfer without pickle)."""

    @property
    def lmcache_arguments(self) -> tuple[str, ...] | None:
        """The ``lmcache`` arguments (``server ...``) when this runs LMCache's CLI, else None."""
        if tuple(self.argv[1:3]) != ("-m", LMCACHE_CLI_MODULE):
            return None
        return self.argv[3:]

    def redacted_env_keys(self) -> list[str]:
        """Env names set for LMCache beyond the inherited ones, for logging."""
        return sorted(k for k in self.env if k.startswith(("LMCACHE_", "KVOFFLOAD_")))


def l2_adapter_specs(settings: SidecarSettings, fs_capacity_bytes: int | None = None) -> list[dict[str, object]]:
    """The ``--l2-adapter`` JSON objects, in tier order (filesystem first, then Redis).

    LMCache 0.5.6's ``fs`` adapter has no size bound, so a sized filesystem tier uses
    ``fs_native`` with ``max_capacity_gb`` and an LRU ``eviction`` block, which bounds it.
    ``fs_capacity_bytes`` is what is left of the size for this server (see ``l2fs``);
    ``None`` means all of it.
    """
    specs: list[dict[str, object]] = []
    if settings.l2_fs is not None:
        if settings.l2_fs.size_bytes is None:
            specs.append({"type": "fs", "base_path": settings.l2_fs.path})
        else:
            specs.append(
                {
                    "type": "fs_native",
                    "base_path": settings.l2_fs.path,
                    "max_capacity_gb": bytes_to_gb(
                        settings.l2_fs.size_bytes if fs_capacity_bytes is None else fs_capacity_bytes
                    ),
                    "eviction": {"eviction_policy": "LRU"},
                }
            )
    if settings.l2_redis is not None:
        # No password here: argv is world-readable in /proc; it goes through the env.
        specs.append({"type": "resp", "host": settings.l2_redis.host, "port": settings.l2_redis.port})
    return specs


def kv_events_module_spec(
    port: int, topic: str = "", wire: str = "vllm", journal: str = "", l1_keeps_loads: bool = False
) -> dict[str, object]:
    """The ``--server-module`` object loading kvoffload's KV-event publisher, bound on all addresses
    (routers reach it on the pod IP; it only sends), in wire format ``wire``, journaling to ``journal``;
    ``l1_keeps_loads``: the server keeps what it loads from L2 in L1 (``L2_PREFETCH_POLICY``)."""
    config: dict[str, object] = {"host": "0.0.0.0", "port": port, "topic": topic, "format": wire}
    if l1_keeps_loads:
        config["l1_keeps_loads"] = True
    if journal:
        config["journal"] = journal
    return {"module_path": KV_EVENTS_MODULE, "factory_name": "build_server_modules", "config": config}


def kv_events_journal_path(settings: SidecarSettings) -> str:
    """The KV-event journal: beside the metrics directory, in the run volume a server restart keeps."""
    return os.path.join(os.path.dirname(settings.metrics_dir), f"{settings.instance_id}.{contract.KV_EVENTS_JOURNAL}")


def build_server_command(
    settings: SidecarSettings,
    base_env: Mapping[str, str],
    shm_free_bytes: int | None,
    python: str = sys.executable,
    fs_capacity_bytes: int | None = None,
) -> ServerCommand:
    """The LMCache server's argv and env.

    ``shm_free_bytes`` is ``/dev/shm``'s free space (``None``: unknown); ``fs_capacity_bytes``
    the sized filesystem tier's capacity left for this server (``None``: its whole size).
    """
    uses_shm = shm_free_bytes is not None and shm_free_bytes >= settings.l1_size_bytes
    argv = [
        python,
        "-m",
        LMCACHE_CLI_MODULE,
        "server",
        "--instance-id",
        settings.instance_id,
        "--host",
        settings.request_host,
        "--port",
        str(settings.request_port),
        "--http-host",
        LOOPBACK,
        "--http-port",
        str(settings.lmcache_http_port),
        "--l1-size-gb",
        format(bytes_to_gb(settings.l1_size_bytes), ".12g"),
        "--eviction-policy",
        settings.eviction_policy,
        "--chunk-size",
        str(settings.chunk_size),
        "--max-workers",
        str(settings.max_workers),
        "--supported-transfer-mode",
        "auto",
        "--worker-reap-timeout-seconds",
        str(contract.WORKER_SILENCE_LIMIT_S),
        "--worker-registration-grace-seconds",
        str(contract.WORKER_SILENCE_LIMIT_S),
    ]
    if uses_shm:
        argv += ["--shm-name", settings.shm_name, "--no-l1-use-lazy"]
    l2_specs = l2_adapter_specs(settings, fs_capacity_bytes)
    for spec in l2_specs:
        argv += ["--l2-adapter", json.dumps(spec, sort_keys=True)]
    if l2_specs:
        argv += ["--l2-prefetch-policy", L2_PREFETCH_POLICY]
    if settings.kv_events_port is not None:
        argv += [
            "--server-module",
            json.dumps(
                kv_events_module_spec(
                    settings.kv_events_port,
                    settings.kv_events_topic,
                    settings.kv_events_format,
                    kv_events_journal_path(settings),
                    l1_keeps_loads=bool(l2_specs),
                ),
                sort_keys=True,
            ),
        ]

    env = {k: v for k, v in base_env.items() if k not in _NOT_INHERITED}
    env[contract.ENV_LMCACHE_TRACK_USAGE] = "true" if settings.track_usage else "false"
    env.pop(LMCACHE_ENV_RESP_PASSWORD, None)
    env.pop(LMCACHE_ENV_RESP_USERNAME, None)
    if settings.l2_redis is not None:
        if settings.l2_redis.password:
            env[LMCACHE_ENV_RESP_PASSWORD] = settings.l2_redis.password
        if settings.l2_redis.username:
            env[LMCACHE_ENV_RESP_USERNAME] = settings.l2_redis.username
    return ServerCommand(argv=tuple(argv), env=env, uses_shm=uses_shm)
