"""What planning a workload reads from the cluster besides the workload: the user's options
ConfigMap (``options_reader``); and the plan again for the object an apply returned (``replan``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvoffload.operator.admission.records import render_for
from kvoffload.operator.api.kube import Kube, configmap_path
from kvoffload.operator.intent.options_sources import OptionsSources
from kvoffload.operator.intent.trtllm_options import MergeFromConfigMap
from kvoffload.operator.intent.workload import WorkloadRef, read_workload
from kvoffload.operator.plan.fragment import RenderedInjection
from kvoffload.operator.plan.injection_plan import InjectionPlan, OptionsReader, choose_engine, plan_injection
from kvoffload.policy_values import PolicyError


def options_reader(kube: Kube, sources: OptionsSources) -> OptionsReader:
    """Reads a workload's options ConfigMap through the API, and notes in ``sources`` which
    ConfigMap each workload merges and the version seen (an edit re-renders the workload)."""

    def read(workload: WorkloadRef, source: MergeFromConfigMap | None) -> Mapping[str, Any] | None:
        sources.track(workload, source.configmap if source else None)  # before the fetch: it may not exist yet
        if source is None:
            return None
        configmap = kube.get(configmap_path(workload.namespace, source.configmap))
        version = ((configmap or {}).get("metadata") or {}).get("resourceVersion")
        sources.saw(workload.namespace, source.configmap, version)
        return configmap

    return read


def replan(answer: Mapping[str, Any], plan: InjectionPlan) -> RenderedInjection | PolicyError:
    """The fragment for the object an apply returned, with the same settings and options file."""
    workload = read_workload(answer)
    engine = choose_engine(workload, plan.settings)
    if isinstance(engine, PolicyError):
        return engine
    again = plan_injection(workload, plan.settings, plan.cluster, engine, plan.user_options_yaml, plan.node_cache)
    return again if isinstance(again, PolicyError) else render_for(again)
