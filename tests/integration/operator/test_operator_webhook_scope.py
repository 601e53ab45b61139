"""The workloads webhook answers a caller about nothing it could not read itself (issue 42, item 1).

The operator runs in admission mode against the real apiserver with the chart's rules; the caller
is not the apiserver: it posts forged AdmissionReviews straight to the webhook's TLS port (no client
certificate, no uid it could know), naming another namespace's options ConfigMap, or a ConfigMap of
kube-system. Before, the webhook planned the forged object with the operator's cluster-wide read
rights and returned that ConfigMap's text inside the record it patched in.
"""

from __future__ import annotations

import base64
import copy
import json
import socket
import ssl
import uuid
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, get, trtllm_container, trtllm_deployment, wait_for
from kvoffload import contract as c
from tests.support.operator_support import OperatorProcess, webhook_port

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]


def options_workload(namespace: str, name: str, configmap: str, key: str) -> dict[str, Any]:
    """An opted-in Deployment whose engine reads its options from ``configmap``'s ``key``."""
    engine = trtllm_container(options_file=f"/config/{key}")
    engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config"}]
    return trtllm_deployment(name, namespace, replicas=0, containers=[engine], annotations={c.ANN_ENABLED: "true"},
                             volumes=[{"name": "cfg", "configMap": {"name": configmap}}])  # fmt: skip


def forged_update(namespace: str, new: dict[str, Any], old: dict[str, Any]) -> bytes:
    """A Deployment UPDATE review as a caller that is not the apiserver writes it."""
    request = {"uid": str(uuid.uuid4()), "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
               "resource": {"group": "apps", "version": "v1", "resource": "deployments"}, "namespace": namespace,
               "operation": "UPDATE", "userInfo": {"username": "nobody"}, "object": new, "oldObject": old,
               "options": {}, "dryRun": False}  # fmt: skip
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def as_injected(workload: dict[str, Any]) -> dict[str, Any]:
    """``workload`` with an injection record held by kvoffload's field manager, as a forger writes it."""
    old = copy.deepcopy(workload)
    old["metadata"]["annotations"][c.ANN_INJECTION_RECORD] = "{}"
    old["metadata"]["managedFields"] = [{"manager": c.FIELD_MANAGER, "operation": "Apply", "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{c.ANN_INJECTION_RECORD}": {}}}}}]  # fmt: skip
    return old


def post_review(port: int, body: bytes) -> str:
    """POST ``body`` to the workloads webhook without checking its certificate (as an attacker
    would); the whole reply, patch decoded, as text."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    head = (f"POST {c.WEBHOOK_WORKLOADS_PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, context.wrap_socket(raw) as tls:
        tls.sendall(head + body)
        reply = bytearray()
        while chunk := tls.recv(65536):
            reply += chunk
    status, _, payload = bytes(reply).partition(b"\r\n\r\n")
    assert b" 200 " in status.split(b"\r\n")[0], status
    response = json.loads(payload)["response"]
    patch = base64.b64decode(response["patch"]).decode() if "patch" in response else ""
    return json.dumps(response) + patch


def test_a_forged_update_naming_another_namespaces_options_gets_none_of_them_back(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    marker = f"victim-secret-{uuid.uuid4().hex}"
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "private-options", "namespace": namespace},
                    "data": {"extra.yaml": f"# {marker}\nmax_batch_size: 8\n"}})  # fmt: skip
    victim = options_workload(namespace, "victim", "private-options", "extra.yaml")
    apply(cluster, victim)
    wait_for(lambda: marker in get(cluster, "deployment", "victim", namespace)["metadata"]["annotations"]
             .get(c.ANN_INJECTION_RECORD, ""), 60, what="the victim's record, its options read by the operator")  # fmt: skip
    live = get(cluster, "deployment", "victim", namespace)
    port = webhook_port(admission_operator)

    # No uid: the forger knows the namespace and the ConfigMap's name, nothing else.
    forged = options_workload(namespace, "forged", "private-options", "extra.yaml")
    assert marker not in post_review(port, forged_update(namespace, forged, as_injected(forged)))
    # A real workload's name with a uid the forger made up.
    named = options_workload(namespace, "victim", "private-options", "extra.yaml")
    named["metadata"]["uid"] = str(uuid.uuid4())
    assert marker not in post_review(port, forged_update(namespace, named, as_injected(named)))
    # The apiserver's own UPDATE of the victim (its live uid) still keeps kvoffload's record.
    cluster.kubectl("annotate", "deployment", "victim", "-n", namespace, "team=serving")
    after = get(cluster, "deployment", "victim", namespace)
    assert (
        after["metadata"]["annotations"][c.ANN_INJECTION_RECORD]
        == live["metadata"]["annotations"][c.ANN_INJECTION_RECORD]
    )


def test_a_forged_update_naming_a_kube_system_configmap_reads_nothing_there(
    cluster: LocalCluster, admission_operator: OperatorProcess
) -> None:
    marker = f"kube-system-secret-{uuid.uuid4().hex}"
    name = f"kvo-deputy-{uuid.uuid4().hex[:6]}"
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": "kube-system"},
                    "data": {"config.conf": f"# {marker}\n"}})  # fmt: skip
    try:
        forged = options_workload("kube-system", "forged", name, "config.conf")
        forged["metadata"]["uid"] = str(uuid.uuid4())
        assert marker not in post_review(webhook_port(admission_operator), forged_update("kube-system", forged,
                                                                                         as_injected(forged)))  # fmt: skip
    finally:
        cluster.kubectl("delete", "configmap", name, "-n", "kube-system", check=False)
