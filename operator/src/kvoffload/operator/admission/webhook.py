"""The pod-injection webhook: HTTPS on every operator replica (the acting one and any standby),
each AdmissionReview answered from the pod and its workload's injection record. A replica plans
here only as the Lease's holder would (``acting_replica``); a replica of another operator version
forwards its reviews to the holder (``review_forwarding``); otherwise it keeps what is stored."""

from __future__ import annotations

import json
import logging
import ssl
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvoffload import contract as c
from kvoffload.log_budget import LogBudget
from kvoffload.operator.admission.https_server import HttpsServer, Reply, Request, refusal
from kvoffload.operator.admission.new_workloads import Planner, label_for_new_workload, record_before_the_operator
from kvoffload.operator.admission.records import Admission, admission_response, admit, record_from_workload
from kvoffload.operator.admission.review import PodReview, WorkloadReview, parse_pod_review, parse_workload_review
from kvoffload.operator.admission.review_forwarding import Forwarding
from kvoffload.operator.admission.webhook_tls import ReviewScope, TlsMaterial
from kvoffload.operator.admission.workload_updates import kvoffload_injects, review_update
from kvoffload.operator.api.kube import Kube, KubeApiError, workload_path
from kvoffload.operator.api.pod_owners import resolve_owner
from kvoffload.operator.metrics import OperatorMetrics
from kvoffload.operator.plan.injection_plan import InjectionPlan
from kvoffload.operator.plan.injection_record import InjectionRecord

log = logging.getLogger("kvoffload.operator")
MAX_REVIEW_BYTES = 2**20
"""The largest AdmissionReview body read: a pod's review is a few KiB to tens of KiB, and answering
one at this cap takes tens of MiB for a moment. A larger one gets 413 before its body is read."""


def review_pod(kube: Kube, review: PodReview, plan: Planner | None = None) -> Admission:
    """The answer for one pod CREATE: its owner resolved through the API and that owner's injection
    record read, then ``admit``."""
    if c.LABEL_INJECT not in ((review.pod.get("metadata") or {}).get("labels") or {}):
        return admit(review.pod, review.namespace, None, "the pod does not carry the label")
    try:
        resolved = resolve_owner(kube, review.pod, review.namespace)
    except KubeApiError as exc:
        return admit(review.pod, review.namespace, None, f"resolving the pod's owner failed: {exc}")
    if isinstance(resolved, str):
        return admit(review.pod, review.namespace, None, resolved)
    owner = (resolved.kind, resolved.name)
    record = record_from_workload(resolved.workload, *owner)
    annotations = (resolved.workload.get("metadata") or {}).get("annotations") or {}
    if plan is not None and isinstance(record, str) and c.ANN_INJECTION_RECORD not in annotations:
        # a workload created opted in, whose record the operator has not written yet
        label = ((review.pod.get("metadata") or {}).get("labels") or {}).get(c.LABEL_INJECT)
        early = record_before_the_operator(resolved.workload, label, plan)
        record = early if isinstance(early, InjectionRecord) else record
    return admit(review.pod, review.namespace, record, owner)


LiveReader = Callable[[str, str, str], "Mapping[str, Any] | None"]
"""(kind, namespace, name) -> the workload as the apiserver holds it now, or None."""


def review_workload(review: WorkloadReview, plan: Planner, read_live: LiveReader) -> Admission:
    """The answer for a Deployment or StatefulSet CREATE: an opted-in one gets the template label
    the operator would write; anything else is admitted as written. An UPDATE of one kvoffload
    injects keeps kvoffload's record and label, as the plan gives them (``workload_updates``),
    judged from the workload as the operator reads it (``live_before_update``), never from the
    caller's ``oldObject``."""

    def plan_of(workload: Mapping[str, Any]) -> InjectionPlan | str:
        return plan({"kind": review.kind, **workload,
                     "metadata": {**(workload.get("metadata") or {}), "namespace": review.namespace}})  # fmt: skip

    if review.old is not None:
        if not kvoffload_injects(review.old):  # nothing of kvoffload's to keep (no read needed to say so)
            return Admission([], (), "ignored")
        live = live_before_update(review, read_live)
        if isinstance(live, str):
            log.debug("webhook: workload update %s ignored: %s", review.uid, live)
            return Admission([], (), "ignored")
        return review_update(live, {"kind": review.kind, **review.workload}, review.field_manager, plan_of)
    planned = plan_of(review.workload)
    if isinstance(planned, str):
        return Admission([], (), "ignored")
    return Admission(label_for_new_workload(review.workload, planned), (), "injected")


def live_before_update(review: WorkloadReview, read_live: LiveReader) -> Mapping[str, Any] | str:
    """The workload an UPDATE writes, as the apiserver holds it now, or why there is none to judge
    it by: the object must name itself and its uid, and the live one must have that uid (a review
    the apiserver sends always does; a forged one naming another namespace's workload does not)."""
    meta = review.workload.get("metadata") or {}
    name, uid = meta.get("name"), meta.get("uid")
    if not isinstance(name, str) or not name or not isinstance(uid, str) or not uid:
        return "the object names no workload and uid"
    live = read_live(review.kind, review.namespace, name)
    if live is None:
        return f"{review.kind} {review.namespace}/{name} is not there"
    if (live.get("metadata") or {}).get("uid") != uid:
        return f"{review.kind} {review.namespace}/{name} has another uid"
    return live


def server_context(tls: TlsMaterial, client_ca_pem: bytes | None = None) -> ssl.SSLContext:
    """The webhook's TLS: TLS 1.2 at least, its serving certificate (the key file lives only while
    it is loaded); with ``client_ca_pem``, a client certificate is verified against that CA when
    one is presented (probes present none: reviews without one are refused in ``handle``)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if client_ca_pem is not None:
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(cadata=client_ca_pem.decode())
    with tempfile.TemporaryDirectory(prefix="kvoffload-webhook-") as tmp:
        cert, key = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        cert.write_bytes(tls.cert_pem)
        key.touch(mode=0o600)
        key.write_bytes(tls.key_pem)
        context.load_cert_chain(str(cert), str(key))
    return context


class WebhookServer:
    """``POST /mutate-pods`` (AdmissionReview v1), ``GET /healthz`` and ``GET /readyz`` over TLS.
    ``/readyz`` is answered by the same accept, handshake and handler threads as a review, so a
    webhook that cannot answer reviews is not ready."""

    def __init__(
        self,
        kube: Kube,
        metrics: OperatorMetrics,
        tls: TlsMaterial,
        port: int,
        host: str = "0.0.0.0",
        plan: Planner | None = None,
        scope: ReviewScope | None = None,
        client_ca_pem: bytes | None = None,
        forwarding: Forwarding | None = None,
    ) -> None:
        """``client_ca_pem``: only callers with a client certificate of this CA get reviews answered
        (the apiserver, given one through its ``AdmissionConfiguration``); None: any caller.
        ``forwarding``: where reviews go when the holder must answer them (None: answered here)."""
        self.kube, self.metrics, self.plan, self.forwarding = kube, metrics, plan, forwarding
        self.certified_callers_only = client_ca_pem is not None
        self.scope = scope or ReviewScope.of_registration("")
        """Namespaces the webhook answers about; a review from any other is admitted untouched, unread."""
        # Whoever reaches the port can cause these lines: a few per minute, then a count.
        self.refusals, self.failures = LogBudget(log), LogBudget(log)
        self.server = HttpsServer(server_context(tls, client_ca_pem), host, port, self.handle, MAX_REVIEW_BYTES)
        self.port = self.server.port

    def handle(self, request: Request) -> Reply:
        """The reply to one whole request (in one of the server's handler threads)."""
        if request.method == "GET" and request.path in ("/healthz", c.PATH_READY):
            return Reply(200, b"ok\n")
        path = request.path.split("?")[0]
        if request.method == "POST" and self.certified_callers_only and not request.client_certified:
            self.metrics.admissions.labels(result="refused").inc()
            self.refusals.log(logging.INFO, "webhook: refused a caller without the client certificate")
            return refusal(401, "a client certificate of the webhook's client CA is required")
        if request.method == "POST" and path == c.WEBHOOK_WORKLOADS_PATH and self.plan is not None:
            return self.handle_workload(request)
        if request.method != "POST" or path != c.WEBHOOK_PATH:
            return refusal(404, "not found")
        review = parse_pod_review(request.body)
        if isinstance(review, str):
            return self.refuse(review)
        return self.forwarded(request, review) or Reply(200, json.dumps(self.answer(review)).encode(),
                                                        "application/json")  # fmt: skip

    def handle_workload(self, request: Request) -> Reply:
        """A Deployment or StatefulSet CREATE (``review_workload``); never refused for our bug."""
        review = parse_workload_review(request.body)
        if isinstance(review, str):
            return self.refuse(review)
        forwarded = self.forwarded(request, review)
        if forwarded:
            return forwarded
        assert self.plan is not None
        try:
            if not self.scope.covers(review.namespace):
                admission = Admission([], (), "ignored")
            else:
                admission = review_workload(review, self.plan, self._read_workload)
        except Exception as exc:  # admit it as written
            self.failures.log(logging.ERROR, "webhook: reviewing a workload failed", exc_info=True)
            admission = Admission([], (f"kvoffload: not labelled: internal error {type(exc).__name__}",), "error")
        if admission.result != "ignored":
            log.info("webhook: workload %s: %s", review.uid, admission.result)
        return Reply(200, json.dumps(admission_response(review.uid, admission)).encode(), "application/json")

    def forwarded(self, request: Request, review: PodReview | WorkloadReview) -> Reply | None:
        """The holder's answer to a review it must answer (``forwarding``), or None: answer it here
        (out of scope, nothing to forward, already forwarded once, or the forward failed)."""
        uid = review.uid
        if self.forwarding is None or request.forwarded or not self.scope.covers(review.namespace):
            return None
        address = self.forwarding.address()
        if address is None:
            return None
        assert self.forwarding is not None
        answer = self.forwarding.forward(address, request.path.split("?")[0], request.body, uid)
        if isinstance(answer, str):
            self.failures.log(logging.WARNING, "webhook: review %s answered here, not by the Lease's holder: %s",
                              uid, answer)  # fmt: skip
            return None
        self.metrics.admissions.labels(result="forwarded").inc()
        log.info("webhook: review %s answered by the Lease's holder at %s", uid, address)
        return Reply(200, answer, "application/json")

    def refuse(self, reason: str) -> Reply:
        """400 with the one-line ``reason`` for a body that is not a review this webhook answers."""
        self.metrics.admissions.labels(result="refused").inc()
        self.refusals.log(logging.INFO, "webhook: refused a review: %s", reason)
        return refusal(400, reason)

    def answer(self, review: PodReview) -> dict[str, Any]:
        """The AdmissionReview response for a valid pod CREATE; a pod is never refused for our bug."""
        try:
            if not self.scope.covers(review.namespace):
                admission = Admission([], (), "ignored")
            else:
                admission = review_pod(self.kube, review, self.plan)
        except Exception as exc:  # admit it as written
            self.failures.log(logging.ERROR, "webhook: reviewing a pod failed", exc_info=True)
            admission = Admission([], (f"kvoffload: not injected: internal error {type(exc).__name__}",), "error")
        self.metrics.admissions.labels(result=admission.result).inc()
        if admission.result != "ignored":
            log.info("webhook: pod %s: %s %s", review.uid, admission.result, "; ".join(admission.warnings))
        return admission_response(review.uid, admission)

    def _read_workload(self, kind: str, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.kube.get(workload_path(kind, namespace, name))

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
