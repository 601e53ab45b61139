"""Node-shared mode on the real control plane with kwok GPU nodes: cache pods follow the engines.

One cache pod per node running at least one engine pod of the policy, created when the first is
scheduled there, removed when the last leaves, whatever moves the engines (scale, drain, a
mode switch, an operator that was down meanwhile). Engines reach their own node's cache only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.polling import WaitTimedOut
from hack.workloads import apply, get, list_objects, trtllm_deployment, wait_for
from kvoffload import contract as c
from kvoffload.operator.api.kube import Kube, load_configuration
from kvoffload.operator.node.caches import NodeCaches, services_path
from kvoffload.operator.plan.containers import CACHE_POD_KEY_FILES, ENGINE_KEY_FILES
from kvoffload.operator.plan.node_wiring import (
    cache_keys_secret_name,
    cache_server_url,
    cache_service_name,
    node_shm_host_path,
)
from tests.support.operator_support import (
    OperatorProcess,
    all_containers,
    annotate,
    is_injected,
    operator_defaults,
    wait_injected,
)

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]

POLICY = "shared"
NODES = ("gpu-node-0", "gpu-node-1", "gpu-node-2")


@pytest.fixture
def running_operator(node_mode_operator: OperatorProcess) -> OperatorProcess:
    """This module's operator runs with ``--node-mode true`` (restarted if a test left it stopped)."""
    if node_mode_operator.popen is None or node_mode_operator.popen.poll() is not None:
        node_mode_operator.start()
    return node_mode_operator


@pytest.fixture
def node_namespace(cluster: LocalCluster, namespace: str) -> str:
    """Node mode mounts a hostPath at /dev/shm: the namespace must allow Pod Security privileged."""
    cluster.kubectl("label", "--overwrite", "namespace", namespace,
                    "pod-security.kubernetes.io/enforce=privileged")  # fmt: skip
    return namespace


@pytest.fixture
def uncordon_all(cluster: LocalCluster) -> Iterator[None]:
    yield
    for node in NODES:
        cluster.kubectl("uncordon", node, check=False)


class WriteRecordingKube(Kube):
    """The operator's API client, recording every write (method, path) it sends."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.writes: list[tuple[str, str]] = []

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                params: Mapping[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        if method != "GET":
            self.writes.append((method, path))
        return super().request(method, path, body=body, content_type=content_type, params=params)


def node_policy(namespace: str, mode: str = "node") -> dict[str, Any]:
    return {
        "apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
        "metadata": {"name": POLICY, "namespace": namespace},
        "spec": {"mode": mode, "cache": {"l1Size": "2Gi"}},
    }  # fmt: skip


def spread_deployment(name: str, namespace: str, replicas: int, **annotations: str) -> dict[str, Any]:
    """Engines spread evenly over the GPU nodes (cordoned nodes do not count as a domain).

    Only pods of one ReplicaSet count (``matchLabelKeys: pod-template-hash``): a pod of the
    template before the operator's rollout must not skew where the new template's pods go.
    """
    dep = trtllm_deployment(name, namespace, replicas=replicas,
                            annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: POLICY, **annotations})  # fmt: skip
    dep["spec"]["template"]["spec"]["topologySpreadConstraints"] = [{
        "maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "DoNotSchedule",
        "nodeTaintsPolicy": "Honor", "labelSelector": {"matchLabels": {"app": name}},
        "matchLabelKeys": ["pod-template-hash"],
    }]  # fmt: skip
    return dep


def engine_nodes(cluster: LocalCluster, namespace: str, app: str) -> list[str]:
    """Nodes of the app's scheduled, not terminating pods wired to the node cache."""
    pods = list_objects(cluster, "pods", namespace, f"app={app},{c.LABEL_NODE_CACHE_POLICY}={POLICY}")
    return sorted({
        p["spec"]["nodeName"] for p in pods
        if p["spec"].get("nodeName") and not p["metadata"].get("deletionTimestamp")
    })  # fmt: skip


def cache_pods(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    return list_objects(cluster, "pods", namespace, f"{c.LABEL_CACHE_POLICY}={POLICY}")


def cache_nodes(cluster: LocalCluster, namespace: str) -> list[str]:
    """Node of every cache pod (duplicates kept, so a second pod on a node shows)."""
    return sorted(p["metadata"]["annotations"][c.ANN_CACHE_NODE] for p in cache_pods(cluster, namespace))


def wait_caches_follow(cluster: LocalCluster, namespace: str, app: str, count: int | None = None,
                       timeout: float = 90) -> list[str]:  # fmt: skip
    """Until exactly one cache pod, bound to that node, stands on each node with an engine pod."""

    def converged() -> list[str] | None:
        engines = engine_nodes(cluster, namespace, app)
        if count is not None and len(engines) != count:
            return None
        pods = [p for p in cache_pods(cluster, namespace) if not p["metadata"].get("deletionTimestamp")]
        if len(pods) != len(cache_pods(cluster, namespace)):
            return None  # one still terminating
        bound = sorted(p["spec"].get("nodeName", "") for p in pods)
        if bound == engines and cache_nodes(cluster, namespace) == engines:
            return engines
        return None

    try:
        return wait_for(converged, timeout=timeout, interval=1, what=f"one cache pod per engine node of {app}")  # type: ignore[no-any-return]
    except WaitTimedOut as exc:
        engines = list_objects(cluster, "pods", namespace, f"app={app}")
        seen = [(p["metadata"]["name"], p["spec"].get("nodeName"), (p.get("status") or {}).get("phase"),
                 bool(p["metadata"].get("deletionTimestamp"))) for p in engines + cache_pods(cluster, namespace)]  # fmt: skip
        raise WaitTimedOut(f"{exc}; pods (name, node, phase, terminating): {seen}") from exc


def test_five_replicas_over_three_nodes_get_exactly_three_cache_pods_reachable_only_locally(
    cluster: LocalCluster, node_namespace: str, running_operator: OperatorProcess
) -> None:
    ns = node_namespace
    apply(cluster, node_policy(ns))
    apply(cluster, spread_deployment("llm", ns, replicas=5))
    dep = wait_for(lambda: (d := get(cluster, "deployment", "llm", ns)) and c.ANN_CONFIG_HASH in
                   (d["spec"]["template"]["metadata"].get("annotations") or {}) and d, what="llm injected")  # fmt: skip
    assert not is_injected(dep), "node mode adds no sidecar"
    spec = dep["spec"]["template"]["spec"]
    assert {x["name"] for x in all_containers(dep)} == {"trtllm", c.BUNDLE_INIT_CONTAINER}
    shm = next(v for v in spec["volumes"] if v["name"] == c.VOLUME_SHM)
    assert shm["hostPath"] == {"path": node_shm_host_path(ns, POLICY), "type": "DirectoryOrCreate"}
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env[c.ENV_SERVER_URL] == cache_server_url(ns, POLICY)
    assert dep["spec"]["template"]["metadata"]["labels"][c.LABEL_NODE_CACHE_POLICY] == POLICY

    nodes = wait_caches_follow(cluster, ns, "llm", count=3)
    assert nodes == list(NODES)
    for pod in cache_pods(cluster, ns):
        owner = pod["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"]) == (c.POLICY_KIND, POLICY)
        (container,) = pod["spec"]["containers"]
        assert container["command"] == ["kvoffload-sidecar"] and "resources" in container
        assert {p["name"] for p in container["ports"]} == {c.SIDECAR_PORT_NAME, c.REQUEST_PORT_NAME}
        assert pod["spec"]["volumes"][0]["hostPath"]["path"] == node_shm_host_path(ns, POLICY)

    # The policy status lists each node's cache pod and its readiness.
    status = wait_for(
        lambda: (s := get(cluster, "kvcachepolicy", POLICY, ns).get("status") or {})
        and [r["node"] for r in s.get("nodeCaches") or [] if r["ready"]] == list(NODES) and s,
        timeout=60, what="policy status lists 3 ready node caches",
    )  # fmt: skip
    assert {r["pod"] for r in status["nodeCaches"]} == {p["metadata"]["name"] for p in cache_pods(cluster, ns)}

    # Reaching the cache: a node-local Service; each node has exactly one endpoint, its own cache pod.
    svc = get(cluster, "service", cache_service_name(POLICY), ns)
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["spec"]["selector"] == {c.LABEL_COMPONENT: c.COMPONENT_NODE_CACHE, c.LABEL_CACHE_POLICY: POLICY}
    pod_node = {p["metadata"]["name"]: p["spec"]["nodeName"] for p in cache_pods(cluster, ns)}

    def endpoints_per_node() -> dict[str, list[str]] | None:
        slices = list_objects(cluster, "endpointslices", ns, f"kubernetes.io/service-name={svc['metadata']['name']}")
        per_node: dict[str, list[str]] = {}
        for item in slices:
            for ep in item.get("endpoints") or []:
                per_node.setdefault(ep.get("nodeName", ""), []).append(ep["targetRef"]["name"])
        return per_node if sorted(per_node) == list(NODES) else None

    netpol = get(cluster, "networkpolicy", cache_service_name(POLICY), ns)
    assert netpol["spec"]["podSelector"]["matchLabels"] == svc["spec"]["selector"]
    assert netpol["spec"]["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": {c.LABEL_NODE_CACHE_POLICY: POLICY}}}
    ]
    assert netpol["metadata"]["ownerReferences"][0]["name"] == POLICY  # goes with the policy
    # The policy's CURVE keys: one Secret the operator created (it cannot read it back), owned by
    # the policy; the engines mount its client files, the cache pods its server files.
    keys = get(cluster, "secret", cache_keys_secret_name(POLICY), ns)
    assert sorted(keys["data"]) == sorted([*ENGINE_KEY_FILES, c.CACHE_KEY_SERVER_SECRET])
    assert keys["metadata"]["ownerReferences"][0]["name"] == POLICY
    engine_keys = next(v for v in spec["volumes"] if v["name"] == c.VOLUME_CACHE_KEYS)["secret"]
    assert engine_keys["secretName"] == cache_keys_secret_name(POLICY)
    assert [i["key"] for i in engine_keys["items"]] == list(ENGINE_KEY_FILES)
    for pod in cache_pods(cluster, ns):
        cache_keys = next(v for v in pod["spec"]["volumes"] if v["name"] == c.VOLUME_CACHE_KEYS)["secret"]
        assert [i["key"] for i in cache_keys["items"]] == list(CACHE_POD_KEY_FILES)

    per_node = wait_for(endpoints_per_node, timeout=60, what="an endpoint on every node")
    for node, targets in per_node.items():
        assert len(targets) == 1 and pod_node[targets[0]] == node, per_node

    # A converged pass only reads; a Service deleted meanwhile comes back on the next pass. The
    # passes here are the operator's own code and credentials, with the process stopped so that
    # they are the only ones (the fixture restarts it for the next test).
    running_operator.stop()
    kube = WriteRecordingKube(load_configuration(str(running_operator.kubeconfig)))
    caches = NodeCaches(kube, operator_defaults())
    assert caches.sync(ns, POLICY) is False
    assert kube.writes == [], "a pass over converged node caches sends no write"
    cluster.kubectl("delete", "service", cache_service_name(POLICY), "-n", ns)
    caches.sync(ns, POLICY)
    assert kube.writes == [("PATCH", services_path(ns, cache_service_name(POLICY)))]
    assert get(cluster, "service", cache_service_name(POLICY), ns)["spec"]["selector"] == svc["spec"]["selector"]


def test_cache_pods_follow_scale_down_drain_and_operator_restart(
    cluster: LocalCluster, node_namespace: str, running_operator: OperatorProcess, uncordon_all: None
) -> None:
    ns = node_namespace
    apply(cluster, node_policy(ns))
    apply(cluster, spread_deployment("llm", ns, replicas=5))
    assert wait_caches_follow(cluster, ns, "llm", count=3) == list(NODES)
    cluster.kubectl("rollout", "status", "deployment/llm", "-n", ns, "--timeout=120s")  # the operator's rollout

    # Scale down: two pods cover at most two nodes; the third node's cache pod goes.
    cluster.kubectl("scale", "deployment/llm", "-n", ns, "--replicas=2")
    remaining = wait_caches_follow(cluster, ns, "llm", count=2)
    assert len(remaining) == 2

    # Cordon and drain a node with engines: they move, and the cache pod moves with them.
    cluster.kubectl("scale", "deployment/llm", "-n", ns, "--replicas=3")
    assert wait_caches_follow(cluster, ns, "llm", count=3) == list(NODES)
    drained = NODES[0]
    cluster.kubectl("drain", drained, "--ignore-daemonsets", "--delete-emptydir-data", "--force",
                    "--timeout=120s")  # fmt: skip
    after_drain = wait_caches_follow(cluster, ns, "llm", count=2)
    assert drained not in after_drain
    assert len(list_objects(cluster, "pods", ns, "app=llm")) >= 3  # rescheduled on the other nodes
    cluster.kubectl("uncordon", drained)

    # Operator down while engines move; an orphan appears; on restart: no duplicate, no orphan.
    running_operator.stop()
    orphan = json.loads(json.dumps(cache_pods(cluster, ns)[0]))
    for key in ("uid", "resourceVersion", "creationTimestamp", "managedFields"):
        orphan["metadata"].pop(key, None)
    orphan.pop("status", None)
    orphan["metadata"]["name"] = f"{POLICY}-cache-stale"
    orphan["metadata"]["annotations"][c.ANN_CACHE_NODE] = drained
    orphan["spec"].pop("nodeName", None)
    orphan["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"][0]["matchFields"][0]["values"] = [drained]  # fmt: skip
    apply(cluster, orphan)
    cluster.kubectl("scale", "deployment/llm", "-n", ns, "--replicas=1")
    wait_for(lambda: len(list_objects(cluster, "pods", ns, "app=llm")) == 1, timeout=60, what="one engine pod left")
    running_operator.start()
    final = wait_caches_follow(cluster, ns, "llm", count=1)
    assert cache_nodes(cluster, ns) == final
    assert all(p["metadata"]["name"] != f"{POLICY}-cache-stale" for p in cache_pods(cluster, ns))

    # The last engine leaves: no cache pod remains.
    cluster.kubectl("scale", "deployment/llm", "-n", ns, "--replicas=0")
    wait_for(lambda: not cache_pods(cluster, ns), timeout=180, what="no cache pod once no engine runs")


def test_switch_sidecar_to_node_and_back_rolls_once_each(
    cluster: LocalCluster, node_namespace: str, running_operator: OperatorProcess
) -> None:
    ns = node_namespace
    apply(cluster, node_policy(ns, mode="sidecar"))
    apply(cluster, spread_deployment("llm", ns, replicas=2))
    dep = wait_injected(cluster, "deployment", "llm", ns)
    assert not cache_pods(cluster, ns)

    def rolled_once(before: dict[str, Any], check: Any, what: str) -> dict[str, Any]:
        return wait_for(  # type: ignore[no-any-return]
            lambda: (d := get(cluster, "deployment", "llm", ns))
            and d["metadata"]["generation"] == before["metadata"]["generation"] + 1 and check(d) and d,
            what=what,
        )  # fmt: skip

    def node_wired(d: dict[str, Any]) -> bool:
        labels = d["spec"]["template"]["metadata"].get("labels") or {}
        return labels.get(c.LABEL_NODE_CACHE_POLICY) == POLICY and not is_injected(d)

    before = annotate(cluster, "deployment", "llm", ns, f"{c.ANN_MODE}=node")
    to_node = rolled_once(before, node_wired, "one rollout to node mode")
    assert to_node["spec"]["template"]["spec"].get("shareProcessNamespace") is None
    nodes = wait_caches_follow(cluster, ns, "llm", count=2)
    assert len(nodes) == 2
    wait_for(lambda: get(cluster, "deployment", "llm", ns)["status"].get("updatedReplicas") == 2, what="rolled")

    before = annotate(cluster, "deployment", "llm", ns, f"{c.ANN_MODE}=sidecar")
    back = rolled_once(before, is_injected, "one rollout back to sidecar mode")
    assert c.LABEL_NODE_CACHE_POLICY not in (back["spec"]["template"]["metadata"].get("labels") or {})
    assert template_shm_is_empty_dir(back)

    def leftovers() -> dict[str, list[str]]:
        left = {"engine nodes": engine_nodes(cluster, ns, "llm"), "cache pods": cache_nodes(cluster, ns)}
        print("left:", left)  # shown on failure
        return left

    wait_for(lambda: leftovers() == {"engine nodes": [], "cache pods": []}, timeout=180,
             what="no node-mode engine and no cache pod left")  # fmt: skip
    assert get(cluster, "deployment", "llm", ns)["metadata"]["generation"] == back["metadata"]["generation"]
    assert dep["metadata"]["name"] == "llm"


def template_shm_is_empty_dir(dep: dict[str, Any]) -> bool:
    shm = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == c.VOLUME_SHM)
    return "emptyDir" in shm and "hostPath" not in shm


def test_cache_pods_refused_by_a_pod_quota_are_created_once_it_is_lifted(
    cluster: LocalCluster, node_namespace: str, running_operator: OperatorProcess
) -> None:
    ns = node_namespace
    apply(cluster, node_policy(ns))
    apply(cluster, spread_deployment("llm", ns, replicas=0))  # injected before any pod exists: no rollout
    wait_for(lambda: c.ANN_CONFIG_HASH in (get(cluster, "deployment", "llm", ns)["spec"]["template"]["metadata"]
                                           .get("annotations") or {}), what="llm injected")  # fmt: skip
    apply(cluster, {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "pods", "namespace": ns},
                    "spec": {"hard": {"pods": "2"}}})  # fmt: skip
    wait_for(lambda: "pods" in ((get(cluster, "resourcequota", "pods", ns).get("status") or {}).get("used") or {}),
             what="quota usage of pods")  # fmt: skip
    cluster.kubectl("scale", "deployment/llm", "-n", ns, "--replicas=2")
    # Both engines fit the quota; their node caches do not.
    wait_for(lambda: len(engine_nodes(cluster, ns, "llm")) == 2, what="two engines scheduled")
    wait_for(lambda: running_operator.metric_sum(c.M_OPERATOR_RETRY_QUEUE) >= 1 and "exceeded quota"
             in running_operator.log(), what="the refused cache pods queued for a retry")  # fmt: skip
    assert cache_pods(cluster, ns) == []
    cluster.kubectl("delete", "resourcequota", "pods", "-n", ns)
    assert len(wait_caches_follow(cluster, ns, "llm", count=2, timeout=60)) == 2
    wait_for(lambda: running_operator.metric_sum(c.M_OPERATOR_RETRY_QUEUE) == 0, what="the retry queue drained")
