"""The pod-injection webhook's server: HTTPS on every operator replica (the acting one and any
standby), each AdmissionReview answered from the pod and its workload's injection record."""

from __future__ import annotations

import http.server
import json
import logging
import ssl
import tempfile
import threading
from pathlib import Path
from typing import Any

from kvoffload import contract as c
from kvoffload.httpreply import send_reply

from .admission import Admission, admission_response, admit, pod_owner, record_from_workload
from .kube import Kube, KubeApiError, workload_path
from .metrics import OperatorMetrics
from .webhook_tls import TlsMaterial

log = logging.getLogger("kvoffload.operator")
MAX_REVIEW_BYTES = 8 * 2**20


def review_pod(kube: Kube, review: dict[str, Any]) -> tuple[str, Admission]:
    """(request uid, answer) for one AdmissionReview of a pod CREATE."""
    request = review.get("request") or {}
    pod = request.get("object") or {}
    namespace = str(request.get("namespace") or (pod.get("metadata") or {}).get("namespace") or "")
    owner = pod_owner(pod)
    record = None
    if owner is not None and c.LABEL_INJECT in ((pod.get("metadata") or {}).get("labels") or {}):
        try:
            record = record_from_workload(kube.get(workload_path(owner[0], namespace, owner[1])), *owner)
        except KubeApiError as exc:
            record = f"reading {owner[0]} {owner[1]} failed: {exc}"
    return str(request.get("uid", "")), admit(pod, namespace, record, owner)


class WebhookServer:
    """``POST /mutate-pods`` (AdmissionReview v1) and ``GET /healthz`` over TLS, in a thread."""

    def __init__(
        self, kube: Kube, metrics: OperatorMetrics, tls: TlsMaterial, port: int, host: str = "0.0.0.0"
    ) -> None:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, fmt: str, *args: Any) -> None:
                log.debug("webhook: " + fmt, *args)

            def do_GET(self) -> None:
                self._send(200, b"ok\n", "text/plain") if self.path == "/healthz" else self._send(
                    404, b"", "text/plain"
                )

            def do_POST(self) -> None:
                if self.path.split("?")[0] != c.WEBHOOK_PATH:
                    self._send(404, b"", "text/plain")
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length <= 0 or length > MAX_REVIEW_BYTES:
                    self._send(400, b"an AdmissionReview body is required", "text/plain")
                    return
                try:
                    review = json.loads(self.rfile.read(length))
                except ValueError:
                    self._send(400, b"not JSON", "text/plain")
                    return
                self._send(200, json.dumps(outer.answer(review)).encode(), "application/json")

            def _send(self, status: int, body: bytes, content_type: str) -> None:
                send_reply(self, status, body, content_type)

        self.kube, self.metrics = kube, metrics
        self._tmp = tempfile.TemporaryDirectory(prefix="kvoffload-webhook-")
        cert, key = Path(self._tmp.name, "tls.crt"), Path(self._tmp.name, "tls.key")
        cert.write_bytes(tls.cert_pem)
        key.write_bytes(tls.key_pem)
        key.chmod(0o600)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(str(cert), str(key))
        self.server = http.server.ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]

    def answer(self, review: dict[str, Any]) -> dict[str, Any]:
        try:
            uid, admission = review_pod(self.kube, review)
        except Exception as exc:  # never fail a pod creation on our bug: admit it as written
            log.exception("webhook: reviewing a pod failed")
            uid = str((review.get("request") or {}).get("uid", ""))
            admission = Admission([], (f"kvoffload: not injected: internal error {type(exc).__name__}",), "error")
        self.metrics.admissions.labels(result=admission.result).inc()
        if admission.result != "ignored":
            log.info("webhook: pod %s: %s %s", uid, admission.result, "; ".join(admission.warnings))
        return admission_response(uid, admission)

    def start(self) -> None:
        threading.Thread(target=self.server.serve_forever, name="kvoffload-webhook", daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._tmp.cleanup()
