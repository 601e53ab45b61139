"""The workloads webhook answers a caller about nothing it could not read itself (issue 42, item 1).

The operator runs in admission mode against the real apiserver with the chart's rules; the caller
is not the apiserver: it posts forged AdmissionReviews straight to the webhook's TLS port (no client
certificate, no uid it could know), naming another namespace's options ConfigMap, or a ConfigMap of
kube-system. Before, the webhook planned the forged object with the operator's cluster-wide read
rights and returned that ConfigMap's text inside the record it patched in.

A caller that knows a live workload's uid and its ReplicaSet's (anyone who may read them) forges an
UPDATE of that workload and a pod CREATE of its ReplicaSet: both answers used to carry the user's
options text (the record held it; the pod's patch held the merged file as an annotation). Now the
record holds the file's digest and the pod's init container merges the file itself.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import socket
import ssl
import uuid
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, get, list_objects, trtllm_container, trtllm_deployment, wait_for
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


def forged_pod_create(namespace: str, pod: dict[str, Any]) -> bytes:
    """A pod CREATE review as a caller that is not the apiserver writes it."""
    request = {"uid": str(uuid.uuid4()), "kind": {"group": "", "version": "v1", "kind": "Pod"},
               "resource": {"group": "", "version": "v1", "resource": "pods"}, "namespace": namespace,
               "operation": "CREATE", "userInfo": {"username": "nobody"}, "object": pod, "options": {},
               "dryRun": False}  # fmt: skip
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}).encode()


def options_digest(text: str) -> str:
    """What the record keeps of an options file (``kvoffload.trtllm_options_merge.options_digest``)."""
    return hashlib.sha256(text.encode()).hexdigest()


def recorded_options_digest(cluster: LocalCluster, name: str, namespace: str) -> str | None:
    """The digest of the user's options file in the workload's injection record (None: no record yet)."""
    text = get(cluster, "deployment", name, namespace)["metadata"]["annotations"].get(c.ANN_INJECTION_RECORD)
    return json.loads(text).get("user_options_digest") if text else None


def as_injected(workload: dict[str, Any]) -> dict[str, Any]:
    """``workload`` with an injection record held by kvoffload's field manager, as a forger writes it."""
    old = copy.deepcopy(workload)
    old["metadata"]["annotations"][c.ANN_INJECTION_RECORD] = "{}"
    old["metadata"]["managedFields"] = [{"manager": c.FIELD_MANAGER, "operation": "Apply", "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{c.ANN_INJECTION_RECORD}": {}}}}}]  # fmt: skip
    return old


def post_review(port: int, body: bytes, path: str = c.WEBHOOK_WORKLOADS_PATH) -> str:
    """POST ``body`` to the workloads webhook (or ``path``) without checking its certificate (as an
    attacker would); the whole reply, patch decoded, as text."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
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
    text = f"# {marker}\nmax_batch_size: 8\n"
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "private-options", "namespace": namespace},
                    "data": {"extra.yaml": text}})  # fmt: skip
    victim = options_workload(namespace, "victim", "private-options", "extra.yaml")
    apply(cluster, victim)
    wait_for(lambda: recorded_options_digest(cluster, "victim", namespace) == options_digest(text), 60,
             what="the victim's record, its options read by the operator")  # fmt: skip
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


def forged_reviews_with_real_uids(cluster: LocalCluster, namespace: str, name: str, port: int) -> tuple[str, str]:
    """The webhook's answers (as text, patches decoded) to a forged UPDATE of the live opted-in
    Deployment ``name`` (its managedFields and uid, kvoffload's record edited so the answer carries
    the plan's) and to a forged pod CREATE of its current ReplicaSet (the real uid): what anyone who
    may read the two objects can ask."""
    wait_for(lambda: c.ANN_INJECTION_RECORD in get(cluster, "deployment", name, namespace)["metadata"]["annotations"],
             60, what=f"{name}'s record written by the operator")  # fmt: skip
    shown = cluster.kubectl("get", "deployment", name, "-n", namespace, "-o", "json", "--show-managed-fields")
    live = json.loads(shown.stdout)  # with its managedFields, as the apiserver sends it
    label = live["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT]

    def current_replica_set() -> dict[str, Any] | None:
        found = [rs for rs in list_objects(cluster, "replicaset", namespace, f"app={name}")
                 if rs["spec"]["template"]["metadata"]["labels"].get(c.LABEL_INJECT) == label]  # fmt: skip
        return found[0] if found else None

    replica_set = wait_for(current_replica_set, 60, what=f"{name}'s ReplicaSet of the injected template")
    forged = copy.deepcopy(live)
    forged["metadata"]["annotations"][c.ANN_INJECTION_RECORD] = "{}"  # so the answer carries the plan's record
    update_answer = post_review(port, forged_update(namespace, forged, live))
    assert c.ANN_INJECTION_RECORD in update_answer, "the webhook answered the UPDATE with kvoffload's record"
    template = replica_set["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"generateName": f"{replica_set['metadata']['name']}-", "namespace": namespace,
                        "labels": dict(template["metadata"]["labels"]),
                        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "controller": True,
                                             "name": replica_set["metadata"]["name"],
                                             "uid": replica_set["metadata"]["uid"]}]},
           "spec": copy.deepcopy(template["spec"])}  # fmt: skip
    pod_answer = post_review(port, forged_pod_create(namespace, pod), c.WEBHOOK_PATH)
    assert c.ANN_INJECTED_FROM in pod_answer, "the webhook injected the forged pod (its owners' uids are real)"
    return update_answer, pod_answer


def test_forged_reviews_with_a_live_workloads_uids_get_none_of_its_options_text(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    """Whoever may read a Deployment and its ReplicaSet knows their uids: a forged UPDATE of the
    workload and a forged pod of its ReplicaSet are answered, and neither answer holds the user's
    options text (a comment and a value, so the merged file would show it too)."""
    marker = f"victim-secret-{uuid.uuid4().hex}"
    text = f"# {marker}\nmax_batch_size: 8\nkvoffload_test_marker: {marker}\n"
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "private-options", "namespace": namespace},
                    "data": {"extra.yaml": text}})  # fmt: skip
    apply(cluster, options_workload(namespace, "victim", "private-options", "extra.yaml"))
    answers = forged_reviews_with_real_uids(cluster, namespace, "victim", webhook_port(admission_operator))
    assert all(marker not in answer for answer in answers)


def test_forged_reviews_with_a_live_workloads_uids_get_no_redis_url_kept_in_a_secret(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    """A policy whose Redis URL is in a Secret (``l2.redis.urlSecretRef``): the forged UPDATE's and the
    forged pod's answers name the Secret (the cache server's env ``valueFrom``) and hold neither the URL
    nor its user, which only the Secret does."""
    user, host = f"cache-{uuid.uuid4().hex[:8]}", f"redis-{uuid.uuid4().hex[:8]}.cache"
    apply(cluster, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "redis-url", "namespace": namespace},
                    "stringData": {"url": f"redis://{user}@{host}:6379"}})  # fmt: skip
    apply(cluster, {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
                    "metadata": {"name": "shared-l2", "namespace": namespace},
                    "spec": {"l2": {"redis": {"urlSecretRef": {"name": "redis-url", "key": "url"}}}}})  # fmt: skip
    apply(cluster, trtllm_deployment("victim", namespace, replicas=0,
                                     annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: "shared-l2"}))  # fmt: skip
    update_answer, pod_answer = forged_reviews_with_real_uids(
        cluster, namespace, "victim", webhook_port(admission_operator)
    )
    for answer in (update_answer, pod_answer):
        assert user not in answer and host not in answer and "redis://" not in answer
    assert c.ENV_L2_REDIS_URL in pod_answer and '"name": "redis-url"' in pod_answer, "the URL by reference"
