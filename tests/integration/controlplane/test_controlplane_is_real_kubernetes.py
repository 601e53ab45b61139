"""The local control plane is a real Kubernetes: controllers, scheduler, RBAC, Pod Security."""

from __future__ import annotations

import json
import subprocess

import pytest

from hack.localcluster import GPU_RESOURCE, LocalCluster
from hack.workloads import apply, get, list_objects, trtllm_deployment, wait_for

pytestmark = [pytest.mark.controlplane]


def test_gpu_deployment_gets_a_replicaset_and_a_running_pod_on_a_fake_gpu_node(
    cluster: LocalCluster, namespace: str
) -> None:
    apply(cluster, trtllm_deployment("llama", namespace))

    rs = wait_for(lambda: list_objects(cluster, "replicasets", namespace, "app=llama"), what="a ReplicaSet")
    assert rs[0]["metadata"]["ownerReferences"][0]["name"] == "llama"

    def running_pod() -> dict | None:
        pods = list_objects(cluster, "pods", namespace, "app=llama")
        return next((p for p in pods if p.get("status", {}).get("phase") == "Running"), None)

    pod = wait_for(running_pod, timeout=90, what="a Running pod")
    node = get(cluster, "node", pod["spec"]["nodeName"], "")
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert int(node["status"]["allocatable"][GPU_RESOURCE]) >= 1
    assert pod["spec"]["containers"][0]["resources"]["limits"][GPU_RESOURCE] == "1"


def test_pod_security_baseline_rejects_a_privileged_pod(cluster: LocalCluster, namespace: str) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "privileged", "namespace": namespace},
        "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {"privileged": True}}]},
    }
    result = cluster.kubectl("apply", "-f", "-", input=json.dumps(pod), check=False)
    assert result.returncode != 0
    assert 'violates PodSecurity "baseline' in result.stderr


def test_service_account_without_rbac_is_forbidden(cluster: LocalCluster, namespace: str, tmp_path) -> None:
    cluster.kubectl("create", "serviceaccount", "nobody", "-n", namespace)
    kubeconfig = cluster.service_account_kubeconfig(namespace, "nobody", tmp_path / "nobody.kubeconfig")
    denied = cluster.kubectl("get", "deployments", "-n", namespace, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0
    assert f'"system:serviceaccount:{namespace}:nobody" cannot list resource "deployments"' in denied.stderr


def test_server_side_apply_tracks_field_managers(cluster: LocalCluster, namespace: str) -> None:
    apply(cluster, trtllm_deployment("ssa", namespace))
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "ssa", "namespace": namespace, "annotations": {"example.com/owned": "yes"}},
    }
    subprocess.run(
        [str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.admin_kubeconfig), "apply",
         "--server-side", "--field-manager=test-manager", "-f", "-"],
        input=json.dumps(patch), text=True, check=True, capture_output=True,
    )  # fmt: skip
    shown = cluster.kubectl("get", "deployment", "ssa", "-n", namespace, "-o", "json", "--show-managed-fields")
    managers = {m["manager"] for m in json.loads(shown.stdout)["metadata"]["managedFields"]}
    assert "test-manager" in managers
