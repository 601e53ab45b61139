"""The user's own TensorRT-LLM options on the real apiserver: edits of their ConfigMap reach the
workload within seconds (one rollout), and settings TensorRT-LLM refuses with a connector get a
KvoffloadInvalid Warning naming the setting while the workload stays untouched."""

from __future__ import annotations

import time
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import apply, get, trtllm_container, trtllm_deployment, wait_for
from kvoffload import contract as c
from tests.support.operator_support import OperatorProcess, events_for, is_injected, wait_injected

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]


def workload_with_options(cluster: LocalCluster, namespace: str, name: str, options: str) -> None:
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-options", "namespace": namespace},
                    "data": {"extra.yaml": options}})  # fmt: skip
    engine = trtllm_container(options_file="/config/extra.yaml")
    engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config"}]
    apply(cluster, trtllm_deployment(name, namespace, replicas=0, containers=[engine], annotations={c.ANN_ENABLED: "true"},
                                     volumes=[{"name": "cfg", "configMap": {"name": f"{name}-options"}}]))  # fmt: skip


def merged_options(cluster: LocalCluster, namespace: str, name: str) -> str:
    return str(get(cluster, "configmap", name + c.GENERATED_CONFIGMAP_SUFFIX, namespace)["data"][c.TRTLLM_OPTIONS_FILE])


def test_an_edit_of_the_users_options_configmap_reaches_the_workload_in_seconds_with_one_rollout(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    workload_with_options(cluster, namespace, "opts", "max_batch_size: 8\n")
    wait_injected(cluster, "deployment", "opts", namespace)
    wait_for(lambda: "max_batch_size: 8" in merged_options(cluster, namespace, "opts"), 30, what="first merge")
    time.sleep(2)
    before = get(cluster, "deployment", "opts", namespace)["metadata"]["generation"]
    edited = time.monotonic()
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "opts-options", "namespace": namespace},
                    "data": {"extra.yaml": "max_batch_size: 16\n"}})  # fmt: skip
    wait_for(lambda: "max_batch_size: 16" in merged_options(cluster, namespace, "opts"), 15,
             what="the edit merged into the generated options file")  # fmt: skip
    assert time.monotonic() - edited < 15  # the periodic resync is off in tests: only the 2 s check can do it
    time.sleep(3)
    assert get(cluster, "deployment", "opts", namespace)["metadata"]["generation"] == before + 1, "exactly one rollout"


@pytest.mark.parametrize(
    ("options", "setting"),
    [
        ("kv_cache_config:\n  enable_block_reuse: false\n", "kv_cache_config.enable_block_reuse"),
        ("kv_connector_config:\n  connector_module: kvbm.trtllm\n", "kv_connector_config"),
        ("scheduler_config:\n  capacity_scheduler_policy: MAX_UTILIZATION\n", "scheduler_config.capacity_scheduler_policy"),
    ],
)  # fmt: skip
def test_options_tensorrt_llm_refuses_with_a_connector_get_a_warning_and_leave_the_workload_alone(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess, options: str, setting: str
) -> None:
    workload_with_options(cluster, namespace, "refused", options)
    events: list[dict[str, Any]] = wait_for(lambda: events_for(cluster, namespace, "refused", "KvoffloadInvalid"),
                                            30, what="a KvoffloadInvalid Warning")  # fmt: skip
    assert f"{setting}: " in events[0]["message"] and events[0]["type"] == "Warning", events[0]["message"]
    dep = get(cluster, "deployment", "refused", namespace)
    assert not is_injected(dep) and dep["metadata"]["generation"] == 1
    assert c.FIELD_MANAGER not in {m.get("manager") for m in dep["metadata"].get("managedFields", [])}
