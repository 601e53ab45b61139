"""The operator's webhook server alone, in a process of its own on 127.0.0.1, for tests that attack
it: its threads and memory are its own to measure. The workload the pods belong to is served by a
stand-in for the apiserver (one Deployment, injected by kvoffload), so a review of its pod is
answered with the real injection patch.

Run as ``python -m tests.support.webhook_process DIR``: writes ``DIR/ca.pem``, prints the port,
serves until its stdin closes.
"""

from __future__ import annotations

import contextlib
import copy
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hack.workloads import trtllm_deployment
from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.workload import read_workload
from kvoffload.operator.plan.injection_plan import ClusterInfo, choose_engine, plan_injection
from kvoffload.operator.plan.workload_apply import render_admission

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE, NAME, TEMPLATE_HASH = "ns", "llm", "5d8f7c9b4"
HUNG_WORKLOAD, HANG_S = "hung", 3.0
"""Reading this Deployment takes the stand-in apiserver ``HANG_S``; then it is not there."""


def injected_workload() -> dict[str, Any]:
    """The Deployment as the apiserver returns it after kvoffload injected it (admission mode)."""
    workload = trtllm_deployment(NAME, NAMESPACE, annotations={c.ANN_ENABLED: "true"})
    workload["metadata"]["uid"] = "deployment-uid"
    settings = InjectionSettings()
    read = read_workload(workload)
    engine = choose_engine(read, settings)
    plan = plan_injection(read, settings, ClusterInfo(native_sidecars=True, injection="admission"), engine)  # type: ignore[arg-type]
    rendered = render_admission(plan)  # type: ignore[arg-type]
    workload["metadata"]["annotations"].update(rendered.workload_apply["metadata"]["annotations"])
    workload["metadata"]["managedFields"] = [{"manager": c.FIELD_MANAGER, "operation": "Apply",
        "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{c.ANN_INJECTION_RECORD}": {}}}}}]  # fmt: skip
    workload["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT] = rendered.config_hash
    return workload


def pod_review(uid: str) -> dict[str, Any]:
    """The AdmissionReview the apiserver sends when the ReplicaSet controller creates a pod of the
    injected Deployment."""
    template = copy.deepcopy(injected_workload()["spec"]["template"])
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": f"{NAME}-{TEMPLATE_HASH}-", "namespace": NAMESPACE,
                     "labels": {**template["metadata"]["labels"], "pod-template-hash": TEMPLATE_HASH},
                     "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "controller": True,
                                          "name": f"{NAME}-{TEMPLATE_HASH}", "uid": "rs-uid"}]},
        "spec": template["spec"],
    }  # fmt: skip
    request = {"uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
               "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": NAMESPACE,
               "operation": "CREATE", "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
               "object": pod, "oldObject": None, "dryRun": False}  # fmt: skip
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def post(body: bytes, path: str = c.WEBHOOK_PATH) -> bytes:
    """An HTTP POST of ``body``, as bytes on the wire."""
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


class WebhookProcess:
    """The webhook server in a child process: its port, a TLS client context trusting its CA, and
    its thread count and memory as the kernel reports them."""

    def __init__(self, workdir: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.webhook_process", str(workdir)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        self.client_context = ssl.create_default_context(cafile=str(workdir / "ca.pem"))

    def status(self, field: str) -> int:
        """A number from ``/proc/PID/status`` (``Threads``, ``VmRSS`` in KiB, ``VmHWM``...)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
        raise KeyError(field)

    def exchange(self, data: bytes, timeout: float = 10.0) -> tuple[int, bytes]:
        """Send ``data`` on a new TLS connection and read the reply to the server's close: (status, body)."""
        with (
            socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as raw,
            self.client_context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            with contextlib.suppress(ConnectionError):  # a refused body: the reply came first
                tls.sendall(data)
            reply = bytearray()
            with contextlib.suppress(ssl.SSLEOFError, ConnectionError):
                while chunk := tls.recv(65536):
                    reply += chunk
        head, _, body = bytes(reply).partition(b"\r\n\r\n")
        return int(head.split(b" ")[1]) if head else 0, body

    def stop(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        return self.proc.wait(timeout=30)


@contextlib.contextmanager
def webhook_process(workdir: Path) -> Iterator[WebhookProcess]:
    server = WebhookProcess(workdir)
    try:
        yield server
    finally:
        if server.stop() != 0:
            raise AssertionError(f"the webhook process exited {server.proc.returncode}")


class StandInApiserver:
    """``Kube.get`` for the one injected Deployment and its ReplicaSet; nothing else exists, and
    ``HUNG_WORKLOAD``'s ReplicaSet takes ``HANG_S`` to be found missing."""

    def __init__(self) -> None:
        self.workload = injected_workload()
        self.replica_set = {"metadata": {"name": f"{NAME}-{TEMPLATE_HASH}", "namespace": NAMESPACE, "uid": "rs-uid",
                                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "Deployment",
                                                              "name": NAME, "uid": "deployment-uid",
                                                              "controller": True}]}}  # fmt: skip

    def get(self, path: str) -> dict[str, Any] | None:
        if path.endswith(f"/replicasets/{HUNG_WORKLOAD}-{TEMPLATE_HASH}"):
            time.sleep(HANG_S)
        if path.endswith(f"/namespaces/{NAMESPACE}/replicasets/{NAME}-{TEMPLATE_HASH}"):
            return self.replica_set
        return self.workload if path.endswith(f"/namespaces/{NAMESPACE}/deployments/{NAME}") else None


def main(workdir: str) -> None:
    from kvoffload.operator.admission.webhook import WebhookServer
    from kvoffload.operator.admission.webhook_tls import issue
    from kvoffload.operator.metrics import OperatorMetrics

    tls = issue(["127.0.0.1"])
    Path(workdir, "ca.pem").write_bytes(tls.ca_pem)
    server = WebhookServer(StandInApiserver(), OperatorMetrics(), tls, 0, host="127.0.0.1")  # type: ignore[arg-type]
    server.start()
    print(server.port, flush=True)
    sys.stdin.read()
    server.stop()


if __name__ == "__main__":
    main(sys.argv[1])
