"""A workload that arrives already opted in (what a GitOps tool creates) rolls once: at its CREATE
the webhook puts into its template the label the operator would write, and its first pods, created
before the operator has written the record, are injected from the same plan computed at admission.
The operator's apply then finds the label in place (same value: no template change, no rollout).

Only sidecar-mode workloads whose plan needs nothing the webhook cannot read are planned here;
anything else (node mode, a refused setting, a policy that is not there) is left to the operator as
before, at the cost of the second rollout.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvoffload.operator.admission.workload_updates import template_label_patch
from kvoffload.operator.api.kube import Kube, KubeApiError, policy_path
from kvoffload.operator.api.options_reader import options_reader
from kvoffload.operator.intent.options_sources import OptionsSources
from kvoffload.operator.intent.settings import OperatorDefaults, enabled_state, policy_name, resolve_settings
from kvoffload.operator.intent.workload import read_workload
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan, plan_workload
from kvoffload.operator.plan.injection_record import InjectionRecord, record_of
from kvoffload.operator.plan.workload_apply import render_admission
from kvoffload.policy_values import PolicyError

Planner = Callable[[Mapping[str, Any]], "InjectionPlan | str"]
"""A workload as it is created -> the plan the operator would make for it, or why there is none."""


def planner(kube: Kube, defaults: OperatorDefaults, cluster: ClusterInfo) -> Planner:
    """The operator's own planning, reading the policy and the options ConfigMap from the API."""

    def plan(obj: Mapping[str, Any]) -> InjectionPlan | str:
        workload = read_workload(obj)
        annotations = workload.annotations
        if enabled_state(annotations) is not True:
            return "not opted in"
        namespace = workload.ref.namespace
        name = policy_name(annotations)
        policy = None
        if isinstance(name, str):
            try:
                policy = kube.get(policy_path(namespace, name))
            except KubeApiError as exc:
                return f"reading KVCachePolicy {name} failed: {exc}"
            if policy is None:
                return f"KVCachePolicy {name} is not there"
        settings = resolve_settings(annotations, policy, defaults, namespace)
        if isinstance(settings, PolicyError):
            return settings.message
        if settings.mode != "sidecar":
            return f"mode {settings.mode} is planned by the operator"
        planned = plan_workload(workload, settings, cluster, options_reader(kube, OptionsSources()))
        return planned.message if isinstance(planned, PolicyError) else planned

    return plan


def label_for_new_workload(workload: Mapping[str, Any], plan: InjectionPlan) -> list[dict[str, Any]]:
    """JSON patch adding the template label the operator's apply will carry (nothing else)."""
    return template_label_patch(workload, render_admission(plan).config_hash)


def record_before_the_operator(workload: Mapping[str, Any], pod_label: str | None, plan: Planner
                               ) -> InjectionRecord | str:  # fmt: skip
    """For a pod of a workload the operator has not written a record on yet: the record of the
    plan made now, if its hash is the one in the pod's label (the label the webhook put in at the
    workload's creation); else why not."""
    planned = plan(workload)
    if isinstance(planned, str):
        return planned
    if render_admission(planned).config_hash != pod_label:
        return "the pod's label is not the hash of the plan made now"
    return record_of(planned)
