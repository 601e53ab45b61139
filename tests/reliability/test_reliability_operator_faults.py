"""Operator faults on the real control plane: SIGKILL at random points, and an apiserver restart.

A seeded random series of intended changes (opt in, opt out, a policy change, an annotation
change) runs over a few Deployments; after some of them the operator is SIGKILLed after a random
delay (mid-reconcile or mid-start-up) and started again, as kubelet would. After every change the
state must converge, with no duplicate containers, and each Deployment's ``metadata.generation``
must not exceed 1 + the user's own edits + the intended changes that touched it (at most one
operator-made rollout per intended change).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, get, list_objects, trtllm_deployment, wait_for
from kvoffload import contract as c
from kvoffload.operator.intent.settings import OperatorDefaults
from kvoffload.quantity import parse_bytes
from tests.support.operator_support import (
    OperatorProcess,
    all_containers,
    annotate,
    assert_no_duplicates,
    is_clean,
    is_injected,
)
from tests.support.scale import count

pytestmark = [pytest.mark.reliability, pytest.mark.controlplane, pytest.mark.timeout(count(ci=900, soak=2400))]
CHANGES = count(ci=12, soak=50)
WORKLOADS = 3
POLICY = "faults"


@dataclass
class Desired:
    enabled: bool = False
    l1_annotation: str | None = None
    user_edits: int = 0
    intended_changes: int = 0


def _policy(namespace: str, l1: str) -> dict[str, Any]:
    return {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
            "metadata": {"name": POLICY, "namespace": namespace}, "spec": {"cache": {"l1Size": l1}}}  # fmt: skip


def _l1_in_configmap(cluster: LocalCluster, namespace: str, name: str) -> str | None:
    out = cluster.kubectl("get", "configmap", name + c.GENERATED_CONFIGMAP_SUFFIX, "-n", namespace, "-o", "json",
                          check=False)  # fmt: skip
    if out.returncode != 0:
        return None
    return json.loads(json.loads(out.stdout)["data"][c.POLICY_FILE])["cache"]["l1Size"]  # type: ignore[no-any-return]


def _sidecar_memory_limit(obj: dict[str, Any]) -> int | None:
    for container in all_containers(obj):
        if container["name"] == c.SIDECAR_CONTAINER:
            return parse_bytes(container["resources"]["limits"]["memory"], "memory limit")
    return None


def _converged(cluster: LocalCluster, namespace: str, desired: dict[str, Desired], policy_l1: str) -> bool:
    for name, want in desired.items():
        obj = get(cluster, "deployment", name, namespace)
        if want.enabled:
            l1 = want.l1_annotation or policy_l1
            if not is_injected(obj) or _l1_in_configmap(cluster, namespace, name) != l1:
                return False
            # The operator writes the ConfigMap before the workload: the template must carry the L1 too.
            if _sidecar_memory_limit(obj) != parse_bytes(l1, "l1Size") + OperatorDefaults.sidecar_memory_overhead_bytes:
                return False
        elif not is_clean(obj) or _l1_in_configmap(cluster, namespace, name) is not None:
            return False
    return True


def test_operator_sigkilled_at_random_points_converges_with_one_rollout_per_change(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    rng = random.Random(8)
    policy_l1 = "2Gi"
    apply(cluster, _policy(namespace, policy_l1))
    desired = {f"w{i}": Desired() for i in range(WORKLOADS)}
    for name in desired:
        apply(cluster, trtllm_deployment(name, namespace, replicas=0, annotations={c.ANN_POLICY: POLICY}))
    kills, recovery, sizes = 0, [], iter(f"{n}Gi" for n in range(3, 1000))
    for step in range(CHANGES):
        kind = rng.choice(["toggle", "toggle", "policy", "annotation"])
        name = rng.choice(sorted(desired))
        want = desired[name]
        if kind == "toggle":
            want.enabled = not want.enabled
            annotate(
                cluster, "deployment", name, namespace, f"{c.ANN_ENABLED}=true" if want.enabled else f"{c.ANN_ENABLED}-"
            )
            want.user_edits += 1
            want.intended_changes += 1
        elif kind == "policy":
            policy_l1 = next(sizes)
            apply(cluster, _policy(namespace, policy_l1))
            for other in desired.values():
                if other.enabled and other.l1_annotation is None:
                    other.intended_changes += 1
        else:
            want.l1_annotation = next(sizes)
            annotate(cluster, "deployment", name, namespace, f"{c.ANN_CPU_CACHE_SIZE}={want.l1_annotation}")
            want.user_edits += 1
            want.intended_changes += int(want.enabled)
        started = time.monotonic()
        if step % 2 == 0 or rng.random() < 0.3:
            time.sleep(rng.uniform(0.0, 1.0))
            running_operator.kill()
            kills += 1
            running_operator.start()
        wait_for(lambda l1=policy_l1: _converged(cluster, namespace, desired, l1), timeout=120, interval=0.3,
                 what=f"convergence after change {step} ({kind} {name})")  # fmt: skip
        recovery.append(time.monotonic() - started)
    time.sleep(3)  # a late duplicate apply would land now
    versions = {n: get(cluster, "deployment", n, namespace)["metadata"]["resourceVersion"] for n in desired}
    time.sleep(3)
    quiet = {n: get(cluster, "deployment", n, namespace)["metadata"]["resourceVersion"] for n in desired}
    assert quiet == versions, "converged workloads must see no more writes (a late event must not restart a removal)"
    report = []
    for name, want in desired.items():
        obj = get(cluster, "deployment", name, namespace)
        if want.enabled:
            assert_no_duplicates(obj)
        generation = obj["metadata"]["generation"]
        limit = 1 + want.user_edits + want.intended_changes
        report.append(f"{name}: generation {generation} <= {limit} (user edits {want.user_edits}, "
                      f"intended changes {want.intended_changes})")  # fmt: skip
        assert generation <= limit, report[-1]
        replica_sets = list_objects(cluster, "replicasets", namespace, f"app={name}")
        assert len(replica_sets) <= 1 + want.intended_changes, (name, len(replica_sets))
    print(f"{CHANGES} changes, {kills} SIGKILLs, max convergence {max(recovery):.1f} s, "
          f"mean {sum(recovery) / len(recovery):.1f} s; " + "; ".join(report))  # fmt: skip


def _apiserver_ready(cluster: LocalCluster) -> bool:
    out = cluster.kubectl("get", "--raw", "/readyz", check=False)
    return out.returncode == 0 and out.stdout.strip() == "ok"


def test_apiserver_restart_watches_recover_and_nothing_is_reapplied(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    for name in ("steady-a", "steady-b"):
        apply(cluster, trtllm_deployment(name, namespace, replicas=0, annotations={c.ANN_ENABLED: "true"}))
    apply(cluster, trtllm_deployment("later", namespace, replicas=0))
    for name in ("steady-a", "steady-b"):
        wait_for(
            lambda n=name: is_injected(get(cluster, "deployment", n, namespace)), timeout=60, what=f"{name} injected"
        )
    time.sleep(2)

    def snapshot() -> dict[str, tuple[Any, ...]]:
        out = {}
        for name in ("steady-a", "steady-b"):
            obj = get(cluster, "deployment", name, namespace)
            cm = get(cluster, "configmap", name + c.GENERATED_CONFIGMAP_SUFFIX, namespace)
            out[name] = (obj["metadata"]["generation"], json.dumps(obj["spec"]["template"], sort_keys=True),
                         cm["metadata"]["resourceVersion"])  # fmt: skip
        return out

    before = snapshot()
    reconciles_before = running_operator.metric_sum(c.M_OPERATOR_RECONCILES + "_total", result="applied")
    started = time.monotonic()
    cluster.restart("kube-apiserver", grace_s=10)
    wait_for(lambda: _apiserver_ready(cluster), timeout=120, interval=0.5, what="apiserver ready again")
    apiserver_back = time.monotonic() - started
    assert running_operator.popen is not None and running_operator.popen.poll() is None, "operator died"
    changed_at = time.monotonic()
    annotate(cluster, "deployment", "later", namespace, f"{c.ANN_ENABLED}=true")
    wait_for(lambda: is_injected(get(cluster, "deployment", "later", namespace)), timeout=180, interval=0.5,
             what="a change made after the apiserver restart reconciled (watches recovered)")  # fmt: skip
    reconciled_after = time.monotonic() - changed_at
    time.sleep(3)
    assert snapshot() == before, "unchanged workloads were re-applied after the restart"
    applied = running_operator.metric_sum(c.M_OPERATOR_RECONCILES + "_total", result="applied") - reconciles_before
    assert applied == 1, f"{applied} applies after the restart; only 'later' changed"
    print(f"apiserver ready again after {apiserver_back:.1f} s; change reconciled {reconciled_after:.1f} s later; "
          f"generations unchanged: {[v[0] for v in before.values()]}")  # fmt: skip
