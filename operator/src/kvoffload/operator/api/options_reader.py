"""What planning a workload reads from the cluster besides the workload: the user's options
ConfigMap (``options_reader``), for the control loop and the webhook alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvoffload.operator.api.kube import Kube, configmap_path
from kvoffload.operator.intent.options_sources import OptionsSources
from kvoffload.operator.intent.trtllm_options import MergeFromConfigMap
from kvoffload.operator.intent.workload import WorkloadRef

OptionsConfigMapReader = Callable[[WorkloadRef, MergeFromConfigMap | None], Mapping[str, Any] | None]
"""The shape of ``plan.injection_plan.OptionsReader``, spelled here: the API client sits beside the plan."""


def options_reader(kube: Kube, sources: OptionsSources) -> OptionsConfigMapReader:
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
