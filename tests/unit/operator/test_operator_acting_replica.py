"""Every replica plans at admission with the Lease holder's published inputs
(``admission.acting_replica``), or not at all: one of other defaults (the new operator of a
``helm upgrade`` waiting for the Lease), answering a user's write or a new app's CREATE, plans as the
holder does; one of another version, or while nobody holds the Lease, keeps what is stored."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import pytest

from hack.workloads import trtllm_deployment
from kvoffload import contract as c
from kvoffload.operator.admission.acting_replica import (
    NOT_ACTING,
    forwarding_address,
    plan_as_holder,
    planning_inputs,
    read_planning_inputs,
)
from kvoffload.operator.admission.new_workloads import Planner
from kvoffload.operator.admission.review import WorkloadReview
from kvoffload.operator.admission.webhook import review_workload
from kvoffload.operator.admission.workload_updates import label_value, record_value, review_update
from kvoffload.operator.intent.settings import OperatorDefaults
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan
from tests.unit.operator.test_operator_workload_updates import injected, patched, plan_with

pytestmark = pytest.mark.operator
CLUSTER = ClusterInfo(native_sidecars=True, injection="admission", webhook_excluded_namespaces=frozenset({"a"}))


def published(l1_gib: int, cluster: ClusterInfo = CLUSTER) -> str:
    """What an operator with ``l1_gib`` of L1 by default publishes in the Lease."""
    return planning_inputs(OperatorDefaults(l1_bytes=l1_gib * 2**30), cluster)


def planner_for(defaults: OperatorDefaults, _cluster: ClusterInfo) -> Planner:
    """This replica's planning with the given inputs (``plan_with`` their L1 size)."""
    return plan_with(defaults.l1_bytes // 2**30)


OWN = "this replica's own inputs"


def never(_workload: Mapping[str, Any]) -> InjectionPlan | str:
    raise AssertionError("planned with this replica's own inputs, not the holder's")


def holder(inputs: str | None) -> Callable[[], str | None]:
    return lambda: inputs


def users_set_env(workload: dict[str, Any]) -> dict[str, Any]:
    """``kubectl set env`` on the engine container: a template change that alters no plan input of
    kvoffload's but the template itself."""
    new = copy.deepcopy(workload)
    new["spec"]["template"]["spec"]["containers"][0].setdefault("env", []).append({"name": "APP_ROUND", "value": "1"})
    return new


def test_a_replica_without_the_lease_plans_a_users_write_with_the_holders_inputs() -> None:
    """The new operator waiting for the Lease (5 GiB defaults) answers a user's write to a workload
    the acting one (4 GiB) injected: the write keeps the 4 GiB record and label."""
    current = injected(4)
    new = users_set_env(current)
    answer = review_update(
        current, new, "kubectl-client-side-apply", plan_as_holder(never, OWN, planner_for, holder(published(4)))
    )
    after = patched(new, answer.patch)
    assert (record_value(after), label_value(after)) == (record_value(current), label_value(current))


def test_the_holders_next_settings_reach_a_users_write_through_any_replica() -> None:
    current = injected(4)
    new = users_set_env(current)
    answer = review_update(
        current, new, "kubectl-client-side-apply", plan_as_holder(never, OWN, planner_for, holder(published(5)))
    )
    after = patched(new, answer.patch)
    assert (record_value(after), label_value(after)) == (record_value(injected(5)), label_value(injected(5)))


def test_a_new_workload_answered_by_any_replica_gets_the_holders_label_and_without_a_holder_none() -> None:
    """A CREATE gets the label the holder's own webhook would give it (so its first template is the
    one the holder's apply keeps: one rollout); while nobody holds the Lease it is admitted as written."""
    workload = trtllm_deployment("llm", "ns", replicas=2, annotations={c.ANN_ENABLED: "true"})
    review = WorkloadReview(uid="u", namespace="ns", kind="Deployment", workload=workload)
    assert review_workload(review, plan_as_holder(never, OWN, planner_for, holder(None)), lambda *_: None).patch == []
    by_holder = review_workload(review, plan_with(4), lambda *_: None)
    by_other = review_workload(review, plan_as_holder(never, OWN, planner_for, holder(published(4))), lambda *_: None)
    assert by_other.result == "injected" and by_other.patch == by_holder.patch


def test_a_holder_of_another_version_or_unreadable_inputs_means_no_plan() -> None:
    other_version = dataclasses.replace(CLUSTER, operator_version="0.0.1")
    for inputs in (published(4, other_version), "a digest of an earlier release", '{"defaults": {"no_such": 1}}'):
        planned = plan_as_holder(never, OWN, planner_for, holder(inputs))(injected(4))
        assert isinstance(planned, str) and planned.startswith(NOT_ACTING), planned


def test_the_lease_is_asked_at_each_review_not_once() -> None:
    inputs: list[str | None] = [None]
    plan = plan_as_holder(never, OWN, planner_for, lambda: inputs[0])
    workload = injected(4)
    assert plan(workload) == NOT_ACTING
    inputs[0] = published(5)
    assert isinstance(plan(workload), InjectionPlan)


def test_the_holder_and_a_standby_of_its_release_plan_with_their_own_planner() -> None:
    plan = plan_as_holder(plan_with(4), OWN, planner_for, holder(OWN))
    assert isinstance(plan(injected(4)), InjectionPlan)


def test_published_inputs_read_back_as_they_were_and_name_the_version() -> None:
    defaults = OperatorDefaults(l1_bytes=4 * 2**30, runtime_class_name="nvidia", spec={"cache": {"chunkSize": 512}})
    assert read_planning_inputs(planning_inputs(defaults, CLUSTER)) == (defaults, CLUSTER)
    assert planning_inputs(defaults, CLUSTER) == planning_inputs(defaults, copy.deepcopy(CLUSTER))
    assert planning_inputs(defaults, CLUSTER) != published(5), "a helm upgrade changing a default"


def test_a_replica_of_another_version_forwards_to_the_holders_webhook_and_one_of_its_version_plans_itself() -> None:
    other_version = published(4, dataclasses.replace(CLUSTER, operator_version="0.0.1"))
    assert forwarding_address(other_version, "10.0.0.7:8443", OWN) == "10.0.0.7:8443"
    assert forwarding_address("a digest of an earlier release", "10.0.0.7:8443", OWN) == "10.0.0.7:8443"
    assert forwarding_address(published(5), "10.0.0.7:8443", OWN) is None, "same version: plans with them"
    assert forwarding_address(OWN, "10.0.0.7:8443", OWN) is None, "a standby of the holder's release"
    assert forwarding_address(other_version, None, OWN) is None, "no address published"
    assert forwarding_address(None, "10.0.0.7:8443", OWN) is None, "nobody holds the Lease"
