"""What one reconcile pass does to a workload (kvoffload.operator.plan.workload_decision), without a cluster."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvoffload import contract as c
from kvoffload.operator.intent.settings import OperatorDefaults, ours_annotations_digest
from kvoffload.operator.intent.trtllm_options import MergeFromConfigMap
from kvoffload.operator.intent.workload import WorkloadRef, read_workload
from kvoffload.operator.plan.injection_plan import ClusterInfo
from kvoffload.operator.plan.injection_record import foreign_record
from kvoffload.operator.plan.workload_decision import (
    Decision,
    Inject,
    Leave,
    Reject,
    WorkloadInputs,
    decide_workload,
)
from tests.unit.operator.workload_builders import container, deployment

pytestmark = pytest.mark.operator

CLUSTER = ClusterInfo(True)
INPUTS = WorkloadInputs(
    policy=lambda namespace, name: None, defaults=OperatorDefaults(), cluster=CLUSTER, node_mode=False,
    largest_gpu_node_memory=lambda: None, options=lambda workload, source: None,
)  # fmt: skip
POLICY = {"metadata": {"name": "p", "namespace": "ns", "resourceVersion": "7"}, "spec": {}}
SMALL_NODE = 32 * 2**30
"""Too small for the engine's requests plus a 100Gi L1."""


def decide(obj: dict[str, Any], inputs: WorkloadInputs) -> Decision:
    """The decision for ``obj`` read as the reconciler reads it."""
    return decide_workload(read_workload(obj), inputs)


def workload(deleting: bool = False, template_injected: bool = False, **annotations: str) -> dict[str, Any]:
    obj = deployment(annotations=annotations)
    if deleting:
        obj["metadata"]["deletionTimestamp"] = "2026-11-30T14:22:16Z"
    if template_injected:
        template_label = {"f:spec": {"f:template": {"f:metadata": {"f:labels": {f"f:{c.LABEL_INJECTED}": {}}}}}}
        obj["metadata"]["managedFields"].append(
            {"manager": c.FIELD_MANAGER, "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": template_label}
        )
    return obj


ON = {c.ANN_ENABLED: "true"}
NODE_MODE = {**ON, c.ANN_POLICY: "p", c.ANN_MODE: "node"}


def fingerprint_of(obj: dict[str, Any], policy_version: object = None) -> tuple[object, ...]:
    meta = obj["metadata"]
    return (meta["generation"], ours_annotations_digest(meta["annotations"]), policy_version, CLUSTER)


def kind_and_reason(decision: Decision) -> tuple[str, str | None]:
    return type(decision).__name__, decision.error.reason if isinstance(decision, Reject) else None


CASES: list[tuple[str, dict[str, Any], dict[str, Any], tuple[str, str | None]]] = [
    ("a workload being deleted is left alone, bad annotations and all",
     {"deleting": True, c.ANN_ENABLED: "yes"}, {}, ("Leave", None)),
    ("an unreadable enabled annotation is rejected", {c.ANN_ENABLED: "yes"}, {}, ("Reject", "invalid_settings")),
    ("a workload without the enabled annotation is removed (nothing to remove is the writer's noop)",
     {}, {}, ("Remove", None)),
    ("an opted-out workload is removed even with bad settings", {c.ANN_ENABLED: "false", c.ANN_CPU_CACHE_SIZE: "lots"},
     {}, ("Remove", None)),
    ("an opted-in workload with valid settings is injected", ON, {}, ("Inject", None)),
    ("bad settings are rejected", {**ON, c.ANN_CPU_CACHE_SIZE: "lots"}, {}, ("Reject", "invalid_settings")),
    ("a policy that does not exist is rejected", {**ON, c.ANN_POLICY: "p"}, {}, ("Reject", "policy_missing")),
    ("a policy that exists is used", {**ON, c.ANN_POLICY: "p"}, {"policy": lambda namespace, name: POLICY}, ("Inject", None)),
    ("node mode is refused where the operator runs without it", NODE_MODE, {"policy": lambda namespace, name: POLICY},
     ("Reject", "unsupported")),
    ("node mode is injected where the operator runs it", NODE_MODE, {"policy": lambda namespace, name: POLICY, "node_mode": True},
     ("Inject", None)),
    ("a pod that fits no GPU node is rejected", {**ON, c.ANN_CPU_CACHE_SIZE: "100Gi"},
     {"largest_gpu_node_memory": lambda: SMALL_NODE}, ("Reject", "no_node_fits")),
    ("the fit is not checked where no GPU node is known", {**ON, c.ANN_CPU_CACHE_SIZE: "100Gi"}, {},
     ("Inject", None)),
    ("bad settings win over node mode being off", {**ON, c.ANN_MODE: "node", c.ANN_BACKEND: "nope"}, {},
     ("Reject", "invalid_settings")),
    ("bad settings win over the fit", {**ON, c.ANN_BACKEND: "nope", c.ANN_CPU_CACHE_SIZE: "100Gi"},
     {"largest_gpu_node_memory": lambda: SMALL_NODE}, ("Reject", "invalid_settings")),
]  # fmt: skip


@pytest.mark.parametrize(("annotations", "inputs", "expected"), [case[1:] for case in CASES],
                         ids=[case[0] for case in CASES])  # fmt: skip
def test_each_question_of_a_pass_has_one_answer(
    annotations: dict[str, Any], inputs: dict[str, Any], expected: tuple[str, str | None]
) -> None:
    deleting = bool(annotations.pop("deleting", False))
    decision = decide(workload(deleting, **annotations), replace(INPUTS, **inputs))
    assert kind_and_reason(decision) == expected, decision


def held_by_kvoffload(obj: dict[str, Any], fields_v1: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["managedFields"].append(
        {"manager": c.FIELD_MANAGER, "operation": "Apply", "fieldsType": "FieldsV1", "fieldsV1": fields_v1}
    )
    return obj


RECORD_FIELD = {"f:metadata": {"f:annotations": {f"f:{c.ANN_INJECTION_RECORD}": {}}}}


@pytest.mark.parametrize("annotations", [{}, ON, {c.ANN_ENABLED: "false"}, {c.ANN_ENABLED: "yes"}],
                         ids=["no opt-in", "opted in", "opted out", "unreadable opt-in"])  # fmt: skip
def test_a_record_kvoffload_did_not_write_is_rejected_before_any_removal_or_injection(
    annotations: dict[str, str],
) -> None:
    """Nothing is written to it (a removal or an apply would fail on it, again at every retry): one
    Warning per annotation set (the Reject's state)."""
    obj = held_by_kvoffload(workload(**annotations, **{c.ANN_INJECTION_RECORD: "forged"}), RECORD_FIELD)
    decision = decide(obj, replace(INPUTS, foreign=foreign_record))
    assert kind_and_reason(decision) == ("Reject", "foreign_record"), decision
    assert isinstance(decision, Reject) and decision.state == ours_annotations_digest(obj["metadata"]["annotations"])


def test_inputs_already_reconciled_are_left_unless_forced() -> None:
    obj = workload(**ON)
    done = replace(INPUTS, done=frozenset({fingerprint_of(obj)}))
    assert decide(obj, done) == Leave()
    assert isinstance(decide(obj, replace(done, force=True)), Inject)


def test_in_admission_mode_a_workload_just_created_waits_for_its_controllers_first_status() -> None:
    """An apply before that status write is refused (409) and sent again (issue 46, item 5)."""
    obj = workload(**ON)
    del obj["status"]
    admission = replace(INPUTS, cluster=ClusterInfo(True, injection="admission"))
    assert decide(obj, admission) == Leave()
    assert isinstance(decide(obj, replace(admission, force=True)), Inject)  # a resync does not wait
    assert isinstance(decide(obj, INPUTS), Inject)  # template mode: an early apply may spare a rollout
    obj["status"] = {"observedGeneration": 1}
    assert isinstance(decide(obj, admission), Inject)


def test_a_new_generation_or_policy_version_is_not_already_reconciled() -> None:
    obj = workload(**{**ON, c.ANN_POLICY: "p"})
    done = replace(INPUTS, policy=lambda namespace, name: POLICY, done=frozenset({fingerprint_of(obj, "6")}))
    decision = decide(obj, done)
    assert isinstance(decision, Inject) and decision.fingerprint == fingerprint_of(obj, "7")


def test_a_rejection_dedupes_on_the_inputs_it_was_decided_from() -> None:
    unreadable = workload(**{c.ANN_ENABLED: "yes"})
    decision = decide(unreadable, INPUTS)
    assert isinstance(decision, Reject)
    assert decision.state == ours_annotations_digest(unreadable["metadata"]["annotations"])
    bad = workload(**{**ON, c.ANN_CPU_CACHE_SIZE: "lots"})
    decision = decide(bad, INPUTS)
    digest = ours_annotations_digest(bad["metadata"]["annotations"])
    assert isinstance(decision, Reject) and decision.state == f"1/{digest}/None"


@pytest.mark.parametrize(
    ("injection", "injected", "hand_back"),
    [("admission", True, True), ("admission", False, False), ("template", True, False)],
)
def test_admission_mode_hands_a_template_injected_by_template_mode_back_first(
    injection: str, injected: bool, hand_back: bool
) -> None:
    inputs = replace(INPUTS, cluster=replace(CLUSTER, injection=injection))
    decision = decide(workload(template_injected=injected, **ON), inputs)
    assert isinstance(decision, Inject) and decision.hand_back_template is hand_back


def unread(*_: object) -> Any:
    raise AssertionError("read although the answer does not depend on it")


@pytest.mark.parametrize(
    ("annotations", "deleting"),
    [(ON, True), ({c.ANN_ENABLED: "false"}, False), ({c.ANN_ENABLED: "yes"}, False), ({}, False)],
)
def test_a_pass_that_ends_before_opting_in_reads_neither_the_policy_nor_the_nodes_nor_the_options(
    annotations: dict[str, str], deleting: bool
) -> None:
    inputs = replace(INPUTS, policy=unread, largest_gpu_node_memory=unread, options=unread)
    assert not isinstance(decide(workload(deleting, **annotations), inputs), Inject)


def test_the_nodes_are_read_only_for_settings_that_passed_every_earlier_check() -> None:
    no_nodes = replace(INPUTS, largest_gpu_node_memory=unread)
    obj = workload(**ON)
    assert decide(obj, replace(no_nodes, done=frozenset({fingerprint_of(obj)}))) == Leave()
    assert isinstance(decide(workload(**{**ON, c.ANN_CPU_CACHE_SIZE: "lots"}), no_nodes), Reject)
    assert isinstance(decide(workload(**NODE_MODE), replace(no_nodes, policy=lambda namespace, name: POLICY)), Reject)


def test_an_injection_carries_its_plan_whose_engine_env_names_the_cache_server() -> None:
    decision = decide(workload(**ON), INPUTS)
    assert isinstance(decision, Inject)
    env = {e["name"]: e.get("value") for e in decision.plan.engine_env}
    assert env[c.ENV_SERVER_URL] == c.server_url(c.REQUEST_PORT)
    assert decision.plan.engine.name == "trtllm"


def options_workload() -> dict[str, Any]:
    engine = container(options_file="/etc/trtllm/options.yaml")
    engine["volumeMounts"] = [{"name": "opts", "mountPath": "/etc/trtllm"}]
    volume = {"name": "opts", "configMap": {"name": "llm-options"}}
    return deployment(containers=[engine], volumes=[volume], annotations=ON)


def test_the_users_options_configmap_is_read_through_the_reader_and_a_missing_one_is_a_rejection() -> None:
    asked: list[tuple[str, MergeFromConfigMap | None]] = []

    def missing(ref: WorkloadRef, source: MergeFromConfigMap | None) -> None:
        asked.append((ref.name, source))

    decision = decide(options_workload(), replace(INPUTS, options=missing))
    assert isinstance(decision, Reject) and decision.error.reason == "options_missing"
    assert asked == [("llama", MergeFromConfigMap("llm-options", "options.yaml", "/etc/trtllm/options.yaml"))]
    decision = decide(options_workload(), replace(INPUTS, options=lambda ref, source: {
        "data": {"options.yaml": "max_batch_size: 8\n"}}))  # fmt: skip
    assert isinstance(decision, Inject) and "max_batch_size: 8" in decision.plan.options_text
    asked.clear()
    assert isinstance(decide(workload(**ON), replace(INPUTS, options=missing)), Inject)
    assert asked == [("llama", None)]  # told of a plan without a source: its ConfigMap, if any, is not tracked


ADMISSION_EXCLUDING = replace(CLUSTER, injection="admission", webhook_excluded_namespaces=frozenset({"kube-system"}))


def test_an_opted_in_workload_where_the_webhook_is_never_called_is_refused_not_labelled() -> None:
    obj = workload(**ON)
    obj["metadata"]["namespace"] = "kube-system"
    decision = decide(obj, replace(INPUTS, cluster=ADMISSION_EXCLUDING))
    assert isinstance(decision, Reject) and decision.error.reason == "outside_webhook_scope"
    assert "kube-system" in decision.error.message


def test_the_webhooks_scope_does_not_bind_template_mode_or_other_namespaces() -> None:
    obj = workload(**ON)
    assert isinstance(decide(obj, replace(INPUTS, cluster=ADMISSION_EXCLUDING)), Inject)
    obj["metadata"]["namespace"] = "kube-system"
    excluded_in_template_mode = replace(CLUSTER, webhook_excluded_namespaces=frozenset({"kube-system"}))
    assert isinstance(decide(obj, replace(INPUTS, cluster=excluded_in_template_mode)), Inject)
