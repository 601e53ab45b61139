"""The operator's run: serve metrics, build the reconciler, register the kopf handlers, serve the
webhook (admission mode), wait for the Lease, then run kopf until stopped or the Lease is lost.
Everything it is handed was checked by ``cli``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import kopf

from kvoffload import contract as c
from kvoffload.operator import __version__
from kvoffload.operator.admission.acting_replica import forwarding_address, plan_as_holder
from kvoffload.operator.admission.new_workloads import Planner, planner
from kvoffload.operator.admission.pod_alignment import PodAlignment
from kvoffload.operator.admission.review_forwarding import Forwarding, client_context, webhook_address
from kvoffload.operator.admission.webhook import WebhookServer
from kvoffload.operator.admission.webhook_tls import (
    ReviewScope,
    TlsMaterial,
    WebhookRegistrationMissing,
    ensure_tls,
    patch_ca_bundle,
)
from kvoffload.operator.api.events import EventRecorder
from kvoffload.operator.api.kube import Kube
from kvoffload.operator.api.operator_deployment import OperatorDeployment
from kvoffload.operator.control.leadership import Leadership, planning_seal_key, serve_health_while_waiting
from kvoffload.operator.control.reconcile import Reconciler
from kvoffload.operator.intent.settings import OperatorDefaults
from kvoffload.operator.metrics import OperatorMetrics
from kvoffload.operator.node.caches import NodeCaches
from kvoffload.operator.plan.injection_plan import ClusterInfo


@dataclass(frozen=True)
class WebhookSettings:
    """Admission mode's webhook: where the apiserver reaches it and whom it answers."""

    namespace: str
    """The operator's namespace: the certificate's Secret is kept there."""
    hosts: tuple[str, ...]
    """The names its certificate is for."""
    port: int
    read_client_ca: Callable[[], bytes | None]
    """The CA whose signed client certificates alone get answers (None: any caller); read once the
    TLS Secret is in place, as the operator always did (an unreadable file stops it there)."""
    advertise_host: str = ""
    """This replica's IP, published in the Lease with the port while it holds it (empty: none)."""


@dataclass(frozen=True)
class RunSettings:
    """What one run of the operator needs, checked by ``cli``."""

    defaults: OperatorDefaults
    cluster: ClusterInfo
    namespaces: tuple[str, ...]
    """Watched namespaces; empty means all."""
    node_mode: bool
    kubeconfig: str | None
    """None: log in with the service account when in a cluster."""
    metrics_port: int
    health_port: int
    all_events: bool
    """Post Normal Events too (``--events all``), not only Warnings."""
    workers: int
    resync_seconds: float
    leader_election: str
    """The flag as given, for the start line."""
    webhook: WebhookSettings | None
    """Admission mode's webhook (None: template mode)."""


def run_operator(kube: Kube, run: RunSettings, leadership: Leadership | None, owner: OperatorDeployment | None) -> int:
    """Run until stopped: 0, or 1 when the Lease was lost. Raises ``WebhookRegistrationMissing``
    when admission mode finds no registration of the chart's to put its CA in."""
    namespaces = list(run.namespaces)
    metrics = OperatorMetrics()
    metrics.serve(run.metrics_port)
    events = EventRecorder(kube, normal=run.all_events)
    reconciler = Reconciler(
        kube=kube, defaults=run.defaults, cluster=run.cluster, metrics=metrics, events=events,
        namespaces=run.namespaces, node_caches=NodeCaches(kube, run.defaults) if run.node_mode else None,
    )  # fmt: skip
    alignment = PodAlignment(kube, events, metrics, run.namespaces) if run.webhook is not None else None
    memo = kopf.Memo(reconciler=reconciler, pod_alignment=alignment, max_workers=run.workers,
                     resync_seconds=run.resync_seconds)  # fmt: skip

    from kvoffload.operator.control import handlers  # registers the workload and policy handlers

    if run.node_mode:
        handlers.register_node_mode_handlers()  # pods are watched only when node mode may use them
    if run.webhook is not None:
        handlers.register_admission_handlers()
        tls = ensure_tls(kube, run.webhook.namespace, c.WEBHOOK_TLS_SECRET, list(run.webhook.hosts), owner=owner)
        plan = planner(kube, run.defaults, reconciler.cluster)
        forwarding = None
        if leadership is not None:  # every replica plans as the Lease's holder does, or has the holder answer
            address = (
                webhook_address(run.webhook.advertise_host, run.webhook.port) if run.webhook.advertise_host else ""
            )
            leadership = dataclasses.replace(
                leadership, seal_key=planning_seal_key(tls.key_pem), webhook_address=address
            )
            plan = plan_as_holder(plan, leadership.planning, lambda defaults, cluster: planner(kube, defaults, cluster),
                                  leadership.holders_inputs)  # fmt: skip
            forwarding = Forwarding(_holders_address(leadership), client_context(tls.ca_pem), run.webhook.hosts[0])
        _serve_webhook(kube, metrics, run.namespaces, run.webhook, tls, plan, forwarding)  # every replica
    kubeconfig = run.kubeconfig

    @kopf.on.login()
    def login(**kwargs: object) -> kopf.ConnectionInfo | None:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            return kopf.login_with_service_account(**kwargs)  # type: ignore[arg-type]
        return kopf.login_with_kubeconfig(**kwargs)  # type: ignore[arg-type]

    logging.getLogger(__name__).info(
        "starting version=%s native_sidecars=%s namespaces=%s leader_election=%s node_mode=%s", __version__,
        run.cluster.native_sidecars, namespaces or "all", run.leader_election, run.node_mode,
    )  # fmt: skip
    if leadership is not None and not _lead(leadership, run.health_port, threading.Event()):
        return 0  # asked to stop while waiting for the Lease
    try:
        kopf.run(
            standalone=True,  # one operator acts at a time through the Lease, not kopf peering
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=f"http://0.0.0.0:{run.health_port}/healthz",
            memo=memo,
        )
    finally:
        if leadership is not None:
            leadership.release()
    return 1 if leadership is not None and leadership.lost else 0


def _holders_address(leadership: Leadership) -> Callable[[], str | None]:
    """Where this replica forwards a review now (``forwarding_address`` of the Lease read now)."""

    def address() -> str | None:
        published = leadership.others_publication()
        return forwarding_address(published.planning, published.webhook, leadership.planning)

    return address


def _serve_webhook(kube: Kube, metrics: OperatorMetrics, namespaces: tuple[str, ...], webhook: WebhookSettings,
                   tls: TlsMaterial, plan: Planner, forwarding: Forwarding | None) -> WebhookServer:  # fmt: skip
    """Start the webhook's HTTPS server with ``tls``, then put its CA into the chart's registration (the
    registration itself, rules and client config, is the chart's: ``webhook_configuration``).
    Raises ``WebhookRegistrationMissing`` (the server stopped) when the chart's registration is not there."""
    scope = ReviewScope.of_registration(webhook.namespace, namespaces)
    server = WebhookServer(kube, metrics, tls, webhook.port, plan=plan, scope=scope,
                           client_ca_pem=webhook.read_client_ca(), forwarding=forwarding)  # fmt: skip
    server.start()
    try:
        patch_ca_bundle(kube, c.WEBHOOK_CONFIGURATION_NAME, tls.ca_pem)
    except WebhookRegistrationMissing:
        server.stop()
        raise
    logging.getLogger(__name__).info("injection webhook serving on :%d for %s", server.port, ", ".join(webhook.hosts))
    return server


def _lead(leadership: Leadership, health_port: int, stop: threading.Event) -> bool:
    """Hold the operator's Lease before acting (False: stopped while waiting).

    While it waits the process answers /healthz, so a standby pod stays live and ready.
    """
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with serve_health_while_waiting(health_port):
        held = leadership.acquire(stop)
    signal.signal(signal.SIGTERM, previous)
    if not held:
        return False
    # Lost the Lease: stop as on SIGTERM (kopf's own graceful shutdown). A stop_flag would do the
    # same, but kopf waits on one with an executor thread that blocks its loop's shutdown.
    leadership.hold(on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))
    return True
