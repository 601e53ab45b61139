"""A Deployment UPDATE at admission, pure (``workload_updates.review_update``): which writes keep
kvoffload's record and label, with which values, held by whom."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from hack.workloads import trtllm_deployment
from kvoffload import contract as c
from kvoffload.operator.admission.workload_updates import (
    LABEL_PATH,
    RECORD_PATH,
    label_value,
    record_value,
    review_update,
)
from kvoffload.operator.intent.managed_fields import owners
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.workload import read_workload
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan, choose_engine, plan_injection
from kvoffload.operator.plan.workload_apply import render_admission

OURS = {"f:metadata": {"f:annotations": {f"f:{c.ANN_INJECTION_RECORD}": {}}},
        "f:spec": {"f:template": {"f:metadata": {"f:labels": {f"f:{c.LABEL_INJECT}": {}}}}}}  # fmt: skip
USERS = {"f:metadata": {"f:annotations": {f"f:{c.ANN_ENABLED}": {}}}, "f:spec": {"f:replicas": {}}}


def plan_with(l1_gib: int) -> Callable[[Mapping[str, Any]], InjectionPlan | str]:
    def plan(workload: Mapping[str, Any]) -> InjectionPlan | str:
        settings = InjectionSettings(l1_bytes=l1_gib * 2**30)
        read = read_workload(workload)
        engine = choose_engine(read, settings)
        assert not isinstance(engine, str)
        planned = plan_injection(read, settings, ClusterInfo(native_sidecars=True, injection="admission"),
                                 engine)  # type: ignore[arg-type]  # fmt: skip
        assert isinstance(planned, InjectionPlan)
        return planned

    return plan


def injected(l1_gib: int) -> dict[str, Any]:
    """A Deployment the operator injected with ``l1_gib`` of L1, as the apiserver holds it."""
    workload = trtllm_deployment("llm", "ns", replicas=2, annotations={c.ANN_ENABLED: "true"})
    rendered = render_admission(plan_with(l1_gib)(workload))  # type: ignore[arg-type]
    workload["metadata"]["annotations"][c.ANN_INJECTION_RECORD] = rendered.workload_apply["metadata"]["annotations"][
        c.ANN_INJECTION_RECORD
    ]
    workload["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT] = rendered.config_hash
    workload["metadata"]["managedFields"] = [
        {"manager": "kubectl-client-side-apply", "operation": "Update", "apiVersion": "apps/v1",
         "fieldsType": "FieldsV1", "fieldsV1": copy.deepcopy(USERS)},
        {"manager": c.FIELD_MANAGER, "operation": "Apply", "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
         "fieldsV1": copy.deepcopy(OURS)},
    ]  # fmt: skip
    return workload


def undone(current: dict[str, Any], older: dict[str, Any]) -> dict[str, Any]:
    """``kubectl rollout undo``'s write: the older record and label, taken by ``kubectl-rollout``."""
    new = copy.deepcopy(current)
    new["metadata"]["annotations"][c.ANN_INJECTION_RECORD] = record_value(older)
    new["spec"]["template"]["metadata"]["labels"][c.LABEL_INJECT] = label_value(older)
    new["metadata"]["managedFields"] = [
        copy.deepcopy(new["metadata"]["managedFields"][0]),
        {"manager": "kubectl-rollout", "operation": "Update", "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
         "fieldsV1": copy.deepcopy(OURS)},
    ]  # fmt: skip
    return new


def patched(obj: Mapping[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """``patch`` (add/replace operations only) applied to ``obj``."""
    result = copy.deepcopy(dict(obj))
    for op in patch:
        assert op["op"] in ("add", "replace"), op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = result
        for part in parents:
            node = node[part]
        node[last] = copy.deepcopy(op["value"])
    return result


def never(_workload: Mapping[str, Any]) -> InjectionPlan | str:
    raise AssertionError("planned a write that changed no plan input")


def test_a_rollout_undo_keeps_the_current_record_and_label_held_by_kvoffload_with_a_warning() -> None:
    current, older = injected(5), injected(4)
    new = undone(current, older)
    answer = review_update(current, new, "kubectl-rollout", plan_with(5))
    assert answer.result == "injected" and "kept kvoffload's" in answer.warnings[0]
    after = patched(new, answer.patch)
    assert (record_value(after), label_value(after)) == (record_value(current), label_value(current))
    assert owners(after, RECORD_PATH) == owners(after, LABEL_PATH) == {c.FIELD_MANAGER}
    assert [m["manager"] for m in after["metadata"]["managedFields"]] == ["kubectl-client-side-apply",
                                                                          c.FIELD_MANAGER]  # fmt: skip


def test_a_template_change_that_changes_the_plan_carries_the_new_record_and_label_in_the_same_write() -> None:
    """What an args change that starts naming the options ConfigMap does: the plan of the written
    object differs from the record in place; the write gets the new one, no warning."""
    current = injected(4)
    new = copy.deepcopy(current)
    new["spec"]["template"]["spec"]["containers"][0]["image"] = "trtllm:1.2.1"
    answer = review_update(current, new, "kubectl-client-side-apply", plan_with(5))
    after = patched(new, answer.patch)
    assert answer.warnings == () and record_value(after) == record_value(injected(5))
    assert label_value(after) == label_value(injected(5)) and owners(after, LABEL_PATH) == {c.FIELD_MANAGER}


def test_no_plan_here_keeps_the_values_kvoffload_wrote() -> None:
    current, older = injected(5), injected(4)
    answer = review_update(current, undone(current, older), "kubectl-rollout", lambda _w: "mode node")
    after = patched(undone(current, older), answer.patch)
    assert (record_value(after), label_value(after)) == (record_value(current), label_value(current))


@pytest.mark.parametrize(
    "case",
    ["the operator's own apply", "the operator's hand-off", "opted out", "not injected", "scaled", "image only"],
)
def test_writes_that_keep_or_leave_kvoffloads_fields_are_admitted_as_written(case: str) -> None:
    current = injected(5)
    new, manager, plan = copy.deepcopy(current), "kubectl-client-side-apply", plan_with(5)
    if case == "the operator's own apply":
        new, manager = undone(current, injected(4)), c.FIELD_MANAGER
    elif case == "the operator's hand-off":
        new, manager = undone(current, injected(4)), c.FIELD_MANAGER_HANDOFF
    elif case == "opted out":
        new = undone(current, injected(4))
        new["metadata"]["annotations"][c.ANN_ENABLED] = "false"
    elif case == "not injected":
        current["metadata"]["managedFields"].pop()  # the record is not kvoffload's (the uninstall hook's strip)
        new = undone(current, injected(4))
    elif case == "scaled":
        new["spec"]["replicas"], plan = 3, never
    else:
        new["spec"]["template"]["spec"]["containers"][0]["image"] = "trtllm:1.2.1"
    assert review_update(current, new, manager, plan).patch == []
