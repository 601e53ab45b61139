"""Injection at admission, pure parts: the record, the pod the webhook admits, its patch, the
owner it resolves, and which uninjected pods are evicted."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.workloads import trtllm_container, trtllm_deployment
from kvoffload import contract as c
from kvoffload.operator.admission.new_workloads import label_for_new_workload, record_before_the_operator
from kvoffload.operator.admission.pod_alignment import next_eviction, start_failure
from kvoffload.operator.admission.records import (
    admission_response,
    admit,
    injected_pod,
    json_patch,
    merge_pod_spec,
    record_from_workload,
)
from kvoffload.operator.admission.webhook_tls import ca_bundle_patch, webhook_configuration
from kvoffload.operator.api.pod_owners import Owner, resolve_owner
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.workload import Workload, read_workload
from kvoffload.operator.plan.fragment import render
from kvoffload.operator.plan.injection_plan import ClusterInfo, choose_engine, plan_injection
from kvoffload.operator.plan.injection_record import InjectionRecord, foreign_record, record_of
from kvoffload.operator.plan.workload_apply import render_admission
from kvoffload.policy_values import FsTier, PolicyError, RedisTier
from kvoffload.trtllm_options_merge import options_digest
from tests.support.options_init import OPTIONS_PATH, options_init_container, run_options_init


def plan_of(workload: dict[str, Any], settings: InjectionSettings | None = None, admission: bool = True,
            user_options: str | None = None) -> Any:  # fmt: skip
    settings = settings or InjectionSettings()
    cluster = ClusterInfo(native_sidecars=True, injection="admission" if admission else "template")
    read = read_workload(workload)
    engine = choose_engine(read, settings)
    return plan_injection(read, settings, cluster, engine, user_options)  # type: ignore[arg-type]


def pod_of(workload: dict[str, Any], template_hash: str = "5d8f7c9b4") -> dict[str, Any]:
    """What the ReplicaSet controller creates from the template."""
    template = copy.deepcopy(workload["spec"]["template"])
    labels = {**template["metadata"]["labels"], "pod-template-hash": template_hash}
    name = workload["metadata"]["name"]
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"generateName": f"{name}-{template_hash}-", "namespace": workload["metadata"]["namespace"],
                     "labels": labels, "ownerReferences": [{"kind": "ReplicaSet", "name": f"{name}-{template_hash}",
                                                            "controller": True}]},
        "spec": template["spec"],
    }  # fmt: skip


def test_the_record_round_trips_every_setting() -> None:
    settings = InjectionSettings(fs_tier=FsTier("/cache", 2**30), redis_tier=RedisTier("redis://r:6379", "s", "k"),
                                 container="trtllm", sidecar_resources={"limits": {"memory": "9Gi"}})  # fmt: skip
    record = InjectionRecord(settings, options_digest("max_batch_size: 8\n"), None, "0.1.0", True)
    assert InjectionRecord.from_json(record.to_json()) == record
    assert "not readable" in str(InjectionRecord.from_json("{"))


def test_admission_mode_writes_one_object_the_workload_with_the_record_and_one_template_label() -> None:
    workload = trtllm_deployment("llm", "ns")
    rendered = render_admission(plan_of(workload))
    assert rendered.workload_apply["spec"] == {
        "template": {"metadata": {"labels": {c.LABEL_INJECT: rendered.config_hash}}}
    }
    assert rendered.configmap_apply is None, "no generated ConfigMap: one write per workload"
    record = InjectionRecord.from_json(rendered.workload_apply["metadata"]["annotations"][c.ANN_INJECTION_RECORD])
    assert isinstance(record, InjectionRecord) and record.settings == InjectionSettings()
    assert set(rendered.files) == {c.POLICY_FILE}, "the options file is the pod's init container's to write"
    assert set(rendered.forceable_fields) == {  # only kvoffload's own keys are ever taken back
        f".metadata.annotations.{c.ANN_INJECTION_RECORD}",
        f".spec.template.metadata.labels.{c.LABEL_INJECT}",
    }
    other = render_admission(plan_of(workload, InjectionSettings(l1_bytes=5 * 2**30)))
    assert other.config_hash != rendered.config_hash, "a settings change must roll the pods"
    image = copy.deepcopy(workload)
    image["spec"]["template"]["spec"]["containers"][0]["image"] = "trtllm:next"
    assert render_admission(plan_of(image)).config_hash == rendered.config_hash, (
        "an image change is the user's one rollout"
    )


def test_a_record_of_the_previous_version_reads_as_its_digest_and_the_operator_writes_it_anew() -> None:
    """An upgrade: a workload's record still holds the user's options text. Its pods are still
    injected (the text read as its digest, which the init container checks), and the operator's
    plan gives a different record (digest only), which it applies: one rollout, text gone."""
    workload, user = options_workload()
    plan = plan_of(workload, user_options=user)
    current = json.loads(record_of(plan).to_json())
    legacy = {k: v for k, v in current.items() if k != "user_options_digest"} | {"user_options_yaml": user}
    record = InjectionRecord.from_json(json.dumps(legacy))
    assert record == record_of(plan), "the old record reads as the digest of its text"
    new = injected_pod(pod_of(workload), "Deployment", "llm", "ns", record)
    assert isinstance(new, dict) and MARKER not in json.dumps(new)
    assert options_init_container(new)["args"][-1] == options_digest(user)
    assert render_admission(plan).workload_apply["metadata"]["annotations"][c.ANN_INJECTION_RECORD] != json.dumps(
        legacy
    )


def test_the_webhook_pod_is_the_template_modes_injection_applied_to_the_pod() -> None:
    workload = trtllm_deployment("llm", "ns")
    record = InjectionRecord(InjectionSettings(), None, None, "0.1.0", True)
    pod = pod_of(workload)
    new = injected_pod(pod, "Deployment", "llm", "ns", record)
    assert not isinstance(new, type(None)) and isinstance(new, dict)
    fragment = render(plan_of(workload, admission=False), files_on_pod=True).workload_apply["spec"]["template"]
    assert merge_pod_spec(pod["spec"], fragment["spec"]) == new["spec"]
    assert new["metadata"]["labels"][c.LABEL_INJECTED] == "true"
    assert new["metadata"]["labels"]["pod-template-hash"] == "5d8f7c9b4", "the pod's own labels stay"
    engine = next(x for x in new["spec"]["containers"] if x["name"] == "trtllm")
    assert (
        engine["args"].count("--extra_llm_api_options") == 1
        and engine["image"] == pod["spec"]["containers"][0]["image"]
    )


def test_the_webhook_pod_carries_its_policy_file_and_an_init_container_writes_its_options_file(tmp_path: Path) -> None:
    workload = trtllm_deployment("llm", "ns")
    plan = plan_of(workload)
    new = injected_pod(pod_of(workload), "Deployment", "llm", "ns", InjectionRecord(plan.settings, None, None,
                                                                                   "0.1.0", True))  # fmt: skip
    assert isinstance(new, dict)
    files = render_admission(plan).files
    volumes = {v["name"]: v for v in new["spec"]["volumes"]}
    assert "configMap" not in volumes[c.VOLUME_POLICY]
    (item,) = volumes[c.VOLUME_POLICY]["downwardAPI"]["items"]
    assert item["path"] == c.POLICY_FILE
    annotation = item["fieldRef"]["fieldPath"].removeprefix("metadata.annotations['").removesuffix("']")
    assert new["metadata"]["annotations"][annotation] == files[c.POLICY_FILE]
    assert set(volumes[c.VOLUME_TRTLLM_OPTIONS]) == {"name", "emptyDir"}
    init = options_init_container(new)
    assert init["image"] == workload["spec"]["template"]["spec"]["containers"][0]["image"], "the engine's image"
    assert init["volumeMounts"][0] == {"name": c.VOLUME_TRTLLM_OPTIONS, "mountPath": c.TRTLLM_OPTIONS_MOUNT_PATH}
    assert [x["name"] for x in new["spec"]["initContainers"]].index(c.OPTIONS_INIT_CONTAINER) == 1, "after the bundle"
    ran = run_options_init(new, {}, tmp_path)
    assert (
        ran.returncode == 0 and ran.options == render(plan_of(workload, admission=False)).files[c.TRTLLM_OPTIONS_FILE]
    ), "the pod writes the file template mode writes"


MARKER = "kvoffload-test-marker-7f3a"


def options_workload() -> tuple[dict[str, Any], str]:
    """A workload whose engine reads its options file from a ConfigMap (a subPath mount), and that file."""
    engine = trtllm_container("/config/extra.yaml")
    engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config/extra.yaml", "subPath": "extra.yaml"}]
    volumes = [{"name": "cfg", "configMap": {"name": "llm-options"}}]
    user = f"max_batch_size: 8\n# {MARKER}\nkv_cache_config: {{free_gpu_memory_fraction: 0.9}}\n"
    return trtllm_deployment("llm", "ns", containers=[engine], volumes=volumes), user


@pytest.mark.parametrize("source", ["init-container", "image"])
def test_the_webhook_pod_merges_the_users_options_in_an_init_container_and_no_answer_holds_their_text(
    tmp_path: Path, source: str
) -> None:
    """Admission mode never answers with the user's options text (a forged review with a workload's
    uids known would read it): the record keeps its digest, the pod's init container mounts the
    user's ConfigMap as the engine does and merges the file there."""
    workload, user = options_workload()
    settings = InjectionSettings(connector_source=source)
    plan = plan_of(workload, settings, user_options=user)
    rendered = render_admission(plan)
    assert MARKER not in json.dumps(rendered.workload_apply) and MARKER not in json.dumps(rendered.files)
    record = InjectionRecord.from_json(rendered.workload_apply["metadata"]["annotations"][c.ANN_INJECTION_RECORD])
    assert isinstance(record, InjectionRecord) and record.user_options_digest == options_digest(user)
    pod = pod_of(workload)
    pod["metadata"]["labels"][c.LABEL_INJECT] = rendered.config_hash
    answer = admit(pod, "ns", record, ("Deployment", "llm"))
    assert answer.result == "injected" and MARKER not in json.dumps(answer.patch)
    new = injected_pod(pod, "Deployment", "llm", "ns", record)
    assert isinstance(new, dict)
    init = options_init_container(new)
    engine = next(x for x in new["spec"]["containers"] if x["name"] == "trtllm")
    assert {"name": "cfg", "mountPath": "/config/extra.yaml", "subPath": "extra.yaml", "readOnly": True} in init[
        "volumeMounts"
    ]
    assert engine["args"][engine["args"].index("--extra_llm_api_options") + 1] == OPTIONS_PATH
    assert {"name": c.VOLUME_TRTLLM_OPTIONS, "mountPath": c.TRTLLM_OPTIONS_MOUNT_PATH, "readOnly": True} in engine[
        "volumeMounts"
    ]
    bundle = {"name": c.VOLUME_BUNDLE, "mountPath": c.BUNDLE_MOUNT_PATH, "readOnly": True}
    assert (bundle in init["volumeMounts"]) == (source == "init-container")
    assert ({"name": c.ENV_PYTHONPATH, "value": c.BUNDLE_PYTHONPATH} in init.get("env", [])) == (
        source == "init-container"
    )
    assert init["securityContext"]["runAsNonRoot"] and init["securityContext"]["runAsUser"] != 0
    assert init["resources"]["limits"]["memory"]
    ran = run_options_init(new, {"/config/extra.yaml": user}, tmp_path)
    assert ran.returncode == 0 and ran.stderr == "", ran.stderr
    assert (
        ran.options
        == render(plan_of(workload, settings, admission=False, user_options=user)).files[c.TRTLLM_OPTIONS_FILE]
    )
    merged = yaml.safe_load(ran.options or "")
    assert merged["max_batch_size"] == 8 and merged["kv_cache_config"]["enable_block_reuse"] is True


def test_merging_keeps_the_users_list_items_and_replaces_ours_by_key() -> None:
    spec = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["u"]}],
            "volumes": [{"name": "v", "emptyDir": {}}]}  # fmt: skip
    fragment = {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["u", "ours"]},
                               {"name": "side"}], "volumes": [{"name": "w", "emptyDir": {}}],
                "shareProcessNamespace": True}  # fmt: skip
    merged = merge_pod_spec(spec, fragment)
    assert merged["containers"][0] == {"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}],
                                       "args": ["u", "ours"]}  # fmt: skip
    assert [x["name"] for x in merged["containers"]] == ["a", "side"]
    assert [v["name"] for v in merged["volumes"]] == ["v", "w"] and merged["shareProcessNamespace"] is True
    assert spec["containers"][0]["args"] == ["u"], "the input is not changed"


def test_the_patch_turns_the_pod_into_the_injected_one() -> None:
    workload = trtllm_deployment("llm", "ns")
    pod = pod_of(workload)
    new = injected_pod(pod, "Deployment", "llm", "ns", InjectionRecord(InjectionSettings(), None, None, "0.1.0", True))
    assert isinstance(new, dict)
    patched = copy.deepcopy(pod)
    for op in json_patch(pod, new):
        assert op["op"] == "add"
        _, part, key = op["path"].split("/")
        patched[part][key] = op["value"]
    assert patched == new


class ObjectsByPath:
    """A ``Kube`` that answers GETs from a dict of objects by API path."""

    def __init__(self, objects: dict[str, dict[str, Any]]) -> None:
        self.objects = objects

    def get(self, path: str) -> dict[str, Any] | None:
        return self.objects.get(path)


def _meta(name: str, uid: str, owner: tuple[str, str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": uid}
    if owner:
        meta["ownerReferences"] = [{"kind": owner[0], "name": owner[1], "uid": owner[2], "controller": True}]
    return {"metadata": meta}


DEPLOYMENTS = "/apis/apps/v1/namespaces/ns/deployments"
REPLICASETS = "/apis/apps/v1/namespaces/ns/replicasets"


@pytest.mark.parametrize(
    ("pod_owner", "expected"),
    [
        (("ReplicaSet", "llama-7f9c", "rs-1"), ("Deployment", "llama")),
        (("StatefulSet", "db", "sts-1"), ("StatefulSet", "db")),
        (("ReplicaSet", "llama-evil", "rs-2"), "is not controlled by a Deployment"),  # the user's own ReplicaSet
        (("ReplicaSet", "llama-zzzzz", "rs-3"), "not there"),  # a reference to nothing
        (("ReplicaSet", "llama-7f9c", "forged"), "not there"),  # the name of a real one, another uid
        (("Job", "j", "job-1"), "its controller is a Job"),
        (None, "no controller"),
    ],
)  # fmt: skip
def test_the_owner_is_followed_through_the_api_never_guessed_from_a_name(
    pod_owner: tuple[str, str, str] | None, expected: tuple[str, str] | str
) -> None:
    kube = ObjectsByPath({
        f"{DEPLOYMENTS}/llama": _meta("llama", "dep-1"),
        f"{REPLICASETS}/llama-7f9c": _meta("llama-7f9c", "rs-1", ("Deployment", "llama", "dep-1")),
        f"{REPLICASETS}/llama-evil": _meta("llama-evil", "rs-2"),
        "/apis/apps/v1/namespaces/ns/statefulsets/db": _meta("db", "sts-1"),
    })  # fmt: skip
    owner = resolve_owner(kube, _meta("pod", "p-1", pod_owner), "ns")  # type: ignore[arg-type]
    if isinstance(expected, str):
        assert isinstance(owner, str) and expected in owner, owner
    else:
        assert not isinstance(owner, str) and (owner.kind, owner.name) == expected


def test_a_pod_without_a_usable_record_is_admitted_as_written_with_a_warning() -> None:
    workload = trtllm_deployment("llm", "ns", annotations={c.ANN_ENABLED: "true"})
    pod = pod_of(workload)
    pod["metadata"]["labels"][c.LABEL_INJECT] = "abc"
    missing = admit(pod, "ns", record_from_workload(workload, "Deployment", "llm"), ("Deployment", "llm"))
    assert missing.patch == [] and missing.result == "not_injected" and "has not injected" in missing.warnings[0]
    text = InjectionRecord(InjectionSettings(), None, None, "0.1.0", True).to_json()
    foreign = copy.deepcopy(workload)
    foreign["metadata"]["annotations"] = {c.ANN_ENABLED: "true", c.ANN_INJECTION_RECORD: text}
    foreign["metadata"]["managedFields"] = [{"manager": "kubectl", "operation": "Update", "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{c.ANN_INJECTION_RECORD}": {}}}}}]  # fmt: skip
    assert "not written by kvoffload" in str(record_from_workload(foreign, "Deployment", "llm"))
    ours = copy.deepcopy(foreign)
    ours["metadata"]["managedFields"][0]["manager"] = c.FIELD_MANAGER
    assert isinstance(record_from_workload(ours, "Deployment", "llm"), InjectionRecord)
    unlabelled = admit(pod_of(workload), "ns", None, ("Deployment", "llm"))
    assert unlabelled.result == "ignored" and unlabelled.patch == []
    record = InjectionRecord(InjectionSettings(), None, None, "0.1.0", True)
    answer = admission_response("uid-1", admit(pod, "ns", record, ("Deployment", "llm")))
    assert answer["response"]["allowed"] is True and answer["response"]["uid"] == "uid-1"
    assert json.loads(base64.b64decode(answer["response"]["patch"]))


def test_a_host_network_pod_is_admitted_without_the_cache_and_the_warning_says_why() -> None:
    workload = trtllm_deployment("llm", "ns")
    pod = pod_of(workload)
    pod["metadata"]["labels"][c.LABEL_INJECT] = "abc"
    pod["spec"]["hostNetwork"] = True
    record = InjectionRecord(InjectionSettings(), None, None, "0.1.0", True)
    answer = admit(pod, "ns", record, ("Deployment", "llm"))
    assert answer.patch == [] and answer.result == "not_injected"
    assert "spec.template.spec.hostNetwork" in answer.warnings[0] and "node's loopback" in answer.warnings[0]


def _pod(name: str, created: str, injected: bool, ready: bool = True, deleting: bool = False) -> dict[str, Any]:
    pod = pod_of(trtllm_deployment("llm", "ns"), "abc")
    labels = {**pod["metadata"]["labels"], c.LABEL_INJECT: "h"}
    if injected:
        labels[c.LABEL_INJECTED] = "true"
    pod["metadata"].update(name=name, creationTimestamp=created, labels=labels)
    if deleting:
        pod["metadata"]["deletionTimestamp"] = created
    pod["status"] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return pod


def _owner(replicas: int = 3, manager: str = c.FIELD_MANAGER, enabled: str | None = "true",
           env: list[dict[str, str]] | None = None) -> Owner:  # fmt: skip
    """Deployment llm with a record written by ``manager``, opted in by ``enabled``."""
    workload = trtllm_deployment("llm", "ns", replicas=replicas)
    workload["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT] = "h"
    annotations = {c.ANN_INJECTION_RECORD: InjectionRecord(InjectionSettings(), None, None, "0.1.0", True).to_json()}
    if enabled is not None:
        annotations[c.ANN_ENABLED] = enabled
    workload["metadata"]["annotations"] = annotations
    workload["metadata"]["managedFields"] = [{"manager": manager, "operation": "Apply", "fieldsType": "FieldsV1",
        "fieldsV1": {"f:metadata": {"f:annotations": {f"f:{c.ANN_INJECTION_RECORD}": {}}}}}]  # fmt: skip
    return Owner("Deployment", "llm", workload)


def _with_env(pods: list[dict[str, Any]], env: list[dict[str, str]]) -> list[dict[str, Any]]:
    for pod in pods:
        pod["spec"]["containers"][0]["env"] = env
    return pods


def _evicted(owner: Owner, pods: list[dict[str, Any]]) -> str | None:
    pod = next_eviction(owner, pods, "ns")
    return None if pod is None else str(pod["metadata"]["name"])


def test_uninjected_pods_are_evicted_oldest_first_one_at_a_time_per_workload() -> None:
    pods = [_pod("a", "2026-01-01T00:00:02Z", False), _pod("b", "2026-01-01T00:00:01Z", False),
            _pod("c", "2026-01-01T00:00:00Z", True)]  # fmt: skip
    assert _evicted(_owner(), pods) == "b"
    assert _evicted(_owner(), [*pods[1:], _pod("d", "2026-01-01T00:00:03Z", True, ready=False)]) is None, (
        "none while a replacement is starting")  # fmt: skip
    assert _evicted(_owner(), [*pods, _pod("e", "2026-01-01T00:00:03Z", False, deleting=True)]) is None, (
        "none while one is terminating")  # fmt: skip
    assert _evicted(_owner(), pods[1:]) is None, "none while a pod the workload wants is missing"
    assert _evicted(_owner(replicas=1), [_pod("c", "2026-01-01T00:00:00Z", True)]) is None
    older = _owner()
    older.workload["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT] = "newer"
    assert _evicted(older, pods) is None, "pods of an older template are the rollout's to replace"


@pytest.mark.parametrize(
    ("owner", "env", "why"),
    [
        (_owner(enabled=None), None, "carries the label, not opted in (a copy of kubectl get -o yaml)"),
        (_owner(enabled="false"), None, "opted out"),
        (_owner(manager="kubectl"), None, "its record written back by kubectl rollout undo"),
        (_owner(), [{"name": c.ENV_PYTHONPATH, "value": "/app/lib"}], "the webhook refuses its env"),
    ],
)  # fmt: skip
def test_a_pod_the_webhook_would_not_inject_is_never_evicted(
    owner: Owner, env: list[dict[str, str]] | None, why: str
) -> None:
    pods = [_pod("a", "2026-01-01T00:00:02Z", False), _pod("b", "2026-01-01T00:00:01Z", False),
            _pod("c", "2026-01-01T00:00:00Z", False)]  # fmt: skip
    if env:
        _with_env(pods, env)
    assert _evicted(owner, pods) is None, why


def test_an_injected_pod_names_the_record_it_was_injected_from() -> None:
    """The template label of a record and the pod annotation of a pod injected from it agree; a pod
    of an older template (another label) names the record it really got."""
    workload = trtllm_deployment("llm", "ns", annotations={c.ANN_ENABLED: "true"})
    rendered = render_admission(plan_of(workload))
    record = InjectionRecord.from_json(rendered.workload_apply["metadata"]["annotations"][c.ANN_INJECTION_RECORD])
    assert isinstance(record, InjectionRecord)
    pod = pod_of(workload)
    pod["metadata"]["labels"][c.LABEL_INJECT] = "an-older-hash"
    injected = injected_pod(pod, "Deployment", "llm", "ns", record)
    assert not isinstance(injected, PolicyError)
    assert injected["metadata"]["annotations"][c.ANN_INJECTED_FROM] == rendered.config_hash
    assert injected["metadata"]["labels"][c.LABEL_INJECT] == "an-older-hash"


def test_a_kvoffload_container_the_kubelet_cannot_create_is_reported_by_name() -> None:
    pod = _pod("a", "2026-01-01T00:00:00Z", True)
    assert start_failure(pod) is None
    waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": 'secret "redis-pw" not found'}}
    pod["status"]["initContainerStatuses"] = [{"name": c.SIDECAR_CONTAINER, "state": waiting}]
    assert start_failure(pod) == f'container {c.SIDECAR_CONTAINER}: secret "redis-pw" not found'
    pod["status"]["initContainerStatuses"] = [{"name": "users-own", "state": waiting}]
    assert start_failure(pod) is None, "the user's own containers are the user's business"


def test_the_webhook_never_sees_pods_of_kube_system_or_the_operators_namespace() -> None:
    client = {"url": "https://127.0.0.1:8443/mutate-pods"}
    pods_hook, workloads_hook = webhook_configuration("kvoffload-pod-injection", b"ca", client, (), "kvoffload-system")[
        "webhooks"
    ]
    excluded = {
        "key": "kubernetes.io/metadata.name",
        "operator": "NotIn",
        "values": ["kube-system", "kvoffload-system"],
    }
    assert pods_hook["namespaceSelector"] == workloads_hook["namespaceSelector"] == {"matchExpressions": [excluded]}
    assert workloads_hook["clientConfig"]["url"] == "https://127.0.0.1:8443" + c.WEBHOOK_WORKLOADS_PATH
    assert workloads_hook["rules"][0]["resources"] == ["deployments", "statefulsets"]
    assert workloads_hook["rules"][0]["operations"] == ["CREATE", "UPDATE"], "an update keeps kvoffload's fields"
    scoped = webhook_configuration("kvoffload-pod-injection", b"ca", client, ("team-a",), "kvoffload-system")[
        "webhooks"
    ][0]
    assert scoped["namespaceSelector"]["matchExpressions"] == [
        excluded, {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a"]}
    ]  # fmt: skip


def test_the_operator_patches_only_the_ca_bundle_of_the_charts_two_webhooks() -> None:
    patch = ca_bundle_patch(b"ca")
    registered = webhook_configuration("kvoffload-pod-injection", b"", {"url": "https://h/mutate-pods"}, (), "ns")
    assert [h["name"] for h in patch["webhooks"]] == [h["name"] for h in registered["webhooks"]]
    assert all(h == {"name": h["name"], "clientConfig": {"caBundle": "Y2E="}} for h in patch["webhooks"])
    assert set(patch) == {"webhooks"}


def test_a_workload_created_opted_in_gets_the_operators_label_and_its_first_pods_the_same_record() -> None:
    """At CREATE the template gets the label the operator's apply will carry; a pod created before
    the record exists is injected from the plan made at admission, only if the hashes agree."""
    workload = trtllm_deployment("llm", "ns", annotations={c.ANN_ENABLED: "true"})
    plan = plan_of(workload)
    rendered = render_admission(plan)
    (op,) = label_for_new_workload(workload, plan)
    assert op == {"op": "add", "path": "/spec/template/metadata/labels/kvoffload.io~1inject",
                  "value": rendered.config_hash}  # fmt: skip
    early = record_before_the_operator(workload, rendered.config_hash, lambda _w: plan)
    assert isinstance(early, InjectionRecord) and early.to_json() == rendered.workload_apply["metadata"][
        "annotations"][c.ANN_INJECTION_RECORD]  # fmt: skip
    assert isinstance(record_before_the_operator(workload, "another", lambda _w: plan), str)
    assert record_before_the_operator(workload, rendered.config_hash, lambda _w: "not opted in") == "not opted in"


def test_what_kvoffloads_field_manager_holds_but_kvoffload_did_not_write_is_named() -> None:
    """``foreign_record``: a record under kvoffload's name that does not read as one, or the selector
    held by kvoffload's manager (a whole manifest applied under its name); a record kvoffload wrote,
    or one another manager holds (``kubectl rollout undo``: the operator takes it back), is not."""
    text = InjectionRecord(InjectionSettings(), None, None, "0.1.0", True).to_json()

    def workload_with(record: str | None, manager: str, selector: bool = False) -> Workload:
        obj = trtllm_deployment("llm", "ns", annotations={c.ANN_ENABLED: "true"})
        fields: dict[str, Any] = {}
        if record is not None:
            obj["metadata"]["annotations"][c.ANN_INJECTION_RECORD] = record
            fields = {"f:metadata": {"f:annotations": {f"f:{c.ANN_INJECTION_RECORD}": {}}}}
        if selector:
            fields["f:spec"] = {"f:selector": {}}
        obj["metadata"]["managedFields"] = [
            {"manager": "user", "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {}}},
            {"manager": manager, "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": fields},
        ]
        return read_workload(obj)

    assert foreign_record(workload_with(text, c.FIELD_MANAGER)) is None
    assert foreign_record(workload_with("forged", "kubectl-rollout")) is None
    assert foreign_record(workload_with(None, c.FIELD_MANAGER)) is None
    forged = foreign_record(workload_with("forged", c.FIELD_MANAGER))
    assert forged is not None and forged.reason == "foreign_record"
    assert "kvoffload did not write this (the injection record is not readable" in forged.message, forged.message
    applied = foreign_record(workload_with(text, c.FIELD_MANAGER, selector=True))
    assert applied is not None and "holds spec.selector" in applied.message
    assert foreign_record(workload_with(None, c.FIELD_MANAGER, selector=True)) is not None, "the record removed too"


@pytest.mark.parametrize(
    ("volume", "fs_group", "refused"),
    [
        ({"defaultMode": 0o400}, None, True),  # only its owner (root) reads it
        ({"defaultMode": 0o440}, None, True),  # and root's group: no fsGroup, uid 65532 is in neither
        ({"defaultMode": 0o440}, 2000, False),  # fsGroup owns the file and is every container's group
        ({"defaultMode": 0o400, "items": [{"key": "extra.yaml", "path": "extra.yaml", "mode": 0o644}]}, None, False),
        ({"items": [{"key": "extra.yaml", "path": "extra.yaml", "mode": 0o600}]}, None, True),
        ({}, None, False),  # the kubelet's 0644
    ],
)
def test_an_options_file_the_pods_init_step_cannot_read_is_refused_before_the_pod(
    volume: dict[str, Any], fs_group: int | None, refused: bool
) -> None:
    """Admission mode merges the user's options file in the pod as uid 65532: a ConfigMap file mode
    that keeps that uid out would stop every pod at the init container; it is refused up front, with
    the mode and the two ways out. Template mode reads the file through the API: no such refusal."""
    workload, user = options_workload()
    workload["spec"]["template"]["spec"]["volumes"][0]["configMap"].update(volume)
    if fs_group is not None:
        workload["spec"]["template"]["spec"]["securityContext"] = {"fsGroup": fs_group}
    planned = plan_of(workload, user_options=user)
    if refused:
        assert isinstance(planned, PolicyError) and planned.reason == "invalid_options", planned
        assert "uid 65532" in planned.message and "fsGroup" in planned.message and "\n" not in planned.message
    else:
        assert not isinstance(planned, PolicyError), planned
    assert not isinstance(plan_of(workload, admission=False, user_options=user), PolicyError)
