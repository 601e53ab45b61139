"""Injection at pod admission on the real apiserver, which calls the operator's webhook on
127.0.0.1 over TLS: the GitOps matrix (client-side apply, server-side apply under the GitOps tool's
own manager, and forced) by (re-apply, image change, opt-in, opt-out), each with its rollouts and the
operator's writes counted; pods created while the webhook is down are brought in line."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.ports import free_port
from hack.workloads import get, list_objects, wait_for
from kvoffload import contract as c
from tests.support.operator_support import (
    OperatorProcess,
    admission_args,
    events_for,
    register_webhook_as_the_chart_does,
    webhook_port,
)
from tests.support.operator_support import gitops_manifest as manifest
from tests.support.options_init import run_options_init

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]
GITOPS_MANAGER = "argocd-controller"
REVISION = "deployment.kubernetes.io/revision"
SETTLE_S = 4.0
"""After the expected state is reached, how long nothing more may happen (2 background ticks)."""


def gitops_apply(cluster: LocalCluster, method: str, body: dict[str, Any]) -> None:
    """Apply ``body`` the way a GitOps tool does: client-side (Argo CD's default), server-side under
    its own field manager, or server-side forced."""
    args = ["apply", "-f", "-"]
    if method != "client-side":
        args += ["--server-side", f"--field-manager={GITOPS_MANAGER}"]
    if method == "server-side-force":
        args.append("--force-conflicts")
    cluster.kubectl(*args, input=json.dumps(body))


def gitops_diff(cluster: LocalCluster, method: str, body: dict[str, Any]) -> str:
    """``kubectl diff`` of the manifest, as the same tool would run it; empty when in sync."""
    args = ["diff", "-f", "-"]
    if method != "client-side":
        args += ["--server-side", f"--field-manager={GITOPS_MANAGER}"]
    if method == "server-side-force":
        args.append("--force-conflicts")
    result = cluster.kubectl(*args, input=json.dumps(body), check=False)
    assert result.returncode in (0, 1), result.stderr
    return str(result.stdout)


def revision(cluster: LocalCluster, name: str, namespace: str) -> int:
    """The Deployment's rollout count (its revision: +1 for every new pod template it rolls to)."""
    return int(get(cluster, "deployment", name, namespace)["metadata"].get("annotations", {}).get(REVISION, "0"))


def live(cluster: LocalCluster, name: str, namespace: str) -> dict[str, Any]:
    """The Deployment with its managedFields."""
    out = cluster.kubectl("get", "deployment", name, "-n", namespace, "-o", "json", "--show-managed-fields")
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def operator_writes(obj: dict[str, Any]) -> list[Any]:
    """The operator's managedFields entries on the object (time and fields): they change exactly
    when one of its writes changed the object."""
    return [(m.get("time"), m.get("fieldsV1")) for m in obj["metadata"].get("managedFields", [])
            if m.get("manager") == c.FIELD_MANAGER]  # fmt: skip


def generated_configmaps(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    return list_objects(cluster, "configmap", namespace, f"{c.LABEL_MANAGED_BY}={c.LABEL_MANAGED_BY_VALUE}")


def pods(cluster: LocalCluster, name: str, namespace: str) -> list[dict[str, Any]]:
    return [p for p in list_objects(cluster, "pods", namespace, f"app={name}")
            if not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def settled(cluster: LocalCluster, name: str, namespace: str, injected: bool, image: str) -> list[dict[str, Any]]:
    """Wait until the workload runs 2 pods, all on ``image``, all with or all without the injection."""

    def ready() -> list[dict[str, Any]] | None:
        current = pods(cluster, name, namespace)
        good = [
            p for p in current
            if p.get("status", {}).get("phase") == "Running"
            and (p["metadata"].get("labels", {}).get(c.LABEL_INJECTED) == "true") == injected
            and next(x for x in p["spec"]["containers"] if x["name"] == "trtllm")["image"] == image
        ]  # fmt: skip
        return good if len(current) == 2 and len(good) == 2 else None

    found = wait_for(ready, 120, what=f"{name}: 2 pods on {image}, injected={injected}")
    return found  # type: ignore[no-any-return]


def assert_injected_pod(pod: dict[str, Any]) -> None:
    spec = pod["spec"]
    names = [x["name"] for x in [*spec.get("initContainers", []), *spec["containers"]]]
    assert c.SIDECAR_CONTAINER in names and c.BUNDLE_INIT_CONTAINER in names and c.OPTIONS_INIT_CONTAINER in names, (
        names
    )
    engine = next(x for x in spec["containers"] if x["name"] == "trtllm")
    assert engine["args"].count("--extra_llm_api_options") == 1
    assert any(e["name"].startswith("KVOFFLOAD_") for e in engine["env"]), engine["env"]
    assert any(v["name"] == c.VOLUME_TRTLLM_OPTIONS for v in spec["volumes"])
    assert spec.get("shareProcessNamespace") is True


def roll(cluster: LocalCluster, method: str, body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    """Apply ``body`` as the GitOps tool; wait for its pods (injected iff opted in, every injected
    pod checked) and a settling time; (rollouts it caused, the pods)."""
    meta = body["metadata"]
    start = revision(cluster, meta["name"], meta["namespace"])
    gitops_apply(cluster, method, body)
    opted_in = c.ANN_ENABLED in meta["annotations"]
    image = body["spec"]["template"]["spec"]["containers"][0]["image"]
    found = settled(cluster, meta["name"], meta["namespace"], injected=opted_in, image=image)
    for pod in found if opted_in else []:
        assert_injected_pod(pod)
    time.sleep(SETTLE_S)
    return revision(cluster, meta["name"], meta["namespace"]) - start, found


@pytest.mark.parametrize("method", ["client-side", "server-side", "server-side-force"])
def test_gitops_applies_cause_no_operator_write_and_exactly_the_users_rollouts(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess, method: str
) -> None:
    name = f"gitops-{method}"
    gitops_apply(cluster, method, manifest(name, namespace, "trtllm:1.2.0", opted_in=False))
    settled(cluster, name, namespace, injected=False, image="trtllm:1.2.0")
    counts: dict[str, int] = {}

    # opt-in from git: one rollout, to pods the webhook injected; the template gets only the label
    opted_in = manifest(name, namespace, "trtllm:1.2.0", opted_in=True)
    counts["opt-in"], _ = roll(cluster, method, opted_in)
    dep = live(cluster, name, namespace)
    template = dep["spec"]["template"]
    assert set(template["metadata"]["labels"]) == {"app", c.LABEL_INJECT}, template["metadata"]
    assert [x["name"] for x in template["spec"]["containers"]] == ["trtllm"]
    assert "initContainers" not in template["spec"] and not template["spec"].get("volumes")
    writes = operator_writes(dep)
    assert len(writes) == 1, writes
    assert c.ANN_INJECTION_RECORD in dep["metadata"]["annotations"], "the record rides on the same write"
    assert not generated_configmaps(cluster, namespace), "admission mode writes no ConfigMap"
    assert gitops_diff(cluster, method, opted_in) == "", "kubectl diff of the user's manifest must be empty"

    # re-apply of the same manifest: nothing changes, nobody writes, the record stays
    start = revision(cluster, name, namespace)
    gitops_apply(cluster, method, opted_in)
    time.sleep(SETTLE_S)
    counts["re-apply"] = revision(cluster, name, namespace) - start
    dep = live(cluster, name, namespace)
    assert operator_writes(dep) == writes, "the operator wrote after a re-apply"
    assert c.ANN_INJECTION_RECORD in dep["metadata"]["annotations"], "the GitOps apply took the record away"
    assert gitops_diff(cluster, method, opted_in) == ""

    # image change from git: exactly one rollout, the new pods injected, still no operator write
    upgraded = manifest(name, namespace, "trtllm:1.2.1", opted_in=True)
    counts["image change"], _ = roll(cluster, method, upgraded)
    assert operator_writes(live(cluster, name, namespace)) == writes
    assert gitops_diff(cluster, method, upgraded) == ""

    # opt-out from git: one rollout back to the user's own pods; the template is the manifest's again
    opted_out = manifest(name, namespace, "trtllm:1.2.1", opted_in=False)
    counts["opt-out"], user_pods = roll(cluster, method, opted_out)
    for pod in user_pods:
        assert not any(x["name"].startswith("kvoffload-") for x in pod["spec"]["containers"])
        assert "--extra_llm_api_options" not in next(x for x in pod["spec"]["containers"])["args"]
    dep = live(cluster, name, namespace)
    assert operator_writes(dep) == [], "the operator's label must be gone"
    assert c.LABEL_INJECT not in dep["spec"]["template"]["metadata"]["labels"]
    assert c.ANN_INJECTION_RECORD not in dep["metadata"].get("annotations", {}), "the record must go with the label"
    assert gitops_diff(cluster, method, opted_out) == ""
    print(f"gitops matrix [{method}] rollouts: {counts}")
    assert counts == {"opt-in": 1, "re-apply": 0, "image change": 1, "opt-out": 1}, counts


def test_pods_created_while_the_webhook_is_down_start_as_written_and_are_evicted_once_it_is_back(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    name = "webhook-down"
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(name, namespace, "trtllm:1.2.0", opted_in=True)))
    settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")
    admission_operator.stop()
    try:
        victim = pods(cluster, name, namespace)[0]["metadata"]["name"]
        cluster.kubectl("delete", "pod", victim, "-n", namespace, "--wait=false")
        # failurePolicy Ignore: the replacement is the user's own pod, which starts
        stray = wait_for(lambda: [p for p in pods(cluster, name, namespace)
                                  if p["metadata"].get("labels", {}).get(c.LABEL_INJECTED) != "true"
                                  and p.get("status", {}).get("phase") == "Running"], 60,
                         what="a replacement pod admitted without the injection")  # fmt: skip
        stray_name = stray[0]["metadata"]["name"]
        assert not any(x["name"].startswith("kvoffload-") for x in stray[0]["spec"]["containers"])
        time.sleep(3)
        assert any(p["metadata"]["name"] == stray_name for p in pods(cluster, name, namespace))
    finally:
        admission_operator.start()
    settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")
    assert all(p["metadata"]["name"] != stray_name for p in pods(cluster, name, namespace))
    assert admission_operator.metric_sum(c.M_OPERATOR_EVICTIONS + "_total") == 1, "one eviction (restarted operator)"
    wait_for(lambda: any(stray_name in e["message"] for e in events_for(cluster, namespace, name, "KvoffloadNotInjected")),
             30, what="a KvoffloadNotInjected Event naming the pod")  # fmt: skip


def test_a_webhook_pod_equals_the_template_modes_injection(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess, tmp_path: Path
) -> None:
    """The webhook renders the same injection template mode writes (same renderer, applied to the
    pod); only the files come from the pod itself instead of a generated ConfigMap: the policy file
    from its annotation, the options file from its init container (run here as the kubelet would)."""
    from kvoffload.operator.intent.settings import resolve_settings
    from kvoffload.operator.plan.fragment import render_injection_fragment
    from kvoffload.operator.plan.injection_plan import ClusterInfo
    from tests.support.operator_support import operator_defaults

    name = "same-as-template"
    body = manifest(name, namespace, "trtllm:1.2.0", opted_in=True)
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    pod = settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")[0]
    settings = resolve_settings(body["metadata"]["annotations"], None, operator_defaults(), namespace)
    rendered = render_injection_fragment(copy.deepcopy(body), settings, ClusterInfo(native_sidecars=True))  # type: ignore[arg-type]
    assert not isinstance(rendered, type(None))
    fragment = copy.deepcopy(rendered.workload_apply["spec"]["template"]["spec"])  # type: ignore[union-attr]
    file_volumes = {c.VOLUME_TRTLLM_OPTIONS: c.TRTLLM_OPTIONS_FILE, c.VOLUME_POLICY: c.POLICY_FILE}
    fragment["volumes"] = [v for v in fragment["volumes"] if v["name"] not in file_volumes]
    assert contains(fragment, pod["spec"]), "the webhook's pod lacks part of template mode's injection"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    (item,) = volumes[c.VOLUME_POLICY]["downwardAPI"]["items"]
    annotation = item["fieldRef"]["fieldPath"].removeprefix("metadata.annotations['").removesuffix("']")
    assert item["path"] == c.POLICY_FILE
    assert pod["metadata"]["annotations"][annotation] == rendered.configmap_apply["data"][c.POLICY_FILE], (  # type: ignore[union-attr,index]
        "the policy file: the pod's copy differs from template mode's"
    )
    assert "emptyDir" in volumes[c.VOLUME_TRTLLM_OPTIONS]
    ran = run_options_init(pod, {}, tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.options == rendered.configmap_apply["data"][c.TRTLLM_OPTIONS_FILE], (  # type: ignore[union-attr,index]
        "the options file: the pod's init container writes another file than template mode's"
    )
    assert not generated_configmaps(cluster, namespace)
    assert contains(rendered.workload_apply["spec"]["template"]["metadata"]["labels"],  # type: ignore[union-attr]
                    pod["metadata"]["labels"])  # fmt: skip


def contains(wanted: Any, got: Any) -> bool:
    """Whether ``got`` holds everything in ``wanted`` (the apiserver adds its defaults beside it)."""
    if isinstance(wanted, dict):
        return isinstance(got, dict) and all(k in got and contains(v, got[k]) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(got, list) and all(any(contains(w, g) for g in got) for w in wanted)
    return bool(wanted == got)


def sidecar_l1(pod: dict[str, Any]) -> str:
    sidecar = next(x for x in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]
                   if x["name"] == c.SIDECAR_CONTAINER)  # fmt: skip
    return str(next(e["value"] for e in sidecar["env"] if e["name"] == c.ENV_L1_SIZE))


def admission_process(base: OperatorProcess, workdir: Any, *extra: str) -> OperatorProcess:
    """Another operator in admission mode (its own webhook port), allowed to overlap a running one."""
    workdir.mkdir()
    return OperatorProcess(kubeconfig=base.kubeconfig, workdir=workdir, overlap_allowed=True,
                           extra_args=[*admission_args(free_port()), *extra])  # fmt: skip


def test_overlapping_admission_operators_roll_each_workload_once_per_upgrade_and_rollback(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess, tmp_path: Any
) -> None:
    names = ["upgrade-0", "upgrade-1"]
    for name in names:
        cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(name, namespace, "trtllm:1.2.0", opted_in=True)))
    for name in names:
        assert {sidecar_l1(p) for p in settled(cluster, name, namespace, True, "trtllm:1.2.0")} == {"4Gi"}
    upgraded = admission_process(admission_operator, tmp_path / "upgraded", "--default-l1-size", "5Gi")
    rolled_back = admission_process(admission_operator, tmp_path / "rolled-back")
    counts = []
    try:
        for old, new, l1 in ((admission_operator, upgraded, "5Gi"), (upgraded, rolled_back, "4Gi")):
            before = {n: revision(cluster, n, namespace) for n in names}
            new.start()  # a standby: serves the webhook, writes nothing
            register_webhook_as_the_chart_does(cluster, webhook_port(new))  # the Service's endpoints moved to it
            time.sleep(8)
            assert {n: revision(cluster, n, namespace) for n in names} == before, "the standby wrote"
            old.stop()
            for name in names:
                wait_for(lambda n=name, want=l1: {sidecar_l1(p) for p in settled(cluster, n, namespace, True,
                                                                                 "trtllm:1.2.0")} == {want},
                         120, what=f"{name}'s pods on L1 {l1}")  # fmt: skip
            time.sleep(SETTLE_S)
            counts.append({n: revision(cluster, n, namespace) - before[n] for n in names})
    finally:
        upgraded.stop()
        rolled_back.stop()
        register_webhook_as_the_chart_does(cluster, webhook_port(admission_operator))
        admission_operator.start()
    print(f"overlapping admission operators, rollouts per workload (upgrade, rollback): {counts}")
    assert counts == [dict.fromkeys(names, 1), dict.fromkeys(names, 1)], counts


def test_a_statefulsets_pods_are_injected_at_creation_and_opt_out_rolls_back(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    name = "sts-llm"
    body = manifest(name, namespace, "trtllm:1.2.0", opted_in=True)
    body["kind"] = "StatefulSet"
    body["spec"].pop("strategy")
    body["spec"]["serviceName"] = name
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    for pod in settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0"):
        assert_injected_pod(pod)
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "StatefulSet"
    template = get(cluster, "statefulset", name, namespace)["spec"]["template"]
    assert [x["name"] for x in template["spec"]["containers"]] == ["trtllm"] and c.LABEL_INJECT in template["metadata"][
        "labels"
    ]
    body["metadata"]["annotations"] = {}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    settled(cluster, name, namespace, injected=False, image="trtllm:1.2.0")
    assert c.LABEL_INJECT not in get(cluster, "statefulset", name, namespace)["spec"]["template"]["metadata"]["labels"]
