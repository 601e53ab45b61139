"""Admission mode under a platform team's ordinary operations, every write counted by the
apiserver's audit log: ``kubectl rollout undo`` after a policy change, args that start naming the
options ConfigMap, settings the webhook refuses, a label without the opt-in, a PodDisruptionBudget
that allows no disruption, owners that only look like a workload's, template changes that need
nothing from the operator, the catch-up of a two- and a one-replica workload, and a new app
(Deployment or StatefulSet) that arrives opted in."""

from __future__ import annotations

import hashlib
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, get, list_objects, wait_for
from kvoffload import contract as c
from tests.integration.operator.test_operator_admission import live, manifest, pods, revision, settled
from tests.support.audit import OPERATOR_USER, AuditWindow
from tests.support.operator_support import OperatorProcess, events_for
from tests.support.options_init import options_init_container, run_options_init

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]
WATCH_S = 20.0
"""How long a workload is watched for evictions that must not happen (past the 15 s first backoff)."""


def evictions(audit: AuditWindow, namespace: str) -> list[tuple[str, int]]:
    """(pod, answer) of every eviction the operator asked for in ``namespace``."""
    return [(w.name, w.code) for w in audit.writes(OPERATOR_USER, namespace) if w.resource == "pods/eviction"]


def policy(name: str, namespace: str, l1: str) -> dict[str, Any]:
    return {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": {"cache": {"l1Size": l1}}}  # fmt: skip


def sidecar_l1(pod: dict[str, Any]) -> str:
    sidecar = next(x for x in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]
                   if x["name"] == c.SIDECAR_CONTAINER)  # fmt: skip
    return str(next(e["value"] for e in sidecar["env"] if e["name"] == c.ENV_L1_SIZE))


def record_manager(dep: dict[str, Any]) -> set[str]:
    """Field managers holding the record annotation."""
    return {m["manager"] for m in dep["metadata"]["managedFields"]
            if f"f:{c.ANN_INJECTION_RECORD}" in m.get("fieldsV1", {}).get("f:metadata", {}).get("f:annotations", {})}  # fmt: skip


def creates(audit: AuditWindow, namespace: str, resource: str) -> int:
    """Objects of ``resource`` created in ``namespace`` (by anyone: the controllers' pods and ReplicaSets)."""
    return len(
        [w for w in audit.writes(None, namespace) if w.verb == "create" and w.resource == resource and w.code < 400]
    )


def test_rollout_undo_after_a_policy_change_converges_in_one_rollout_without_evictions(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    """``kubectl rollout undo`` puts an older template back, with the older record and label, as
    another field manager. The write keeps kvoffload's record and label as the current policy gives
    them (kubectl shows a warning saying so): an undo whose only difference was the policy rolls
    nothing; an undo to an older image rolls once, every pod of it injected from the current
    policy; the operator writes nothing and evicts nothing."""
    name = "undo"
    apply(cluster, policy("tuned", namespace, "4Gi"))
    body = manifest(name, namespace, "trtllm:1.2.0", opted_in=True)
    body["metadata"]["annotations"][c.ANN_POLICY] = "tuned"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))  # revision 1: 1.2.0, 4Gi
    assert {sidecar_l1(p) for p in settled(cluster, name, namespace, True, "trtllm:1.2.0")} == {"4Gi"}
    body["spec"]["template"]["spec"]["containers"][0]["image"] = "trtllm:1.2.1"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))  # revision 2: 1.2.1, 4Gi
    settled(cluster, name, namespace, True, "trtllm:1.2.1")
    apply(cluster, policy("tuned", namespace, "5Gi"))  # revision 3: 1.2.1, 5Gi
    wait_for(lambda: {sidecar_l1(p) for p in settled(cluster, name, namespace, True, "trtllm:1.2.1")} == {"5Gi"},
             120, what="pods on the changed policy")  # fmt: skip
    time.sleep(4)

    def converged(image: str) -> bool:
        dep = live(cluster, name, namespace)
        found = settled(cluster, name, namespace, True, image)
        label = dep["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT]
        return (record_manager(dep) == {c.FIELD_MANAGER} and {sidecar_l1(p) for p in found} == {"5Gi"}
                and all(p["metadata"]["annotations"].get(c.ANN_INJECTED_FROM) == label for p in found))  # fmt: skip

    for undo, image, rollouts in ((["rollout", "undo"], "trtllm:1.2.1", 0),
                                  (["rollout", "undo", "--to-revision=1"], "trtllm:1.2.0", 1)):  # fmt: skip
        audit = AuditWindow(cluster.audit_log).mark()
        before = revision(cluster, name, namespace)
        said = cluster.kubectl(*undo, f"deployment/{name}", "-n", namespace)
        wait_for(lambda image=image: converged(image), 120,  # type: ignore[misc]
                 what="every pod injected from the current policy's record, held by kvoffload")  # fmt: skip
        time.sleep(6)
        counted = {"rollouts": revision(cluster, name, namespace) - before,
                   "ReplicaSets created": creates(audit, namespace, "replicasets"),
                   "pods created": creates(audit, namespace, "pods"), "evictions": evictions(audit, namespace),
                   "operator writes": dict(audit.counts(OPERATOR_USER, namespace))}  # fmt: skip
        print(f"kubectl {' '.join(undo)}: {counted}; kubectl said: {said.stderr.strip()}")
        assert counted["rollouts"] == rollouts, counted
        assert counted["pods created"] == 2 * rollouts, "a pod was created plain and replaced, or rolled twice"
        assert counted["ReplicaSets created"] <= rollouts and counted["evictions"] == [], counted
        assert counted["operator writes"] == {}, "the undo's own write carries kvoffload's fields"
        assert "kept kvoffload's" in said.stderr, said.stderr


def test_an_args_change_that_starts_naming_the_options_configmap_rolls_once(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess, tmp_path: Path
) -> None:
    """The user's next manifest mounts their options ConfigMap and names the file in the engine's
    args: the record changes with it (it names the options file's digest), in the same write, so
    one rollout, its pods injected with the merged file from the start (their init container, run
    here as the kubelet would, merges the ConfigMap's file); the operator writes nothing."""
    name = "opts"
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-options", "namespace": namespace},
                    "data": {"extra.yaml": "max_batch_size: 8\n"}})  # fmt: skip
    body = manifest(name, namespace, "trtllm:1.2.0", opted_in=True)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    settled(cluster, name, namespace, True, "trtllm:1.2.0")
    time.sleep(4)
    audit = AuditWindow(cluster.audit_log).mark()
    before = revision(cluster, name, namespace)
    engine = body["spec"]["template"]["spec"]["containers"][0]
    engine["args"] += ["--extra_llm_api_options", "/config/extra.yaml"]
    engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config"}]
    body["spec"]["template"]["spec"]["volumes"] = [{"name": "cfg", "configMap": {"name": f"{name}-options"}}]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))

    def merged() -> bool:
        found = settled(cluster, name, namespace, True, "trtllm:1.2.0")
        digest = hashlib.sha256(b"max_batch_size: 8\n").hexdigest()
        if not all(digest in options_init_container(p)["args"] for p in found):
            return False  # not injected from the record that names the file yet
        runs = [run_options_init(p, {"/config/extra.yaml": "max_batch_size: 8\n"}, Path(tempfile.mkdtemp(dir=tmp_path)))
                for p in found]  # fmt: skip
        return all(r.returncode == 0 and "max_batch_size: 8" in (r.options or "") for r in runs)

    wait_for(merged, 120, what="both pods injected with the user's options merged")
    time.sleep(6)
    counted = {"rollouts": revision(cluster, name, namespace) - before, "pods created": creates(audit, namespace, "pods"),
               "evictions": evictions(audit, namespace), "operator writes": dict(audit.counts(OPERATOR_USER, namespace))}  # fmt: skip
    print(f"args change naming the options ConfigMap: {counted}")
    assert counted["rollouts"] == 1 and counted["pods created"] == 2, counted
    assert counted["evictions"] == [] and not [k for k in counted["operator writes"] if k[0] == "patch"], counted


def test_pods_the_webhook_would_not_inject_are_never_evicted(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    """A setting the webhook refuses (the user's PYTHONPATH on the engine) and a Deployment that
    carries the label but is not opted in (a copy of ``kubectl get -o yaml``): pods start as written
    and stay; the refusal is said once."""
    refused = manifest("refused", namespace, "trtllm:1.2.0", opted_in=True)
    refused["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "PYTHONPATH", "value": "/app/lib"}]
    copied = manifest("copied", namespace, "trtllm:1.2.0", opted_in=False)
    copied["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT] = "0123456789abcdef"
    audit = AuditWindow(cluster.audit_log).mark()
    for body in (refused, copied):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    first = {n: {p["metadata"]["name"] for p in settled(cluster, n, namespace, False, "trtllm:1.2.0")}
             for n in ("refused", "copied")}  # fmt: skip
    time.sleep(WATCH_S)
    for name in ("refused", "copied"):
        assert {p["metadata"]["name"] for p in pods(cluster, name, namespace)} == first[name], f"{name}'s pods changed"
    assert evictions(audit, namespace) == []
    invalid = events_for(cluster, namespace, "refused", "KvoffloadInvalid")
    assert len(invalid) == 1 and invalid[0].get("count", 1) == 1, invalid
    assert not events_for(cluster, namespace, "refused", "KvoffloadNotInjected")
    assert not events_for(cluster, namespace, "copied", "KvoffloadNotInjected")


def test_a_pod_disruption_budget_refusal_is_reported_and_retried_with_backoff(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    name = "guarded"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(name, namespace, "trtllm:1.2.0", opted_in=True)))
    settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")
    apply(cluster, {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": name}}}})  # fmt: skip
    admission_operator.stop()
    try:
        cluster.kubectl("delete", "pod", pods(cluster, name, namespace)[0]["metadata"]["name"], "-n", namespace)
        wait_for(lambda: len([p for p in pods(cluster, name, namespace) if p.get("status", {}).get("phase") == "Running"
                              and p["metadata"]["labels"].get(c.LABEL_INJECTED) != "true"]) == 1, 60,
                 what="a replacement admitted without the injection")  # fmt: skip
        wait_for(lambda: get(cluster, "pdb", name, namespace).get("status", {}).get("currentHealthy") == 2, 60,
                 what="the budget sees both pods healthy")  # fmt: skip
    finally:
        audit = AuditWindow(cluster.audit_log).mark()
        admission_operator.start()
    refusal = wait_for(lambda: events_for(cluster, namespace, name, "KvoffloadEvictionRefused"), 30,
                       what="a KvoffloadEvictionRefused Event")  # fmt: skip
    time.sleep(WATCH_S)
    tries = evictions(audit, namespace)
    print(f"eviction tries against a budget allowing no disruption, in {WATCH_S:.0f} s: {tries}")
    assert tries and all(code == 429 for _, code in tries), tries
    assert len(tries) <= 3, "backoff: 15 s, then 30 s"
    assert admission_operator.metric_sum(c.M_OPERATOR_EVICTION_REFUSALS + "_total") == len(tries)
    assert "PodDisruptionBudget" in refusal[0]["message"] or "disruption budget" in refusal[0]["message"]
    cluster.kubectl("delete", "pdb", name, "-n", namespace)
    settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")  # the next try goes through


def test_a_pod_whose_owner_only_looks_like_an_opted_in_workload_is_not_injected(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    """Deployment ``llama`` is opted in; the user's own ReplicaSet ``llama-evil`` and a bare pod whose
    owner reference says ``llama-zzzzz`` carry its label: neither gets its sidecar."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest("llama", namespace, "trtllm:1.2.0", opted_in=True)))
    settled(cluster, "llama", namespace, injected=True, image="trtllm:1.2.0")
    label = get(cluster, "deployment", "llama", namespace)["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT]
    template = manifest("evil", namespace, "trtllm:1.2.0", opted_in=False)["spec"]["template"]
    template["metadata"]["labels"][c.LABEL_INJECT] = label
    apply(cluster, {"apiVersion": "apps/v1", "kind": "ReplicaSet", "metadata": {"name": "llama-evil", "namespace": namespace},
                    "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "evil"}}, "template": template}})  # fmt: skip
    rs = get(cluster, "replicaset", "llama-evil", namespace)
    bare = {"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "llama-zzzzz-abcde", "namespace": namespace, "labels": {"app": "bare", c.LABEL_INJECT: label},
        "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "llama-zzzzz",
                             "uid": rs["metadata"]["uid"], "controller": True}]},
        "spec": template["spec"]}  # fmt: skip
    # the garbage collector deletes a pod whose owner is not there: what counts is the pod as admitted
    admitted = json.loads(cluster.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(bare)).stdout)
    evil = wait_for(lambda: list_objects(cluster, "pods", namespace, "app=evil"), 60, what="llama-evil's pod")
    for pod in [admitted, *evil]:
        names = [x["name"] for x in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]]
        assert c.SIDECAR_CONTAINER not in names, f"{pod['metadata']['name']} was injected as llama's"
        assert pod["metadata"]["labels"].get(c.LABEL_INJECTED) != "true"


def test_template_changes_the_operator_has_nothing_to_add_to_send_no_operator_patch(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    """Re-apply, image change, replicas change: the apiserver logs no PATCH from the operator."""
    name = "quiet"
    body = manifest(name, namespace, "trtllm:1.2.0", opted_in=True)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")
    time.sleep(4)
    audit = AuditWindow(cluster.audit_log).mark()
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    body["spec"]["template"]["spec"]["containers"][0]["image"] = "trtllm:1.2.1"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    settled(cluster, name, namespace, injected=True, image="trtllm:1.2.1")
    cluster.kubectl("scale", f"deployment/{name}", "-n", namespace, "--replicas=3")
    wait_for(lambda: len([p for p in pods(cluster, name, namespace)
                          if p["metadata"]["labels"].get(c.LABEL_INJECTED) == "true"]) == 3, 60, what="3 pods")  # fmt: skip
    time.sleep(4)
    writes = audit.counts(OPERATOR_USER, namespace)
    print(f"operator writes over re-apply, image change and scale: {dict(writes)}")
    assert not [k for k in writes if k[0] == "patch"], writes


def test_a_workload_with_every_pod_uninjected_is_caught_up_one_eviction_at_a_time(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    """Both pods re-created while the operator is down: after its restart, exactly one eviction per
    pod, each only once the previous replacement is ready (never both pods down), none repeated."""
    name = "catch-up"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(name, namespace, "trtllm:1.2.0", opted_in=True)))
    settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")
    admission_operator.stop()
    try:
        cluster.kubectl("delete", "pods", "-n", namespace, "-l", f"app={name}")
        settled(cluster, name, namespace, injected=False, image="trtllm:1.2.0")
    finally:
        audit = AuditWindow(cluster.audit_log).mark()
        admission_operator.start()
    fewest_ready = 2
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        current = pods(cluster, name, namespace)
        ready = [p for p in current if any(x["type"] == "Ready" and x["status"] == "True"
                                           for x in p.get("status", {}).get("conditions", []))]  # fmt: skip
        fewest_ready = min(fewest_ready, len(ready))
        if len(ready) == 2 and all(p["metadata"]["labels"].get(c.LABEL_INJECTED) == "true" for p in ready):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"not caught up: {[p['metadata']['name'] for p in pods(cluster, name, namespace)]}")
    time.sleep(4)
    tries = evictions(audit, namespace)
    print(f"catch-up of 2 uninjected pods: eviction calls {tries}, fewest ready pods seen {fewest_ready}")
    assert sorted(code for _, code in tries) == [201, 201] and len({pod for pod, _ in tries}) == 2, tries
    assert fewest_ready >= 1, "both pods were down at once"


def test_a_one_replica_workload_is_caught_up_by_one_eviction(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    """What docs/operator.md says of a one-replica workload, kept by decision: the Eviction API
    cannot surge, so its catch-up is exactly one eviction and the workload serves nothing until the
    replacement is ready (a budget with ``minAvailable: 1`` keeps the uninjected pod serving
    instead, as the budget test shows)."""
    name = "single"
    body = manifest(name, namespace, "trtllm:1.2.0", opted_in=True)
    body["spec"]["replicas"] = 1

    def one(injected: bool) -> list[dict[str, Any]] | None:
        found = pods(cluster, name, namespace)
        good = [p for p in found if p.get("status", {}).get("phase") == "Running"
                and (p["metadata"].get("labels", {}).get(c.LABEL_INJECTED) == "true") == injected]  # fmt: skip
        return good if len(found) == 1 and len(good) == 1 else None

    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    wait_for(lambda: one(True), 120, what="one injected pod")
    admission_operator.stop()
    try:
        cluster.kubectl("delete", "pods", "-n", namespace, "-l", f"app={name}")
        (plain,) = wait_for(lambda: one(False), 120, what="the pod re-created uninjected")
    finally:
        audit = AuditWindow(cluster.audit_log).mark()
        admission_operator.start()
    wait_for(lambda: one(True), 120, what="the pod injected again")
    time.sleep(4)
    tries = evictions(audit, namespace)
    print(f"one-replica catch-up: eviction calls {tries}")
    assert tries == [(plain["metadata"]["name"], 201)], tries


@pytest.mark.parametrize(("kind", "method"), [("Deployment", "client-side"), ("Deployment", "server-side"),
                                             ("StatefulSet", "client-side")])  # fmt: skip
def test_a_new_app_that_arrives_opted_in_rolls_once(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess, kind: str, method: str
) -> None:
    """A GitOps tool creates the workload with the opt-in already in it: one revision (one
    ReplicaSet, or one ControllerRevision of a StatefulSet), its pods injected from the start, the
    operator's one write changes no template; a re-apply stays quiet."""
    from tests.integration.operator.test_operator_admission import gitops_apply, gitops_diff

    name = f"born-{kind.lower()}-{method}"
    body = manifest(name, namespace, "trtllm:1.2.0", opted_in=True)
    if kind == "StatefulSet":
        body["kind"], body["spec"]["serviceName"] = kind, name
        body["spec"].pop("strategy")
    audit = AuditWindow(cluster.audit_log).mark()
    gitops_apply(cluster, method, body)
    found = settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")
    time.sleep(4)
    workload = json.loads(cluster.kubectl("get", kind.lower(), name, "-n", namespace, "-o", "json",
                                          "--show-managed-fields").stdout)  # fmt: skip
    label = workload["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT]
    assert record_manager(workload) == {c.FIELD_MANAGER}
    assert all(p["metadata"]["annotations"][c.ANN_INJECTED_FROM] == label for p in found)
    gitops_apply(cluster, method, body)
    time.sleep(4)
    revisions = "replicasets" if kind == "Deployment" else "controllerrevisions"
    counted = {f"{revisions} created": creates(audit, namespace, revisions), "pods created": creates(audit, namespace, "pods"),
               "evictions": evictions(audit, namespace), "operator writes": dict(audit.counts(OPERATOR_USER, namespace))}  # fmt: skip
    print(f"new app opted in [{kind}, {method}]: {counted}")
    assert counted[f"{revisions} created"] == 1 and counted["pods created"] == 2, counted
    assert counted["evictions"] == []
    if kind == "Deployment":
        assert revision(cluster, name, namespace) == 1
    assert gitops_diff(cluster, method, body) == ""


def test_an_opted_in_workload_in_kube_system_gets_a_warning_and_no_write_or_eviction(
    cluster: LocalCluster, admission_operator: OperatorProcess
) -> None:
    """kube-system is outside both webhooks' scope: its pods are never injected, so the operator
    must not label the workload (every pod would be evicted, in vain, with backoff). It says why."""
    name = f"in-kube-system-{int(time.time()) % 100000}"
    audit = AuditWindow(cluster.audit_log).mark()
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(name, "kube-system", "trtllm:1.2.0", opted_in=True)))
    try:
        warning = wait_for(lambda: events_for(cluster, "kube-system", name, "KvoffloadInvalid"), 30,
                           what="a KvoffloadInvalid Warning")  # fmt: skip
        assert "kube-system" in warning[0]["message"]
        wait_for(lambda: len(pods(cluster, name, "kube-system")) >= 1, 60, what="the workload's pods")
        time.sleep(WATCH_S)
        dep = live(cluster, name, "kube-system")
        assert c.ANN_INJECTION_RECORD not in dep["metadata"].get("annotations", {})
        assert c.LABEL_INJECT not in dep["spec"]["template"]["metadata"].get("labels", {})
        writes = [w for w in audit.writes(OPERATOR_USER, "kube-system") if w.resource != "events"]
        assert writes == [], f"the operator wrote outside its scope: {writes}"
    finally:
        cluster.kubectl("delete", "deployment", name, "-n", "kube-system", "--wait=false", check=False)
