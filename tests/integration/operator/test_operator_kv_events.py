"""KV events for routers, wired by the operator on the real apiserver: a workload whose policy turns
them on gets pods with the events port on the cache server, its env, and the connector's switch; a
workload whose policy leaves them off (the default) gets none of it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, trtllm_deployment, wait_for
from kvoffload import contract as c
from tests.support.operator_support import OperatorProcess, events_for, running_pods, wait_injected

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]
TOPIC = "kv@$(KVOFFLOAD_POD_IP):8000@llama"


def policy(name: str, namespace: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip


def injected_pod(cluster: LocalCluster, namespace: str, app: str) -> dict[str, Any]:
    pods = wait_for(lambda: [p for p in running_pods(cluster, namespace, f"app={app}")
                             if p["metadata"].get("annotations", {}).get(c.ANN_CONFIG_HASH)], timeout=120,
                    what=f"an injected {app} pod Running")  # fmt: skip
    return pods[0]  # type: ignore[no-any-return]


def container(pod: dict[str, Any], name: str) -> dict[str, Any]:
    spec = pod["spec"]
    return next(x for x in [*spec.get("initContainers", []), *spec["containers"]] if x["name"] == name)


def env_of(x: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in x.get("env", [])}


def test_a_workload_opted_into_kv_events_gets_the_events_port_and_env_and_one_without_gets_none(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    apply(cluster, policy("routed", namespace, cache={"l1Size": "1Gi"}, kvEvents={"enabled": True, "topic": TOPIC}))
    apply(cluster, policy("plain", namespace, cache={"l1Size": "1Gi"}))
    for app, name in (("routed-llm", "routed"), ("plain-llm", "plain")):
        apply(cluster, trtllm_deployment(app, namespace, annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: name}))
    for app in ("routed-llm", "plain-llm"):
        wait_injected(cluster, "deployment", app, namespace)

    routed = injected_pod(cluster, namespace, "routed-llm")
    cache = container(routed, c.SIDECAR_CONTAINER)
    assert {"name": c.KV_EVENTS_PORT_NAME, "containerPort": c.KV_EVENTS_PORT, "protocol": "TCP"} in cache["ports"]
    env = env_of(cache)
    assert env[c.ENV_KV_EVENTS_PORT] == str(c.KV_EVENTS_PORT) and env[c.ENV_KV_EVENTS_TOPIC] == TOPIC
    assert env[c.ENV_POD_IP]["fieldRef"]["fieldPath"] == "status.podIP"
    assert env_of(container(routed, "trtllm"))[c.ENV_KV_EVENTS] == "true"
    assert all(p["containerPort"] != 5557 for x in routed["spec"]["containers"] for p in x.get("ports", []))

    plain = injected_pod(cluster, namespace, "plain-llm")
    plain_cache = container(plain, c.SIDECAR_CONTAINER)
    assert c.KV_EVENTS_PORT not in {p["containerPort"] for p in plain_cache["ports"]}
    assert not {c.ENV_KV_EVENTS_PORT, c.ENV_KV_EVENTS_TOPIC, c.ENV_POD_IP} & env_of(plain_cache).keys()
    assert c.ENV_KV_EVENTS not in env_of(container(plain, "trtllm"))
    for app in ("routed-llm", "plain-llm"):
        assert not events_for(cluster, namespace, app, "KvoffloadInvalid")


def test_the_crd_refuses_a_kv_events_topic_with_a_space(
    cluster: LocalCluster, namespace: str, operator_kubeconfig: object
) -> None:
    bad = policy("bad-topic", namespace, kvEvents={"enabled": True, "topic": "kv@ pod@m"})
    out = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=json.dumps(bad), check=False)
    assert out.returncode != 0 and "kvEvents.topic" in out.stderr, out.stderr
