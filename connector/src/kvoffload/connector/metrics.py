"""Connector metrics (prometheus_client, multiprocess mode), names from the contract.

TensorRT-LLM ranks are separate processes, so values go to files under
``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client decides the mode when it is
first imported) and the sidecar serves them. Labels are bounded: ``model`` and
``backend`` on everything, ``operation`` and ``reason`` on errors. Label
children are bound once here.

Hot-path cost: in multiprocess mode one ``Counter.inc`` takes a lock and writes
an mmap'd file (about 2.7 us measured here), so an operation's four updates cost
about 8 us. Hooks therefore only append one tuple to a deque
(``record_lookup``/``record_retrieve``/``record_store``, well under 1 us) and a
background thread applies them to prometheus_client every
``FLUSH_INTERVAL_S``; ``flush()`` runs at shutdown and exit as well.

Where no sidecar serves the pod's ``/metrics`` (node mode, in-process backend) the operator sets
``KVOFFLOAD_METRICS_PORT`` and one connector process serves them (``metrics_endpoint``).
"""

from __future__ import annotations

import atexit
import threading
from collections import deque
from typing import Any

from kvoffload import contract

from .metrics_endpoint import MetricsEndpoint, render_connector_metrics
from .settings import ConnectorSettings

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
OPERATIONS = ("lookup", "retrieve", "store", "register", "heartbeat", "kv_event")
REASONS = ("timeout", "unavailable", "server_error", "miss", "blocks_reused", "error")
FLUSH_INTERVAL_S = 0.5
_LOOKUP, _RETRIEVE, _STORE, _PROMPT = 0, 1, 2, 3
PROMPT_SERIES: tuple[tuple[str, str], ...] = (
    ("device", "none"), ("cache", "none"), *(("computed", r) for r in contract.COMPUTED_REASONS),
)  # fmt: skip
"""Every (source, reason) of the prompt-token counter, bound up front (their zeros are visible)."""
PROMPT_SERIES_INDEX = {series: i for i, series in enumerate(PROMPT_SERIES)}


class _Noop:
    """Stands in for a metric child when metrics are disabled."""

    def inc(self, amount: float = 1) -> None:
        """Do nothing."""

    def observe(self, amount: float) -> None:
        """Do nothing."""

    def set(self, value: float) -> None:
        """Do nothing."""


_NOOP = _Noop()


class ConnectorMetrics:
    """Bound metric children for one (model, backend); cheap to call on the hot path."""

    # prometheus_client children (or _Noop): only inc/observe/set are called on them.
    lookup_requests: Any
    lookup_queried_tokens: Any
    lookup_hit_tokens: Any
    lookup_seconds: Any
    retrieve_requests: Any
    retrieve_tokens: Any
    retrieve_bytes: Any
    retrieve_seconds: Any
    store_requests: Any
    store_tokens: Any
    store_bytes: Any
    store_seconds: Any
    backend_up: Any
    stores_aborted: Any
    lookups_abandoned: Any

    def __init__(self, model: str, backend: str, enabled: bool = True) -> None:
        self.enabled = enabled
        self._pending: deque[tuple[int, float, int, int]] = deque()
        self._flush_lock = threading.Lock()
        if not enabled:
            self.lookup_requests = self.lookup_queried_tokens = self.lookup_hit_tokens = _NOOP
            self.lookup_seconds = _NOOP
            self.retrieve_requests = self.retrieve_tokens = self.retrieve_bytes = self.retrieve_seconds = _NOOP
            self.store_requests = self.store_tokens = self.store_bytes = self.store_seconds = _NOOP
            self.backend_up = self.stores_aborted = self.lookups_abandoned = _NOOP
            self._errors: dict[tuple[str, str], Any] = {}
            self._prompt_tokens: list[Any] = [_NOOP] * len(PROMPT_SERIES)
            return
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        # A private registry: values live in the multiprocess files (or this registry when
        # not in multiprocess mode); scheduler and worker of rank 0 share one instance.
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ("model", "backend")
        values = (model, backend)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.lookup_requests = counter(contract.M_LOOKUP_REQUESTS, "Lookups sent to the KV store.").labels(*values)
        self.lookup_queried_tokens = counter(
            contract.M_LOOKUP_QUERIED_TOKENS, "Prompt tokens asked for in lookups."
        ).labels(*values)
        self.lookup_hit_tokens = counter(
            contract.M_LOOKUP_HIT_TOKENS, "Prompt tokens the KV store held (chunk-aligned prefix)."
        ).labels(*values)
        self.lookup_seconds = histogram(contract.M_LOOKUP_SECONDS, "Lookup latency.").labels(*values)
        self.retrieve_requests = counter(contract.M_RETRIEVE_REQUESTS, "Retrieves into the KV pool.").labels(*values)
        self.retrieve_tokens = counter(contract.M_RETRIEVE_TOKENS, "Tokens loaded into the KV pool.").labels(*values)
        self.retrieve_bytes = counter(contract.M_RETRIEVE_BYTES, "KV bytes loaded into the KV pool.").labels(*values)
        self.retrieve_seconds = histogram(contract.M_RETRIEVE_SECONDS, "Retrieve latency.").labels(*values)
        self.store_requests = counter(contract.M_STORE_REQUESTS, "Stores from the KV pool.").labels(*values)
        self.store_tokens = counter(contract.M_STORE_TOKENS, "Tokens stored from the KV pool.").labels(*values)
        self.store_bytes = counter(contract.M_STORE_BYTES, "KV bytes stored from the KV pool.").labels(*values)
        self.store_seconds = histogram(contract.M_STORE_SECONDS, "Store latency.").labels(*values)
        self.stores_aborted = counter(
            contract.M_STORES_ABORTED, "Stores abandoned after PREPARE_STORE whose reservations were aborted."
        ).labels(*values)
        self.lookups_abandoned = counter(
            contract.M_LOOKUPS_ABANDONED, "Lookups answered too late (a miss) whose server locks were released later."
        ).labels(*values)
        up = Gauge(
            contract.M_BACKEND_UP,
            "1 when the KV store backend answers (min over ranks).",
            labels,
            registry=self.registry,
            multiprocess_mode="livemin",
        )
        self.backend_up = up.labels(*values)
        errors = Counter(
            contract.M_CONNECTOR_ERRORS,
            "Failed connector operations by operation and reason.",
            (*labels, "operation", "reason"),
            registry=self.registry,
        )
        self._errors = {
            (op, reason): errors.labels(model, backend, op, reason) for op in OPERATIONS for reason in REASONS
        }
        prompt = Counter(
            contract.M_PROMPT_TOKENS,
            "Prompt tokens the engine scheduled, by where their KV came from (device reuse, the cache server, "
            "computed) and why computed ones were not reused.",
            (*labels, "source", "reason"),
            registry=self.registry,
        )
        self._prompt_tokens = [prompt.labels(model, backend, src, why) for src, why in PROMPT_SERIES]

    def record_lookup(self, seconds: float, queried_tokens: int, hit_tokens: int) -> None:
        """Hot path: one successful lookup (applied to prometheus_client by the flusher)."""
        if self.enabled:
            self._pending.append((_LOOKUP, seconds, queried_tokens, hit_tokens))

    def record_retrieve(self, seconds: float, tokens: int, nbytes: int) -> None:
        """Hot path: one successful retrieve."""
        if self.enabled:
            self._pending.append((_RETRIEVE, seconds, tokens, nbytes))

    def record_store(self, seconds: float, tokens: int, nbytes: int) -> None:
        """Hot path: one successful store."""
        if self.enabled:
            self._pending.append((_STORE, seconds, tokens, nbytes))

    def record_prompt_tokens(self, source: str, reason: str, tokens: int) -> None:
        """Hot path: ``tokens`` prompt tokens the engine scheduled came from ``source`` (``reason``:
        why computed ones were not reused; ``none`` otherwise)."""
        if self.enabled and tokens > 0:
            self._pending.append((_PROMPT, 0.0, PROMPT_SERIES_INDEX[source, reason], tokens))

    def flush(self) -> None:
        """Apply recorded operations to the prometheus_client children (off the hot path)."""
        if not self.enabled:
            return
        with self._flush_lock:
            pending = self._pending
            sums = [[0, 0, 0], [0, 0, 0], [0, 0, 0]]
            prompt = [0] * len(PROMPT_SERIES)
            while pending:
                kind, seconds, a, b = pending.popleft()
                if kind == _PROMPT:
                    prompt[a] += b
                    continue
                (self.lookup_seconds, self.retrieve_seconds, self.store_seconds)[kind].observe(seconds)
                acc = sums[kind]
                acc[0] += 1
                acc[1] += a
                acc[2] += b
            for (count, a, b), (requests, first, second) in zip(
                sums,
                (
                    (self.lookup_requests, self.lookup_queried_tokens, self.lookup_hit_tokens),
                    (self.retrieve_requests, self.retrieve_tokens, self.retrieve_bytes),
                    (self.store_requests, self.store_tokens, self.store_bytes),
                ),
                strict=True,
            ):
                if count:
                    requests.inc(count)
                    first.inc(a)
                    second.inc(b)
            for child, tokens in zip(self._prompt_tokens, prompt, strict=True):
                if tokens:
                    child.inc(tokens)

    def error(self, operation: str, reason: str) -> None:
        """Count one failed operation; unknown operation/reason pairs count as ``error``."""
        child = self._errors.get((operation, reason)) or self._errors.get((operation, "error"))
        if child is not None:
            child.inc()


ENDPOINT_RETRY_S = 10.0
"""How often a process that could not bind the metrics port tries again (to take over)."""


class ProcessMetrics:
    """This engine process's metrics: one ``ConnectorMetrics`` per (model, backend, enabled) that its
    scheduler and workers share, the pod's ``/metrics`` endpoint if this process serves it, and the
    thread that flushes them (``EngineProcess.metrics``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._instances: dict[tuple[str, str, bool], ConnectorMetrics] = {}
        self._endpoint: MetricsEndpoint | None = None
        self._flusher: threading.Thread | None = None

    @property
    def endpoint(self) -> MetricsEndpoint | None:
        """The metrics endpoint this process started (serving, or trying to bind); None without a port."""
        return self._endpoint

    def for_settings(self, settings: ConnectorSettings) -> ConnectorMetrics:
        """The metrics the connector's settings ask for."""
        return self.get(settings.model_name, settings.backend, settings.metrics_enabled, settings.metrics_port,
                        settings.metrics_dir)  # fmt: skip

    def get(
        self, model: str, backend: str, enabled: bool, port: int | None = None, directory: str | None = None
    ) -> ConnectorMetrics:
        """The metrics for (model, backend); created once (scheduler and worker share it).

        With a multiprocess ``directory`` (``PROMETHEUS_MULTIPROC_DIR``) this process takes its
        liveness lock before writing any series; with ``port`` it serves the pod's connector metrics
        there if it can bind it first.
        """
        key = (model, backend, enabled)
        with self._lock:
            metrics = self._instances.get(key)
            if metrics is None:
                if enabled and directory:
                    from kvoffload.multiproc import hold_liveness_lock

                    hold_liveness_lock(directory)
                metrics = self._instances[key] = ConnectorMetrics(model, backend, enabled)
            if enabled and port and self._endpoint is None:
                self._endpoint = MetricsEndpoint(port, lambda: render_connector_metrics(directory, self._registries()))
                self._endpoint.try_serve()
            if enabled and self._flusher is None:
                stop = threading.Event()
                self._flusher = threading.Thread(target=self._flush_loop, args=(stop,), name="kvoffload-metrics",
                                                 daemon=True)  # fmt: skip
                self._flusher.start()
                atexit.register(self.flush_all)
            return metrics

    def flush_all(self) -> None:
        """Flush every ``ConnectorMetrics`` of this process."""
        with self._lock:
            instances = list(self._instances.values())
        for metrics in instances:
            metrics.flush()

    def _flush_loop(self, stop: threading.Event) -> None:
        ticks_per_retry = max(1, round(ENDPOINT_RETRY_S / FLUSH_INTERVAL_S))
        tick = 0
        while not stop.wait(FLUSH_INTERVAL_S):
            self.flush_all()
            tick += 1
            endpoint = self._endpoint
            if endpoint is not None and not endpoint.serving and tick % ticks_per_retry == 0:
                endpoint.try_serve()

    def _registries(self) -> list[Any]:
        with self._lock:
            return [m.registry for m in self._instances.values() if m.enabled]
