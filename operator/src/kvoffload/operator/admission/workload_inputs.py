"""A workload's plan with the inputs it needs from the cluster: the user's options ConfigMap."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvoffload.operator.admission.records import render_for
from kvoffload.operator.api.kube import Kube, configmap_path
from kvoffload.operator.intent.options_sources import OptionsSources
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.workload import Workload, read_workload
from kvoffload.operator.node.cache_objects import node_cache_wiring
from kvoffload.operator.plan.fragment import RenderedInjection
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan, choose_engine, plan_injection
from kvoffload.policy_values import PolicyError


def plan_for(
    kube: Kube, workload: Workload, settings: InjectionSettings, cluster: ClusterInfo, sources: OptionsSources
) -> InjectionPlan | PolicyError:
    """Choose the engine, fetch the user's options file if it lives in a ConfigMap, plan."""
    engine = choose_engine(workload, settings)
    if isinstance(engine, PolicyError):
        return engine
    user_options: str | None = None
    source = engine.user_options_source
    sources.track(workload.ref, source.configmap if source else None)  # before the fetch: it may not exist yet
    if source is not None:
        namespace = workload.ref.namespace
        cm = kube.get(configmap_path(namespace, source.configmap))
        sources.saw(namespace, source.configmap, ((cm or {}).get("metadata") or {}).get("resourceVersion"))
        user_options = ((cm or {}).get("data") or {}).get(source.key)
        if user_options is None:
            what = "does not exist" if cm is None else f"has no key {source.key!r}"
            return PolicyError(
                f"ConfigMap {source.configmap}", source.key,
                f"the TensorRT-LLM options file {source.path} comes from it but it {what}", reason="options_missing",
            )  # fmt: skip
    wiring = node_cache_wiring(workload, settings) if settings.mode == "node" else None
    if isinstance(wiring, PolicyError):
        return wiring
    return plan_injection(workload, settings, cluster, engine, user_options, wiring)


def replan(answer: Mapping[str, Any], plan: InjectionPlan) -> RenderedInjection | PolicyError:
    """The fragment for the object an apply returned, with the same settings and options file."""
    workload = read_workload(answer)
    engine = choose_engine(workload, plan.settings)
    if isinstance(engine, PolicyError):
        return engine
    again = plan_injection(workload, plan.settings, plan.cluster, engine, plan.user_options_yaml, plan.node_cache)
    return again if isinstance(again, PolicyError) else render_for(again)
