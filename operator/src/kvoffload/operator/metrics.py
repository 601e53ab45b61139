"""The operator's own Prometheus metrics (kopf has none); names come from the contract."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvoffload import contract as c
from kvoffload.httpreply import BoundedHTTPServer, send_reply

RESULTS = ("applied", "unchanged", "removed", "skipped", "error", "conflict")
"""``result`` label of the reconcile counter."""
KINDS = ("Deployment", "StatefulSet")
ADMISSION_RESULTS = ("injected", "ignored", "not_injected", "error", "refused", "forwarded")
ERROR_REASONS = (
    "invalid_settings", "policy_missing", "ambiguous_container", "unsupported", "conflict",
    "options_missing", "invalid_options", "api_error", "internal",
)  # fmt: skip
"""``reason`` label of the error counter (PolicyError.reason, plus API and internal failures)."""


class OperatorMetrics:
    """Counters, the duration histogram and the injected-workloads gauge, in their own registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.reconciles = Counter(
            c.M_OPERATOR_RECONCILES, "Workload reconciles by kind and result.", ["kind", "result"],
            registry=self.registry,
        )  # fmt: skip
        self.duration = Histogram(
            c.M_OPERATOR_RECONCILE_SECONDS, "Time to reconcile one workload.", ["kind"], registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )  # fmt: skip
        self.injected = Gauge(
            c.M_OPERATOR_INJECTED_WORKLOADS, "Workloads currently carrying the injection.", ["kind"],
            registry=self.registry,
        )  # fmt: skip
        self.errors = Counter(
            c.M_OPERATOR_ERRORS, "Reconcile errors by kind and reason (bad input, conflicts, API failures).",
            ["kind", "reason"], registry=self.registry,
        )  # fmt: skip
        self.retry_queue = Gauge(
            c.M_OPERATOR_RETRY_QUEUE, "Passes that failed on the API and wait for a retry with backoff.",
            registry=self.registry,
        )  # fmt: skip
        self.admissions = Counter(
            c.M_OPERATOR_ADMISSIONS, "Reviews the injection webhook answered, by result (injected, ignored, "
            "not_injected, error, refused: not a pod CREATE in admission.k8s.io/v1; forwarded: answered by the Lease's holder).", ["result"],
            registry=self.registry,
        )  # fmt: skip
        self.evictions = Counter(
            c.M_OPERATOR_EVICTIONS, "Pods created without the injection (webhook not reached) evicted to be "
            "created again.", registry=self.registry,
        )  # fmt: skip
        self.eviction_refusals = Counter(
            c.M_OPERATOR_EVICTION_REFUSALS, "Evictions of pods created without the injection refused (429) by a "
            "PodDisruptionBudget; retried with backoff.", registry=self.registry,
        )  # fmt: skip
        for result in ADMISSION_RESULTS:
            self.admissions.labels(result=result)
        for kind in KINDS:  # zeros are visible before the first event
            self.injected.labels(kind=kind).set(0)
            for result in RESULTS:
                self.reconciles.labels(kind=kind, result=result)
            for reason in ERROR_REASONS:
                self.errors.labels(kind=kind, reason=reason)
        self._injected: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def mark_injected(self, kind: str, uid: str, injected: bool) -> None:
        """Track which workloads carry the injection; the gauge is the set size per kind."""
        with self._lock:
            members = self._injected.setdefault(kind, set())
            if injected:
                members.add(uid)
            else:
                members.discard(uid)
            self.injected.labels(kind=kind).set(len(members))

    def serve(self, port: int, addr: str = "0.0.0.0") -> BoundedHTTPServer:
        """Answer ``GET /metrics`` on ``addr:port`` from a daemon thread. The port is open to every
        address and shares the webhook's process: the server is a bounded one (its handler threads,
        each connection's lifetime), so idle peers cannot grow the process."""
        registry = self.registry

        class MetricsHandler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != c.PATH_METRICS:
                    send_reply(self, 404, b"not found\n", "text/plain")
                    return
                send_reply(self, 200, generate_latest(registry), CONTENT_TYPE_LATEST)

            def log_message(self, format: str, *args: Any) -> None:  # quiet: scraped every few seconds
                return

        server = BoundedHTTPServer((addr, port), MetricsHandler)
        threading.Thread(target=server.serve_forever, name="kvoffload-operator-metrics", daemon=True).start()
        return server
