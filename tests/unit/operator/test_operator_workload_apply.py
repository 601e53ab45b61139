"""What the operator applies (``plan.workload_apply``): the object a template-mode apply returned is
recognised as a fixed point, so the event its own write raises has nothing to do; one that lost a
field, or a different hash, is not."""

from __future__ import annotations

import copy

import pytest

from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
from kvoffload.operator.intent.workload import read_workload
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan, RecordedOptions, plan_workload
from kvoffload.operator.plan.workload_apply import render_for, renders_to_itself
from tests.unit.operator.workload_builders import applied, deployment

pytestmark = pytest.mark.operator


def test_the_object_an_apply_returned_renders_to_itself_and_one_missing_a_field_does_not() -> None:
    obj = deployment(annotations={c.ANN_ENABLED: "true"})
    settings = resolve_settings(obj["metadata"]["annotations"], None, OperatorDefaults(), "ns")
    assert isinstance(settings, InjectionSettings)
    plan = plan_workload(read_workload(obj), settings, ClusterInfo(True), RecordedOptions())
    assert isinstance(plan, InjectionPlan)
    rendered = render_for(plan)
    answer = applied(obj, rendered.workload_apply)
    assert renders_to_itself(answer, plan, rendered.config_hash)
    assert not renders_to_itself(answer, plan, "0" * 16)
    stripped = copy.deepcopy(answer)
    stripped["spec"]["template"]["metadata"]["annotations"].clear()  # the injected annotations lost
    assert not renders_to_itself(stripped, plan, rendered.config_hash)
