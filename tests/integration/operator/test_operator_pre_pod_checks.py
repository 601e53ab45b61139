"""Failures a pod would hit are caught before the pod, on the real apiserver: an L1 no GPU node can
hold (the pod would stay Pending) and a /dev/shm of the user's too small for the L1 (LMCache's slow
path) each get a KvoffloadInvalid Warning, and the workload stays as the user wrote it."""

from __future__ import annotations

from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, get, trtllm_container, trtllm_deployment, wait_for
from kvoffload import contract as c
from tests.support.operator_support import OperatorProcess, events_for, is_injected, wait_injected

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]


def warning(cluster: LocalCluster, namespace: str, name: str) -> str:
    events: list[dict[str, Any]] = wait_for(lambda: events_for(cluster, namespace, name, "KvoffloadInvalid"), 30,
                                            what="a KvoffloadInvalid Warning")  # fmt: skip
    dep = get(cluster, "deployment", name, namespace)
    assert not is_injected(dep) and dep["metadata"]["generation"] == 1, "the workload must stay untouched"
    return str(events[0]["message"])


def test_an_l1_no_gpu_node_can_hold_is_refused_before_a_pod_would_stay_pending(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    for name, l1 in (("huge", "600Gi"), ("fits", "100Gi")):
        apply(cluster, {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
                        "metadata": {"name": name, "namespace": namespace}, "spec": {"cache": {"l1Size": l1}}})  # fmt: skip
        apply(cluster, trtllm_deployment(name, namespace, replicas=0,
                                         annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: name}))  # fmt: skip
    message = warning(cluster, namespace, "huge")
    assert "cache.l1Size: '600Gi'" in message and "largest GPU node allocates 512Gi" in message, message
    wait_injected(cluster, "deployment", "fits", namespace)


def test_a_users_dev_shm_too_small_for_the_l1_is_refused(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    engine = trtllm_container()
    engine["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    apply(cluster, trtllm_deployment("small-shm", namespace, replicas=0, containers=[engine],
                                     annotations={c.ANN_ENABLED: "true"},
                                     volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}}]))  # fmt: skip
    message = warning(cluster, namespace, "small-shm")
    assert "sizeLimit 64Mi" in message and "at least 5Gi" in message, message  # tests' defaults: 4Gi L1 + 1Gi
