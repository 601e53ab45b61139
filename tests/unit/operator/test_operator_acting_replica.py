"""A replica plans at admission only as the Lease's holder would (``admission.acting_replica``): one
of another version or other defaults, answering the same user's write, keeps what is stored."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest

from hack.workloads import trtllm_deployment
from kvoffload import contract as c
from kvoffload.operator.admission.acting_replica import NOT_ACTING, plan_while_acting
from kvoffload.operator.admission.new_workloads import planning_digest
from kvoffload.operator.admission.review import WorkloadReview
from kvoffload.operator.admission.webhook import review_workload
from kvoffload.operator.admission.workload_updates import label_value, record_value, review_update
from kvoffload.operator.intent.settings import OperatorDefaults
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan
from tests.unit.operator.test_operator_workload_updates import injected, patched, plan_with

pytestmark = pytest.mark.operator


def users_set_env(workload: dict[str, Any]) -> dict[str, Any]:
    """``kubectl set env`` on the engine container: a template change that alters no plan input of
    kvoffload's but the template itself."""
    new = copy.deepcopy(workload)
    new["spec"]["template"]["spec"]["containers"][0].setdefault("env", []).append({"name": "APP_ROUND", "value": "1"})
    return new


def never(_workload: Mapping[str, Any]) -> InjectionPlan | str:
    raise AssertionError("a replica without the Lease planned")


def test_a_replica_without_the_lease_keeps_the_stored_record_on_a_users_write() -> None:
    """The new operator waiting for the Lease (5 GiB defaults) answers a user's write to a workload
    the acting one injected with 4 GiB: the write keeps the 4 GiB record and label."""
    current = injected(4)
    new = users_set_env(current)
    answer = review_update(current, new, "kubectl-client-side-apply", plan_while_acting(never, lambda: False))
    after = patched(new, answer.patch)
    assert (record_value(after), label_value(after)) == (record_value(current), label_value(current))


def test_the_lease_holder_plans_a_users_write_with_its_settings() -> None:
    current = injected(4)
    new = users_set_env(current)
    answer = review_update(current, new, "kubectl-client-side-apply", plan_while_acting(plan_with(5), lambda: True))
    after = patched(new, answer.patch)
    assert (record_value(after), label_value(after)) == (record_value(injected(5)), label_value(injected(5)))


def test_a_replica_without_the_lease_admits_a_new_workload_as_written() -> None:
    """No label of its own plan: the acting operator labels it (one more rollout, never two plans)."""
    workload = trtllm_deployment("llm", "ns", replicas=2, annotations={c.ANN_ENABLED: "true"})
    review = WorkloadReview(uid="u", namespace="ns", kind="Deployment", workload=workload)
    assert review_workload(review, plan_while_acting(never, lambda: False), lambda *_: None).patch == []
    labelled = review_workload(review, plan_while_acting(plan_with(5), lambda: True), lambda *_: None)
    assert labelled.result == "injected" and labelled.patch


def test_the_lease_is_asked_at_each_review_not_once() -> None:
    holds = [False]
    plan = plan_while_acting(plan_with(5), lambda: holds[0])
    workload = injected(4)
    assert plan(workload) == NOT_ACTING
    holds[0] = True
    assert isinstance(plan(workload), InjectionPlan)


def test_operators_of_the_same_release_share_a_planning_digest_and_other_defaults_or_versions_do_not() -> None:
    cluster = ClusterInfo(native_sidecars=True, injection="admission", webhook_excluded_namespaces=frozenset({"a"}))
    same = planning_digest(OperatorDefaults(l1_bytes=4 * 2**30), cluster)
    assert same == planning_digest(OperatorDefaults(l1_bytes=4 * 2**30), copy.deepcopy(cluster))
    assert same != planning_digest(OperatorDefaults(l1_bytes=5 * 2**30), cluster), "a helm upgrade changing a default"
    other_version = dataclasses.replace(cluster, operator_version="0.0.1")
    assert same != planning_digest(OperatorDefaults(l1_bytes=4 * 2**30), other_version), "an image upgrade"
