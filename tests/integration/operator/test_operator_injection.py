"""Annotate a TensorRT-LLM workload: it gets the sidecar; remove the annotation: it is as before."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hack.localcluster import LocalCluster
from hack.workloads import apply, get, list_objects, trtllm_container, trtllm_deployment, wait_for
from kvoffload import contract as c
from tests.support.operator_support import (
    SIDECAR_IMAGE,
    OperatorProcess,
    all_containers,
    annotate,
    events_for,
    is_injected,
    running_pods,
    server_side_apply,
    template,
    wait_clean,
    wait_injected,
)

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]


def test_annotated_deployment_gets_sidecar_volumes_env_configmap_and_running_pods(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    apply(cluster, trtllm_deployment("llama", namespace))
    original = get(cluster, "deployment", "llama", namespace)
    annotate(cluster, "deployment", "llama", namespace, f"{c.ANN_ENABLED}=true")

    dep = wait_injected(cluster, "deployment", "llama", namespace)
    spec = dep["spec"]["template"]["spec"]
    sidecar = next(x for x in spec["initContainers"] if x["name"] == c.SIDECAR_CONTAINER)
    assert sidecar["restartPolicy"] == "Always"  # native sidecar on 1.36
    assert sidecar["image"] == SIDECAR_IMAGE
    assert sidecar["command"] == ["kvoffload-sidecar"]
    assert sidecar["startupProbe"]["httpGet"]["path"] == c.PATH_STARTUP
    assert sidecar["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert "nvidia.com/gpu" not in json.dumps(sidecar["resources"])
    assert [x["name"] for x in spec["initContainers"]].count(c.BUNDLE_INIT_CONTAINER) == 1
    assert spec["shareProcessNamespace"] is True
    shm = next(v for v in spec["volumes"] if v["name"] == c.VOLUME_SHM)
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "5Gi"}  # 4Gi L1 + 1Gi for the engine
    engine = next(x for x in spec["containers"] if x["name"] == "trtllm")
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env[c.ENV_SERVER_URL] == c.server_url()
    assert env[c.ENV_PYTHONHASHSEED] == "0"
    assert env[c.ENV_PYTHONPATH] == c.BUNDLE_PYTHONPATH
    assert {m["mountPath"] for m in engine["volumeMounts"]} >= {c.SHM_MOUNT_PATH, c.RUN_MOUNT_PATH,
                                                                c.TRTLLM_OPTIONS_MOUNT_PATH}  # fmt: skip
    assert engine["args"][-2:] == ["--extra_llm_api_options", f"{c.TRTLLM_OPTIONS_MOUNT_PATH}/{c.TRTLLM_OPTIONS_FILE}"]
    assert engine["args"][:-2] == original["spec"]["template"]["spec"]["containers"][0]["args"]
    # No kopf bookkeeping on the user's object.
    assert not [k for k in dep["metadata"].get("annotations", {}) if "kopf" in k]
    assert not dep["metadata"].get("finalizers")

    cm = get(cluster, "configmap", "llama" + c.GENERATED_CONFIGMAP_SUFFIX, namespace)
    assert cm["metadata"]["ownerReferences"][0]["uid"] == dep["metadata"]["uid"]
    assert "kvoffload.connector.trtllm" in cm["data"][c.TRTLLM_OPTIONS_FILE]
    assert json.loads(cm["data"][c.POLICY_FILE])["cache"]["l1Size"] == "4Gi"

    # The apiserver admitted the pods (Pod Security baseline is enforced) and kwok runs them.
    pods = wait_for(lambda: [p for p in running_pods(cluster, namespace, "app=llama")
                             if p["metadata"].get("annotations", {}).get(c.ANN_CONFIG_HASH)], timeout=120,
                    what="an injected pod Running")  # fmt: skip
    assert {x["name"] for x in pods[0]["spec"]["initContainers"]} >= {c.SIDECAR_CONTAINER}
    assert not events_for(cluster, namespace, "llama", "KvoffloadInvalid")


def test_reconciling_unchanged_input_never_bumps_generation(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    apply(cluster, trtllm_deployment("steady", namespace, replicas=0))
    annotate(cluster, "deployment", "steady", namespace, f"{c.ANN_ENABLED}=true")
    dep = wait_injected(cluster, "deployment", "steady", namespace)

    # A kvoffload.io/ annotation that changes nothing forces a full reconcile (and an apply).
    before = running_operator.metric_sum(c.M_OPERATOR_RECONCILES + "_total", result="unchanged")
    generation = annotate(cluster, "deployment", "steady", namespace, "kvoffload.io/touch=1")["metadata"]["generation"]
    wait_for(lambda: running_operator.metric_sum(c.M_OPERATOR_RECONCILES + "_total", result="unchanged") > before,
             what="an unchanged reconcile")  # fmt: skip
    # A restarted operator (empty cache) re-applies everything: still nothing changes.
    running_operator.stop()
    running_operator.start()
    wait_for(lambda: running_operator.metric_sum(c.M_OPERATOR_RECONCILES + "_total", result="unchanged") >= 1,
             what="the restarted operator reconciling")  # fmt: skip
    after = get(cluster, "deployment", "steady", namespace)
    assert after["metadata"]["generation"] == generation
    assert template(after) == template(dep)


@pytest.mark.parametrize("how", ["remove", "false"])
def test_removal_restores_the_original_template(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess, how: str
) -> None:
    apply(cluster, trtllm_deployment("roundtrip", namespace, replicas=0))
    original = get(cluster, "deployment", "roundtrip", namespace)
    annotate(cluster, "deployment", "roundtrip", namespace, f"{c.ANN_ENABLED}=true")
    wait_injected(cluster, "deployment", "roundtrip", namespace)

    if how == "remove":
        removed = annotate(cluster, "deployment", "roundtrip", namespace, f"{c.ANN_ENABLED}-")
    else:
        removed = annotate(cluster, "deployment", "roundtrip", namespace, f"{c.ANN_ENABLED}=false")
    restored = wait_clean(cluster, "deployment", "roundtrip", namespace)
    assert template(restored) == template(original)
    wait_for(lambda: cluster.kubectl("get", "configmap", "roundtrip" + c.GENERATED_CONFIGMAP_SUFFIX, "-n", namespace,
                                     check=False).returncode != 0, what="the generated ConfigMap deleted")  # fmt: skip
    # Removal is one template change (the annotation edit itself counts once for a Deployment).
    assert restored["metadata"]["generation"] == removed["metadata"]["generation"] + 1


def test_user_edits_to_their_containers_survive_injection_and_removal(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    manifest = trtllm_deployment("edited", namespace, replicas=0)
    apply(cluster, manifest)
    annotate(cluster, "deployment", "edited", namespace, f"{c.ANN_ENABLED}=true")
    wait_injected(cluster, "deployment", "edited", namespace)

    # The user edits their own container the way they always do: kubectl apply of their manifest.
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    container["image"] = container["image"].replace("rc26", "rc27")
    container["env"] = [{"name": "HF_HOME", "value": "/models"}]
    container["args"] = [*container["args"], "--max_batch_size", "8"]
    manifest["metadata"]["annotations"] = {c.ANN_ENABLED: "true"}
    apply(cluster, manifest)

    def edited_and_injected() -> dict | None:
        dep = get(cluster, "deployment", "edited", namespace)
        engine = next(x for x in dep["spec"]["template"]["spec"]["containers"] if x["name"] == "trtllm")
        env = {e["name"] for e in engine.get("env", [])}
        ok = (is_injected(dep) and engine["image"].endswith("rc27") and "HF_HOME" in env
              and c.ENV_SERVER_URL in env and "--max_batch_size" in engine["args"]
              and engine["args"][-2] == "--extra_llm_api_options")  # fmt: skip
        return dep if ok else None

    wait_for(edited_and_injected, what="the user's edit and the injection side by side")
    # The user's view of the workload, without the operator: what removal must give back.
    expected = trtllm_deployment("edited", namespace, replicas=0)
    expected["spec"]["template"]["spec"]["containers"] = [container]
    cluster.kubectl("annotate", "deployment", "edited", "-n", namespace, f"{c.ANN_ENABLED}-")
    restored = wait_clean(cluster, "deployment", "edited", namespace)
    engine = restored["spec"]["template"]["spec"]["containers"][0]
    assert engine["image"].endswith("rc27")
    assert engine["env"] == [{"name": "HF_HOME", "value": "/models"}]
    assert engine["args"] == container["args"]
    assert [x["name"] for x in all_containers(restored)] == ["trtllm"]


def test_a_field_owned_by_another_manager_is_reported_as_a_conflict_and_not_clobbered(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    apply(cluster, trtllm_deployment("contested", namespace, replicas=0))
    # Another controller owns the template label the operator stamps, with another value.
    server_side_apply(cluster, "other-controller", {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "contested", "namespace": namespace},
        "spec": {"template": {"metadata": {"labels": {c.LABEL_INJECTED: "no"}}}},
    })  # fmt: skip
    before = get(cluster, "deployment", "contested", namespace)
    errors = running_operator.metric_sum(c.M_OPERATOR_ERRORS + "_total", reason="conflict")
    annotate(cluster, "deployment", "contested", namespace, f"{c.ANN_ENABLED}=true")

    event = wait_for(lambda: events_for(cluster, namespace, "contested", "KvoffloadConflict"),
                     what="a KvoffloadConflict Warning")[0]  # fmt: skip
    assert event["type"] == "Warning"
    assert "other-controller" in event["message"] and c.LABEL_INJECTED in event["message"]
    assert running_operator.metric_sum(c.M_OPERATOR_ERRORS + "_total", reason="conflict") > errors
    after = get(cluster, "deployment", "contested", namespace)
    assert after["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECTED] == "no"
    assert template(after) == template(before)
    assert not is_injected(after)


def test_bad_annotation_gets_a_warning_and_leaves_the_last_good_state(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    apply(cluster, trtllm_deployment("typo", namespace, replicas=0))
    annotate(cluster, "deployment", "typo", namespace, f"{c.ANN_ENABLED}=true")
    good = wait_injected(cluster, "deployment", "typo", namespace)
    annotate(cluster, "deployment", "typo", namespace, f"{c.ANN_CPU_CACHE_SIZE}=lots")
    event = wait_for(lambda: events_for(cluster, namespace, "typo", "KvoffloadInvalid"), what="a Warning")[0]
    assert c.ANN_CPU_CACHE_SIZE in event["message"] and "'lots'" in event["message"] and "Gi" in event["message"]
    annotate(cluster, "deployment", "typo", namespace, f"{c.ANN_POLICY}=does-not-exist")
    wait_for(lambda: [e for e in events_for(cluster, namespace, "typo", "KvoffloadInvalid")
                      if c.ANN_CPU_CACHE_SIZE in e["message"] or "does-not-exist" in e["message"]],
             what="a second Warning")  # fmt: skip
    time.sleep(1)
    assert template(get(cluster, "deployment", "typo", namespace)) == template(good)
    assert running_operator.popen is not None and running_operator.popen.poll() is None


def test_statefulset_is_injected_and_restored(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    sts = {
        "apiVersion": "apps/v1", "kind": "StatefulSet",
        "metadata": {"name": "llama-sts", "namespace": namespace},
        "spec": {
            "replicas": 1, "serviceName": "llama-sts", "selector": {"matchLabels": {"app": "llama-sts"}},
            "template": {"metadata": {"labels": {"app": "llama-sts"}}, "spec": {"containers": [trtllm_container()]}},
        },
    }  # fmt: skip
    apply(cluster, sts)
    original = get(cluster, "statefulset", "llama-sts", namespace)
    annotate(cluster, "statefulset", "llama-sts", namespace, f"{c.ANN_ENABLED}=true")
    wait_injected(cluster, "statefulset", "llama-sts", namespace)
    wait_for(lambda: [p for p in running_pods(cluster, namespace, "app=llama-sts")
                      if any(x["name"] == c.SIDECAR_CONTAINER for x in p["spec"].get("initContainers", []))],
             timeout=120, what="an injected StatefulSet pod Running")  # fmt: skip
    cluster.kubectl("annotate", "statefulset", "llama-sts", "-n", namespace, f"{c.ANN_ENABLED}-")
    restored = wait_clean(cluster, "statefulset", "llama-sts", namespace)
    assert template(restored) == template(original)


def test_operator_service_account_cannot_read_secrets_or_exec(cluster: LocalCluster, operator_kubeconfig) -> None:  # type: ignore[no-untyped-def]
    # "pods/exec" would mean the pod named exec: the subresource needs --subresource.
    for verb, resource, *sub in (("get", "secrets"), ("list", "secrets"), ("create", "pods", "--subresource=exec"),
                                 ("patch", "nodes")):  # fmt: skip
        answer = cluster.kubectl("auth", "can-i", verb, resource, *sub, "-A", kubeconfig=operator_kubeconfig,
                                 check=False)  # fmt: skip
        assert answer.stdout.strip() == "no", (verb, resource, sub)
    assert list_objects  # keep the import used


def test_options_file_from_a_configmap_is_merged_and_the_original_path_restored(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "llm-options", "namespace": namespace},
                    "data": {"extra.yaml": "max_batch_size: 8\n"}})  # fmt: skip
    engine = trtllm_container(options_file="/config/extra.yaml")
    engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config"}]
    apply(cluster, trtllm_deployment("opts", namespace, replicas=0, containers=[engine],
                                     volumes=[{"name": "cfg", "configMap": {"name": "llm-options"}}]))  # fmt: skip
    original = get(cluster, "deployment", "opts", namespace)
    annotate(cluster, "deployment", "opts", namespace, f"{c.ANN_ENABLED}=true")

    dep = wait_injected(cluster, "deployment", "opts", namespace)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--extra_llm_api_options") + 1] == f"{c.TRTLLM_OPTIONS_MOUNT_PATH}/{c.TRTLLM_OPTIONS_FILE}"
    assert dep["spec"]["template"]["metadata"]["annotations"][c.ANN_ORIGINAL_OPTIONS_PATH] == "/config/extra.yaml"
    merged = get(cluster, "configmap", "opts" + c.GENERATED_CONFIGMAP_SUFFIX, namespace)["data"][c.TRTLLM_OPTIONS_FILE]
    assert "max_batch_size: 8" in merged and c.CONNECTOR_MODULE in merged and "enable_block_reuse: true" in merged

    annotate(cluster, "deployment", "opts", namespace, f"{c.ANN_ENABLED}-")
    restored = wait_clean(cluster, "deployment", "opts", namespace)
    assert template(restored) == template(original)


def test_operator_exposes_its_metrics(running_operator: OperatorProcess) -> None:
    names = {name for name, _ in running_operator.metrics()}
    assert {c.M_OPERATOR_RECONCILES + "_total", c.M_OPERATOR_RECONCILE_SECONDS + "_bucket",
            c.M_OPERATOR_INJECTED_WORKLOADS, c.M_OPERATOR_ERRORS + "_total"} <= names  # fmt: skip


def quota(namespace: str, hard: dict[str, str]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "tight", "namespace": namespace},
            "spec": {"hard": hard}}  # fmt: skip


def wait_quota_counted(cluster: LocalCluster, namespace: str, resource: str) -> None:
    """Quota admission only judges creates once the quota controller has filled in ``status.used``."""
    wait_for(lambda: resource in ((get(cluster, "resourcequota", "tight", namespace).get("status") or {})
                                  .get("used") or {}), what=f"quota usage of {resource}")  # fmt: skip


def test_a_workload_refused_by_a_quota_is_injected_once_it_is_lifted_without_touching_the_workload(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    # The namespace already holds kube-root-ca.crt: a quota of one ConfigMap refuses ours.
    apply(cluster, quota(namespace, {"count/configmaps": "1"}))
    wait_quota_counted(cluster, namespace, "count/configmaps")
    apply(cluster, trtllm_deployment("quota", namespace, replicas=0, annotations={c.ANN_ENABLED: "true"}))
    event = wait_for(lambda: events_for(cluster, namespace, "quota", "KvoffloadRetrying"), what="a Retrying Warning")[0]
    assert event["type"] == "Warning" and "exceeded quota" in event["message"], event["message"]
    assert running_operator.metric_sum(c.M_OPERATOR_RETRY_QUEUE) >= 1
    # The Deployment controller's own status write is done: from here nothing changes the object,
    # so no watch event can bring the operator back; only its retry can.
    settled = wait_for(lambda: (d := get(cluster, "deployment", "quota", namespace))
                       and (d.get("status") or {}).get("observedGeneration") == d["metadata"]["generation"] and d,
                       what="the Deployment's status settled")  # fmt: skip
    assert not is_injected(settled)
    cluster.kubectl("delete", "resourcequota", "tight", "-n", namespace)
    wait_injected(cluster, "deployment", "quota", namespace, timeout=60)
    wait_for(lambda: running_operator.metric_sum(c.M_OPERATOR_RETRY_QUEUE) == 0, what="the retry queue drained")


def apiserver_applies(cluster: LocalCluster) -> float:
    """Server-Side Apply requests the apiserver has served (deployments and configmaps)."""
    text = cluster.kubectl("get", "--raw", "/metrics").stdout
    return sum(
        s.value for f in text_string_to_metric_families(text) if f.name == "apiserver_request" for s in f.samples
        if s.name == "apiserver_request_total" and s.labels.get("verb") == "APPLY"
        and s.labels.get("resource") in ("deployments", "configmaps")
    )  # fmt: skip


def test_a_resync_without_drift_writes_nothing_and_repairs_a_deleted_configmap(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    operator.stop()  # only the resyncing operator below may write (the next test restarts the session one)
    resyncing = OperatorProcess(kubeconfig=operator.kubeconfig, workdir=tmp_path,
                                extra_args=["--namespace", namespace, "--resync-seconds", "2"])  # fmt: skip
    resyncing.start()
    try:
        apply(cluster, trtllm_deployment("resync", namespace, replicas=0, annotations={c.ANN_ENABLED: "true"}))
        dep = wait_injected(cluster, "deployment", "resync", namespace)
        forced = c.M_OPERATOR_RECONCILES + "_total"
        base = resyncing.metric_sum(forced, result="unchanged")
        # The pass on the operator's own apply event is one "unchanged"; the resyncs follow.
        wait_for(lambda: resyncing.metric_sum(forced, result="unchanged") >= base + 2, what="a first resync")
        applies = apiserver_applies(cluster)
        seen = resyncing.metric_sum(forced, result="unchanged")
        wait_for(lambda: resyncing.metric_sum(forced, result="unchanged") >= seen + 3, what="three more resyncs")
        assert apiserver_applies(cluster) == applies, "a resync with no drift sent an apply"
        assert template(get(cluster, "deployment", "resync", namespace)) == template(dep)

        cluster.kubectl("delete", "configmap", f"resync{c.GENERATED_CONFIGMAP_SUFFIX}", "-n", namespace)
        wait_for(lambda: cluster.kubectl("get", "configmap", f"resync{c.GENERATED_CONFIGMAP_SUFFIX}", "-n", namespace,
                                         check=False).returncode == 0, timeout=30, what="the ConfigMap recreated")  # fmt: skip
        assert apiserver_applies(cluster) > applies
    finally:
        resyncing.stop()
