"""The pod's one ``/metrics``: LMCache's series, the connector's multiprocess files, the sidecar's own.

Three families, rendered together in Prometheus text format 0.0.4:

- ``lmcache_mp_*``: scraped from LMCache's loopback admin API and passed through line by
  line (only those families; LMCache's process/GC/target_info series are dropped so they
  cannot clash with anything else in the pod's output).
- The connector's series, aggregated from ``PROMETHEUS_MULTIPROC_DIR`` by
  prometheus_client's ``MultiProcessCollector``.
- ``kvoffload_sidecar_*``: built from the supervisor's state on each scrape by a custom
  collector, so the sidecar itself never writes multiprocess files.

Dead connector processes. Counters and histograms of a process that died stay: they are
part of the pod's totals, and dropping them would make the sum go backwards, which
Prometheus reads as a counter reset and turns into a spurious ``rate()`` spike. A
process that reuses a dead one's PID reopens the same file and continues from its
values (prometheus_client reads the stored value on start), so totals stay monotonic.
Live gauges (``live*`` multiprocess modes) describe running processes only, so a dead
process's ``gauge_live*_<pid>.db`` files are removed (``mark_process_dead``). Other gauge
modes (``all``, ``max``, ``sum``...) keep prometheus_client's documented meaning, which
includes dead processes. Containers in a pod do not share PIDs, so death is detected by
the liveness lock of the contract (``METRICS_LIVE_LOCK_TEMPLATE``): a writer holds an
exclusive ``flock`` on ``live_<pid>.lock``; the kernel drops it when the process dies. A
PID with no lock file is never treated as dead. The sidecar takes the lock itself while
it cleans, so a new process reusing the PID (which takes the lock before writing
metrics) cannot have its fresh files removed.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kvoffload import contract
from kvoffload.multiproc import clean_dead_writers

log = logging.getLogger(__name__)

_SAMPLE_NAME = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)")

# LMCache series that count work the server has accepted but not finished.
_INFLIGHT_GAUGES = ("lmcache_mp_num_inflight_l2_stores", "lmcache_mp_num_inflight_l2_loads")
_SUBMITTED_FINISHED = (
    ("lmcache_mp_num_submitted_stores_total", "lmcache_mp_num_finished_stores_total"),
    ("lmcache_mp_num_submitted_retrieves_total", "lmcache_mp_num_finished_retrieves_total"),
)


def filter_lmcache_families(text: str, prefix: str = contract.LMCACHE_SERVER_METRIC_PREFIX) -> str:
    """Only the ``prefix`` families of a Prometheus text exposition, comments included."""
    kept: list[str] = []
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            name = line.split(" ", 3)[2] if line.count(" ") >= 2 else ""
        elif line.startswith("#") or not line.strip():
            continue
        else:
            match = _SAMPLE_NAME.match(line)
            name = match.group(1) if match else ""
        if name.startswith(prefix):
            kept.append(line)
    return "\n".join(kept) + ("\n" if kept else "")


def _sample_values(text: str) -> dict[str, float]:
    """Sum of the values of each sample name (labels summed away); unparsable text counts as empty."""
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    except (ValueError, IndexError):
        return {}
    return totals


def inflight_work(lmcache_metrics_text: str) -> int:
    """Requests and L2 transfers LMCache has accepted and not finished, from its ``/metrics``."""
    values = _sample_values(lmcache_metrics_text)
    pending = sum(values.get(name, 0.0) for name in _INFLIGHT_GAUGES)
    for submitted, finished in _SUBMITTED_FINISHED:
        pending += max(0.0, values.get(submitted, 0.0) - values.get(finished, 0.0))
    return int(pending)


@dataclass(frozen=True)
class ServerTransferState:
    """What the cache server holds for requests now, from its ``GET /status`` (``transfer_state``)."""

    read_locked_chunks: int
    reserved_chunks: int
    prefetch_jobs: int


def transfer_state(status_body: bytes) -> ServerTransferState | None:
    """Locks, reservations and prefetch jobs from LMCache 0.5.6's ``/status`` JSON (its single L1's
    ``read_locked_count`` and ``write_locked_count``, the lookup module's ``active_prefetch_jobs``);
    None when the body is not that shape."""
    try:
        status = json.loads(status_body)
        l1 = status["storage_manager"]["l1_manager"]
        return ServerTransferState(
            read_locked_chunks=int(l1["read_locked_count"]),
            reserved_chunks=int(l1["write_locked_count"]),
            prefetch_jobs=int(status["active_prefetch_jobs"]),
        )
    except (ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True)
class SidecarMetricsState:
    """The sidecar's own numbers at scrape time."""

    server_restarts: int
    server_up: bool
    config: dict[str, str]
    transfers: ServerTransferState | None = None
    """None when the server did not answer its status page (its series are then left out)."""


class SidecarCollector(Collector):
    """``kvoffload_sidecar_*`` built from the supervisor's state on each collect."""

    def __init__(self, state: Callable[[], SidecarMetricsState]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        """Restarts counter, up gauge and the config info series."""
        state = self._state()
        yield CounterMetricFamily(
            contract.M_SIDECAR_SERVER_RESTARTS,
            "Times the sidecar restarted the LMCache server after it exited unexpectedly.",
            value=state.server_restarts,
        )
        yield GaugeMetricFamily(
            contract.M_SIDECAR_SERVER_UP,
            "1 while the LMCache server answers its health check and request port, else 0.",
            value=1.0 if state.server_up else 0.0,
        )
        yield InfoMetricFamily(
            contract.M_SIDECAR_CONFIG_INFO,
            "The sidecar's effective, non-secret settings.",
            value=state.config,
        )
        if state.transfers is not None:
            for name, doc, value in (
                (contract.M_SIDECAR_SERVER_READ_LOCKED_CHUNKS, "L1 chunks the cache server holds read-locked now.",
                 state.transfers.read_locked_chunks),
                (contract.M_SIDECAR_SERVER_RESERVED_CHUNKS, "L1 chunks reserved for stores not yet committed or dropped.",
                 state.transfers.reserved_chunks),
                (contract.M_SIDECAR_SERVER_PREFETCH_JOBS, "Prefetch jobs whose result nobody took yet.",
                 state.transfers.prefetch_jobs),
            ):  # fmt: skip
                yield GaugeMetricFamily(name, doc, value=value)


def render_pod_metrics(
    sidecar_state: Callable[[], SidecarMetricsState],
    multiproc_dir: str | None,
    lmcache_text: str | None,
) -> bytes:
    """The pod's exposition: sidecar and connector families, then LMCache's ``lmcache_mp_*``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SidecarCollector(sidecar_state))
    if multiproc_dir and os.path.isdir(multiproc_dir):
        clean_dead_writers(multiproc_dir)
        MultiProcessCollector(registry, path=multiproc_dir)
    body = generate_latest(registry)
    if lmcache_text:
        body += filter_lmcache_families(lmcache_text).encode()
    return body
