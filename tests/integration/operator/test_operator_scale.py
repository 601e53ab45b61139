"""Many workloads converge; an operator killed half-way converges on restart without duplicates."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from kvoffload import contract as c
from tests.integration.operator.operator_support import OperatorProcess, all_containers, is_injected
from tests.support.workloads import list_objects, trtllm_deployment, wait_for

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]


def _create_many(cluster: LocalCluster, namespace: str, count: int, prefix: str) -> None:
    items = [
        trtllm_deployment(f"{prefix}-{i:03d}", namespace, replicas=0, annotations={c.ANN_ENABLED: "true"})
        for i in range(count)
    ]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))


def _injected(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    return [d for d in list_objects(cluster, "deployments", namespace) if is_injected(d)]


def _assert_no_duplicates(dep: dict[str, Any]) -> None:
    spec = dep["spec"]["template"]["spec"]
    names = Counter(x["name"] for x in all_containers(dep))
    assert names[c.SIDECAR_CONTAINER] == 1 and names[c.BUNDLE_INIT_CONTAINER] == 1, names
    assert all(n == 1 for n in names.values()), names
    volumes = Counter(v["name"] for v in spec["volumes"])
    assert all(n == 1 for n in volumes.values()), volumes
    engine = next(x for x in spec["containers"] if x["name"] == "trtllm")
    env = Counter(e["name"] for e in engine["env"])
    assert all(n == 1 for n in env.values()), env
    assert engine["args"].count("--extra_llm_api_options") == 1


def test_one_hundred_annotated_deployments_converge(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    started = time.monotonic()
    _create_many(cluster, namespace, 100, "fleet")
    injected = wait_for(lambda: (d := _injected(cluster, namespace)) and len(d) == 100 and d, timeout=300,
                        interval=2, what="100 injected Deployments")  # fmt: skip
    elapsed = time.monotonic() - started
    for dep in injected:
        _assert_no_duplicates(dep)
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
        _assert_no_duplicates(dep)
        # One change for the injection, whoever did it.
        assert dep["metadata"]["generation"] == 2, dep["metadata"]["name"]
    assert partial >= 3
