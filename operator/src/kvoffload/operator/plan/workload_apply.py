"""What the operator applies to a workload, pure, in either injection mode: template mode's fragment
(``fragment.render``), or admission mode's one write (the record as an annotation of the workload and
one template label naming its hash; the pods get the rest from the webhook). The control loop applies
it; the webhook labels a new workload with the same hash.

The workload's template stays the user's in admission mode: a GitOps tool that applies its manifest,
by any apply, finds nothing to fight over. The record holds what the operator decided (settings, the
user's options file, node wiring); the pod-level parts that depend on the template (args, env,
mounts) are rendered from the pod itself at admission, so a template change rolls once, through the
webhook, with the right injection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.intent.workload import Workload, read_workload
from kvoffload.operator.plan.drift import object_carries
from kvoffload.operator.plan.fragment import RenderedInjection, render
from kvoffload.operator.plan.injection_plan import InjectionPlan, RecordedOptions, plan_workload
from kvoffload.operator.plan.injection_record import record_digest, record_of
from kvoffload.policy_values import PolicyError


def render_admission(plan: InjectionPlan) -> RenderedInjection:
    """What the operator applies in admission mode, one write: the record as an annotation of the
    workload and the template label naming the hash of the record and the files it gives the pods."""
    in_template = render(plan, files_on_pod=True)  # its warnings, and the files the pods get
    record = record_of(plan).to_json()
    digest = record_digest(in_template.files, record)
    body = plan.workload.ref.apply_body()
    body["metadata"]["annotations"] = {c.ANN_INJECTION_RECORD: record}
    body["spec"] = {"template": {"metadata": {"labels": {c.LABEL_INJECT: digest}}}}
    return RenderedInjection(
        workload_apply=body, configmap_apply=None, files=in_template.files, config_hash=digest,
        engine_container=in_template.engine_container, forceable_fields=ADMISSION_FORCEABLE,
        warnings=in_template.warnings,
    )  # fmt: skip


ADMISSION_FORCEABLE = (f".metadata.annotations.{c.ANN_INJECTION_RECORD}",
                       f".spec.template.metadata.labels.{c.LABEL_INJECT}")  # fmt: skip
"""kvoffload's own keys, taken back when another manager holds them. A write through the webhook
keeps them kvoffload's (``workload_updates``); one admitted while the webhook was not reached (say
``kubectl rollout undo`` writing an older record and label back as ``kubectl-rollout``) is answered
by the operator re-applying its current record (one more rollout) instead of leaving pods the
webhook refuses."""


def intent_in_place(workload: Workload, rendered: RenderedInjection) -> bool:
    """Whether the workload already carries the record and label an apply would write, both held
    by kvoffload's field manager: the apply would change nothing, so it is not sent."""
    return workload.holds_admission_keys and object_carries(rendered.workload_apply, workload.live)


def render_for(plan: InjectionPlan) -> RenderedInjection:
    """The apply bodies for the operator's injection mode."""
    return render_admission(plan) if plan.cluster.injection == "admission" else render(plan)


def renders_to_itself(answer: Mapping[str, Any], plan: InjectionPlan, config_hash: str) -> bool:
    """Whether the object an apply returned is a fixed point: planned again with ``plan``'s settings,
    options file and wiring it renders to ``config_hash`` and carries that rendering already (so the
    event its write raises has nothing to do)."""
    again = plan_workload(read_workload(answer), plan.settings, plan.cluster, RecordedOptions(plan.user_options_yaml),
                          plan.node_cache)  # fmt: skip
    if isinstance(again, PolicyError):
        return False
    rendered = render_for(again)
    return rendered.config_hash == config_hash and object_carries(rendered.workload_apply, answer)
