"""One operator acts at a time: old and new operators overlapping (a RollingUpdate, ``helm upgrade``,
``helm rollback``) roll each workload exactly once per intended change, on the real apiserver."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, get, trtllm_deployment, wait_for
from kvoffload import contract as c
from kvoffload.operator.control.leadership import lease_path
from tests.support.operator_support import OPERATOR_NAMESPACE, OperatorProcess, all_containers, wait_injected

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]
WORKLOADS = 3
OVERLAP_S = 8


def l1_of(obj: dict[str, Any]) -> str:
    sidecar = next(x for x in all_containers(obj) if x["name"] == c.SIDECAR_CONTAINER)
    return next(e["value"] for e in sidecar["env"] if e["name"] == c.ENV_L1_SIZE)


def generations(cluster: LocalCluster, namespace: str) -> dict[str, int]:
    return {f"llm-{i}": get(cluster, "deployment", f"llm-{i}", namespace)["metadata"]["generation"]
            for i in range(WORKLOADS)}  # fmt: skip


def lease_holder(cluster: LocalCluster) -> str:
    out = cluster.kubectl("get", "--raw", lease_path(OPERATOR_NAMESPACE, c.OPERATOR_LEASE_NAME))
    return str(json.loads(out.stdout)["spec"].get("holderIdentity") or "")


def hand_over(cluster: LocalCluster, namespace: str, old: OperatorProcess, new: OperatorProcess, l1: str) -> None:
    """Start ``new`` beside ``old`` (overlap), stop ``old``: exactly one rollout per workload."""
    before = generations(cluster, namespace)
    new.start()  # answers /healthz while it waits for the Lease, like a standby pod
    time.sleep(OVERLAP_S)
    assert generations(cluster, namespace) == before, "the waiting operator wrote while the other acted"
    assert lease_holder(cluster) == f"operator-{old.workdir.name}"
    assert f"is held by operator-{old.workdir.name} (renewed " in new.log(), "the waiting operator says who holds it"
    old.stop()  # SIGTERM: the Lease is released on the way out
    wait_for(lambda: all(l1_of(get(cluster, "deployment", f"llm-{i}", namespace)) == l1 for i in range(WORKLOADS)),
             timeout=60, what=f"every workload rendered with L1 {l1} by the new operator")  # fmt: skip
    time.sleep(3)  # late events of the old generation must not roll again
    assert generations(cluster, namespace) == {k: v + 1 for k, v in before.items()}
    assert lease_holder(cluster) == f"operator-{new.workdir.name}"


def test_overlapping_operators_roll_each_workload_once_per_upgrade_and_rollback(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess, tmp_path: Path
) -> None:
    for i in range(WORKLOADS):
        apply(cluster, trtllm_deployment(f"llm-{i}", namespace, replicas=0, annotations={c.ANN_ENABLED: "true"}))
    for i in range(WORKLOADS):
        assert l1_of(wait_injected(cluster, "deployment", f"llm-{i}", namespace)) == "4Gi"
    time.sleep(2)
    upgraded = OperatorProcess(kubeconfig=running_operator.kubeconfig, workdir=tmp_path / "upgraded",
                               extra_args=["--default-l1-size", "5Gi"], overlap_allowed=True)  # fmt: skip
    rolled_back = OperatorProcess(kubeconfig=running_operator.kubeconfig, workdir=tmp_path / "rolled-back",
                                  overlap_allowed=True)  # fmt: skip
    for proc in (upgraded, rolled_back):
        proc.workdir.mkdir()
    try:
        hand_over(cluster, namespace, running_operator, upgraded, "5Gi")  # helm upgrade changing a default
        hand_over(cluster, namespace, upgraded, rolled_back, "4Gi")  # helm rollback
    finally:
        upgraded.stop()
        rolled_back.stop()
