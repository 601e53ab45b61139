"""Many workloads converge; an operator killed half-way converges on restart without duplicates."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import list_objects, trtllm_deployment, wait_for
from kvoffload import contract as c
from tests.support.operator_support import OperatorProcess, assert_no_duplicates, is_injected

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]


def _create_many(cluster: LocalCluster, namespace: str, count: int, prefix: str) -> None:
    items = [
        trtllm_deployment(f"{prefix}-{i:03d}", namespace, replicas=0, annotations={c.ANN_ENABLED: "true"})
        for i in range(count)
    ]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


def _injected(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    return [d for d in list_objects(cluster, "deployments", namespace) if is_injected(d)]


def test_one_hundred_annotated_deployments_converge(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    started = time.monotonic()
    _create_many(cluster, namespace, 100, "fleet")
    injected = wait_for(lambda: (d := _injected(cluster, namespace)) and len(d) == 100 and d, timeout=300,
                        interval=2, what="100 injected Deployments")  # fmt: skip
    elapsed = time.monotonic() - started
    for dep in injected:
        assert_no_duplicates(dep)
    cms = [m for m in list_objects(cluster, "configmaps", namespace) if m["metadata"]["name"].endswith("-kvoffload")]
    assert len(cms) == 100
    print(f"100 Deployments injected in {elapsed:.1f} s")


def test_operator_killed_midway_converges_on_restart_without_duplicates(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    running_operator.stop()
    _create_many(cluster, namespace, 30, "crash")
    running_operator.start()
    wait_for(lambda: len(_injected(cluster, namespace)) >= 3, interval=0.2, what="a few injected")
    running_operator.kill()
    partial = len(_injected(cluster, namespace))
    running_operator.start()
    injected = wait_for(lambda: (d := _injected(cluster, namespace)) and len(d) == 30 and d, timeout=180,
                        interval=1, what="all 30 injected after the restart")  # fmt: skip
    for dep in injected:
        assert_no_duplicates(dep)
        # One change for the injection, whoever did it.
        assert dep["metadata"]["generation"] == 2, dep["metadata"]["name"]
    assert partial >= 3
