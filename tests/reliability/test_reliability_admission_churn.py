"""Admission mode under churn on the real control plane, every eviction counted from the
apiserver's audit log: a seeded random series of policy changes, ``kubectl rollout undo``, operator
SIGKILLs and pods deleted at random, over an opted-in workload guarded by a PodDisruptionBudget,
an opted-in one without, one whose setting the webhook refuses and one that carries the label
without the opt-in. Pods of the last two are never evicted, no pod is evicted twice, every
eviction is of a pod that really ran uninjected (so evictions <= pods admitted uninjected), no
workload ever has more than one pod unavailable besides the one the test deleted (sampled
throughout the churn), and every workload converges at the end.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, list_objects, wait_for
from kvoffload import contract as c
from tests.support.audit import OPERATOR_USER, AuditWindow
from tests.support.cluster_operator_fixtures import admission_operator_instead
from tests.support.operator_support import OperatorProcess
from tests.support.operator_support import gitops_manifest as manifest
from tests.support.scale import count

pytestmark = [pytest.mark.reliability, pytest.mark.controlplane, pytest.mark.timeout(count(ci=900, soak=2400))]
CHURN_S = count(ci=90, soak=600)
OPTED_IN = ("guarded", "tuned")
REPLICAS = 2
NEVER_EVICTED = ("refused", "copied")


@pytest.fixture(scope="module")
def admission_operator(
    cluster: LocalCluster, operator: OperatorProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    with admission_operator_instead(
        cluster, operator, tmp_path_factory.mktemp("admission-churn"), "kvoffload-operator-churn"
    ) as proc:
        yield proc


def workloads(namespace: str) -> list[dict[str, Any]]:
    guarded = manifest("guarded", namespace, "trtllm:1.2.0", opted_in=True)
    tuned = manifest("tuned", namespace, "trtllm:1.2.0", opted_in=True)
    tuned["metadata"]["annotations"][c.ANN_POLICY] = "churn"
    refused = manifest("refused", namespace, "trtllm:1.2.0", opted_in=True)
    refused["spec"]["template"]["spec"]["containers"][0]["env"] = [{"name": "PYTHONPATH", "value": "/app/lib"}]
    copied = manifest("copied", namespace, "trtllm:1.2.0", opted_in=False)
    copied["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT] = "0123456789abcdef"
    return [guarded, tuned, refused, copied]


def policy(namespace: str, l1: str) -> dict[str, Any]:
    return {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
            "metadata": {"name": "churn", "namespace": namespace}, "spec": {"cache": {"l1Size": l1}}}  # fmt: skip


class PodSampler:
    """Lists the namespace's pods every 0.3 s: which pods ran without the injection, and the most
    pods of one workload unavailable at once beyond what the test's own deletes took.

    A pod is available when it is Ready and not terminating; a workload's unavailable pods are its
    replicas minus its available pods (a rollout's surge pod starting is not one of them). The test
    deletes a pod only from a whole workload and marks it disrupted until a list started after the
    delete shows it whole again; meanwhile one unavailable pod is the test's."""

    def __init__(self, cluster: LocalCluster, namespace: str) -> None:
        self.cluster, self.namespace = cluster, namespace
        self.seen_uninjected: set[str] = set()
        self.disrupted: dict[str, float] = {}
        """Workload -> when the test deleted one of its pods (cleared once it is whole again)."""
        self.worst: dict[str, tuple[int, int]] = {}
        """Workload -> (most unavailable pods seen not counting the test's delete, samples)."""
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(0.3):
            listed_at = time.monotonic()
            found = list_objects(self.cluster, "pods", self.namespace)
            for pod in found:
                if pod["metadata"].get("labels", {}).get(c.LABEL_INJECTED) != "true":
                    self.seen_uninjected.add(pod["metadata"]["name"])
            for name in (*OPTED_IN, *NEVER_EVICTED):
                ours = [p for p in found if p["metadata"].get("labels", {}).get("app") == name]
                unavailable = REPLICAS - len([p for p in ours if available(p)])
                with self.lock:
                    if unavailable <= 0 and self.disrupted.get(name, listed_at) < listed_at:
                        del self.disrupted[name]
                    beyond = unavailable - (1 if name in self.disrupted else 0)
                    worst, samples = self.worst.get(name, (0, 0))
                    self.worst[name] = (max(worst, beyond), samples + 1)

    def whole(self) -> list[str]:
        """Workloads no delete of the test is disrupting now."""
        with self.lock:
            return [n for n in (*OPTED_IN, *NEVER_EVICTED) if n not in self.disrupted]

    def deleting(self, name: str) -> None:
        with self.lock:
            self.disrupted[name] = time.monotonic()


def available(pod: dict[str, Any]) -> bool:
    conditions = pod.get("status", {}).get("conditions", [])
    ready = any(x.get("type") == "Ready" and x.get("status") == "True" for x in conditions)
    return ready and not pod["metadata"].get("deletionTimestamp")


def converged(cluster: LocalCluster, namespace: str) -> bool | str:
    """True once every workload runs 2 pods, the opted-in ones all injected from their template's
    record and the others all plain; else the first that does not (for the timeout's message)."""
    for body in workloads(namespace):
        name = body["metadata"]["name"]
        dep = json.loads(cluster.kubectl("get", "deployment", name, "-n", namespace, "-o", "json").stdout)
        label = dep["spec"]["template"]["metadata"]["labels"].get(c.LABEL_INJECT)
        found = [p for p in list_objects(cluster, "pods", namespace, f"app={name}")
                 if not p["metadata"].get("deletionTimestamp")]  # fmt: skip
        if len(found) != 2 or any(p.get("status", {}).get("phase") != "Running" for p in found):
            return f"{name}: {len(found)} pods, phases {[p.get('status', {}).get('phase') for p in found]}"
        injected = [label is not None and p["metadata"].get("annotations", {}).get(c.ANN_INJECTED_FROM) == label
                    for p in found]  # fmt: skip
        if all(injected) != (name in OPTED_IN) or any(injected) != (name in OPTED_IN):
            return f"{name}: injected from {label}: {injected}"
    return True


def delete_a_pod(cluster: LocalCluster, namespace: str, rng: random.Random, sampler: PodSampler) -> None:
    """Delete one pod of a workload the test is not disrupting already, at random."""
    candidates = sampler.whole()
    if not candidates:
        return
    name = rng.choice(candidates)
    found = [p for p in list_objects(cluster, "pods", namespace, f"app={name}") if available(p)]
    if len(found) == REPLICAS:
        sampler.deleting(name)
        victim = rng.choice(found)["metadata"]["name"]
        cluster.kubectl("delete", "pod", victim, "-n", namespace, "--wait=false", check=False)


def wait_converged(cluster: LocalCluster, namespace: str, timeout: float, what: str) -> None:
    last: list[bool | str] = []
    try:
        wait_for(lambda: last.append(converged(cluster, namespace)) or last[-1] is True, timeout, what=what)
    except Exception as exc:
        raise AssertionError(f"{exc}; last: {last[-1] if last else None}") from None


def test_admission_churn_never_evicts_wrongly_and_converges(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    rng = random.Random(33)
    apply(cluster, policy(namespace, "4Gi"))
    for body in workloads(namespace):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    apply(cluster, {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
                    "metadata": {"name": "guarded", "namespace": namespace},
                    "spec": {"minAvailable": 2, "selector": {"matchLabels": {"app": "guarded"}}}})  # fmt: skip
    wait_converged(cluster, namespace, 120, "the workloads settled")
    audit = AuditWindow(cluster.audit_log).mark()
    sampler = PodSampler(cluster, namespace)
    sampler.thread.start()
    done: list[str] = []
    sizes = iter(["5Gi", "6Gi", "4Gi"] * 100)
    deadline = time.monotonic() + CHURN_S
    try:
        while time.monotonic() < deadline:
            action = rng.choice(["policy", "undo", "kill", "delete", "delete"])
            if action == "policy":
                apply(cluster, policy(namespace, next(sizes)))
            elif action == "undo":
                cluster.kubectl("rollout", "undo", "deployment/tuned", "-n", namespace, check=False)
            elif action == "kill":  # a pod deleted while no webhook answers comes back uninjected
                admission_operator.kill()
                delete_a_pod(cluster, namespace, rng, sampler)
                time.sleep(rng.uniform(1, 4))
                admission_operator.start()
            else:
                delete_a_pod(cluster, namespace, rng, sampler)
            done.append(action)
            time.sleep(rng.uniform(2, 5))
        cluster.kubectl("delete", "pdb", "guarded", "-n", namespace)
        wait_converged(cluster, namespace, 240, "every workload converged after the churn")
    finally:
        sampler.stop.set()
        sampler.thread.join(timeout=10)
    tries = [(w.name, w.code) for w in audit.writes(OPERATOR_USER, namespace) if w.resource == "pods/eviction"]
    evicted = [pod for pod, code in tries if code == 201]
    print(f"admission churn {CHURN_S} s, actions {dict((a, done.count(a)) for a in set(done))}: eviction calls "
          f"{len(tries)} ({len(evicted)} evicted, {sum(1 for _, code in tries if code == 429)} refused by the "
          f"budget), pods seen running uninjected {len(sampler.seen_uninjected)}, most pods of one workload "
          f"unavailable at once beyond the test's own delete (worst, samples): {sampler.worst}")  # fmt: skip
    assert not [p for p, _ in tries if p.startswith(NEVER_EVICTED)], tries
    assert len(evicted) == len(set(evicted)), f"a pod evicted twice: {tries}"
    unseen = [p for p in evicted if p not in sampler.seen_uninjected]
    assert not unseen, f"evicted pods never seen uninjected: {unseen}"
    admitted_plain = [p for p in sampler.seen_uninjected if p.startswith(OPTED_IN)]
    assert len(evicted) <= len(admitted_plain), (evicted, admitted_plain)
    assert all(worst <= 1 for worst, _ in sampler.worst.values()), f"unavailable at once: {sampler.worst}"
