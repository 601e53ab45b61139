"""KVCachePolicy: the CRD rejects bad specs; a policy change rolls attached workloads exactly once."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, get, list_objects, trtllm_deployment, wait_for
from kvoffload import contract as c
from tests.support.operator_support import OperatorProcess, events_for, wait_injected

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]


def policy(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip


GOOD_SPEC: dict[str, Any] = {
    "mode": "sidecar",
    "cache": {"l1Size": "4Gi", "evictionPolicy": "LRU", "chunkSize": 256, "maxWorkers": 4},
    "l2": {"fs": {"path": "/var/cache/kvoffload", "size": "10Gi"},
           "redis": {"url": "redis://redis.cache:6379/0", "passwordSecretRef": {"name": "redis", "key": "password"}}},
    "shmSize": "2Gi",
    "sidecar": {"gpuAccess": "nvidia-runtime", "runtimeClassName": ""},
    "connector": {"backend": "sidecar", "source": "init-container", "lookupTimeoutMs": 100,
                  "retrieveTimeoutMs": 5000, "storeTimeoutMs": 5000, "saveDecodeTokens": False},
}  # fmt: skip

BAD_SPECS = [
    ({"cache": {"l1Size": "lots"}}, "l1Size must be a quantity"),
    ({"cache": {"l1Size": "0"}}, "l1Size must be a quantity"),
    ({"cache": {"chunkSize": 100}}, "multiple of 16"),
    ({"cache": {"chunkSize": 8}}, "should be greater than or equal to 16"),
    ({"cache": {"evictionPolicy": "FIFO"}}, "Unsupported value"),
    ({"mode": "cluster"}, "Unsupported value"),
    ({"shmSize": "-1Gi"}, "shmSize must be a quantity"),
    ({"l2": {"redis": {"url": "http://redis:6379"}}}, "must be redis://[user@]host[:port][/0]"),
    ({"l2": {"redis": {"url": "rediss://redis:6380"}}}, "no rediss://"),
    ({"l2": {"redis": {"url": "redis://user:secret@redis:6379"}}}, "passwordSecretRef"),
    ({"l2": {"fs": {"path": "relative/dir", "size": "1Gi"}}}, "absolute path"),
    ({"connector": {"lookupTimeoutMs": 0}}, "should be greater than or equal to 1"),
    ({"connector": {"lookupTimeoutMs": 9000, "retrieveTimeoutMs": 5000}}, "must not exceed retrieveTimeoutMs"),
    ({"mode": "node", "connector": {"backend": "inprocess"}}, "mode node needs connector.backend sidecar"),
    (
        {"kvEvents": {"enabled": True}, "connector": {"backend": "inprocess"}},
        "kvEvents.enabled needs connector.backend sidecar",
    ),
    ({"sidecar": {"gpuAccess": "privileged"}}, "Unsupported value"),
]


def test_crd_accepts_a_complete_spec(cluster: LocalCluster, namespace: str, operator_kubeconfig: object) -> None:
    out = cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", input=json.dumps(policy("ok", namespace, **GOOD_SPEC))
    )
    assert "created (server dry run)" in out.stdout


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS, ids=[m for _, m in BAD_SPECS])
def test_crd_rejects_bad_specs(
    cluster: LocalCluster, namespace: str, operator_kubeconfig: object, spec: dict[str, Any], message: str
) -> None:
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(policy("bad", namespace, **spec)),
                          check=False)  # fmt: skip
    assert out.returncode != 0
    assert message in out.stderr, out.stderr


def _template_hash(cluster: LocalCluster, name: str, namespace: str) -> str:
    dep = get(cluster, "deployment", name, namespace)
    return str(dep["spec"]["template"].get("metadata", {}).get("annotations", {}).get(c.ANN_CONFIG_HASH, ""))


def _status_hash(cluster: LocalCluster, name: str, namespace: str) -> str | None:
    status = get(cluster, "kvcachepolicy", "tuned", namespace).get("status", {})
    return next((w["configHash"] for w in status.get("workloads", []) if w["name"] == name), None)


def test_policy_change_rolls_attached_workloads_exactly_once(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    apply(cluster, policy("tuned", namespace, cache={"l1Size": "4Gi"}))
    apply(
        cluster, trtllm_deployment("tuned-llm", namespace, annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: "tuned"})
    )
    wait_injected(cluster, "deployment", "tuned-llm", namespace)
    first = _template_hash(cluster, "tuned-llm", namespace)
    wait_for(lambda: _status_hash(cluster, "tuned-llm", namespace) == first, what="policy status listing the workload")
    status = get(cluster, "kvcachepolicy", "tuned", namespace)["status"]
    assert status["conditions"][0]["type"] == "Ready" and status["conditions"][0]["status"] == "True"
    assert status["workloadCount"] == 1
    before = get(cluster, "deployment", "tuned-llm", namespace)
    replicasets = len(list_objects(cluster, "replicasets", namespace, "app=tuned-llm"))

    cluster.kubectl("patch", "kvcachepolicy", "tuned", "-n", namespace, "--type=merge",
                    "-p", json.dumps({"spec": {"cache": {"l1Size": "6Gi"}}}))  # fmt: skip
    wait_for(lambda: (h := _template_hash(cluster, "tuned-llm", namespace)) != first and h, what="the new config hash")
    second = _template_hash(cluster, "tuned-llm", namespace)
    wait_for(lambda: _status_hash(cluster, "tuned-llm", namespace) == second, what="policy status with the new hash")
    # The rollout's ReplicaSet comes from kube-controller-manager, on its own time.
    wait_for(
        lambda: len(list_objects(cluster, "replicasets", namespace, "app=tuned-llm")) > replicasets,
        what="the rollout's new ReplicaSet",
    )
    time.sleep(2)  # let any (wrong) second change show up
    after = get(cluster, "deployment", "tuned-llm", namespace)
    assert after["metadata"]["generation"] == before["metadata"]["generation"] + 1
    assert len(list_objects(cluster, "replicasets", namespace, "app=tuned-llm")) == replicasets + 1
    sidecar = next(x for x in after["spec"]["template"]["spec"]["initContainers"] if x["name"] == c.SIDECAR_CONTAINER)
    assert sidecar["resources"]["limits"]["memory"] == "8Gi"  # 6Gi L1 + 2Gi overhead
    cm = get(cluster, "configmap", "tuned-llm" + c.GENERATED_CONFIGMAP_SUFFIX, namespace)
    assert json.loads(cm["data"][c.POLICY_FILE])["cache"]["l1Size"] == "6Gi"


def test_missing_policy_warns_then_injects_once_the_policy_exists(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    apply(cluster, trtllm_deployment("early", namespace, replicas=0,
                                     annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: "later"}))  # fmt: skip
    event = wait_for(lambda: events_for(cluster, namespace, "early", "KvoffloadInvalid"), what="a Warning")[0]
    assert c.ANN_POLICY in event["message"] and "'later'" in event["message"]
    errors = running_operator.metric_sum(c.M_OPERATOR_ERRORS + "_total", reason="policy_missing")
    assert errors >= 1
    apply(cluster, policy("later", namespace, cache={"l1Size": "2Gi"}))
    dep = wait_injected(cluster, "deployment", "early", namespace)
    assert dep["metadata"]["generation"] == 2


def test_a_node_mode_policy_without_node_mode_enabled_is_refused_and_nothing_is_applied(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    # The default install grants no pod rights, so the operator runs with --node-mode false.
    apply(cluster, policy("shared", namespace, mode="node"))
    apply(cluster, trtllm_deployment("llm", namespace, replicas=0,
                                     annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: "shared"}))  # fmt: skip
    event = wait_for(lambda: events_for(cluster, namespace, "llm", "KvoffloadInvalid"), what="a Warning")[0]
    assert "node mode is off" in event["message"] and "nodeMode.enabled=true" in event["message"]
    dep = json.loads(cluster.kubectl("get", "deployment", "llm", "-n", namespace, "-o", "json",
                                     "--show-managed-fields").stdout)  # fmt: skip
    assert c.ANN_CONFIG_HASH not in (dep["spec"]["template"]["metadata"].get("annotations") or {})
    managers = {m["manager"] for m in dep["metadata"]["managedFields"]}
    assert "kubectl-client-side-apply" in managers and c.FIELD_MANAGER not in managers, managers
    assert list_objects(cluster, "pods", namespace, c.LABEL_CACHE_POLICY) == []
