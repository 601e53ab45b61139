"""The workload is read once (``read_workload``): what the stages after it see of a live object."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import contract as c
from kvoffload.operator.api.events import EventRecorder
from kvoffload.operator.intent.managed_fields import field_owners, owners
from kvoffload.operator.intent.trtllm_options import AppendFlag, MergeFromConfigMap
from kvoffload.operator.intent.workload import WorkloadRef, read_workload
from kvoffload.operator.plan.fragment import ClusterInfo, RenderedInjection, render_injection_fragment
from tests.unit.operator.test_operator_fragment import settings_for
from tests.unit.operator.workload_builders import applied, container, deployment

pytestmark = pytest.mark.operator

NAMES = st.sampled_from(["f:spec", "f:template", "f:metadata", "f:labels", "f:a", 'k:{"name":"x"}', "."])
TREES = st.recursive(st.just({}), lambda inner: st.dictionaries(NAMES, inner, max_size=3), max_leaves=12)
MANAGERS = st.sampled_from([c.FIELD_MANAGER, "kubectl", "helm", "kube-controller-manager"])


@given(entries=st.lists(st.tuples(MANAGERS, TREES), max_size=4), probes=st.lists(st.lists(NAMES, max_size=4)))
def test_the_field_owners_read_once_answer_as_the_per_field_reader_does(
    entries: list[tuple[str, dict[str, Any]]], probes: list[list[str]]
) -> None:
    obj = {"metadata": {"managedFields": [{"manager": m, "fieldsV1": tree} for m, tree in entries]}}
    held = field_owners(obj)
    if not entries:
        assert held is None  # a manifest: everything in it is the user's
        return
    assert held is not None
    for probe in probes:
        if probe:
            assert held.get(tuple(probe), frozenset()) == owners(obj, probe), probe


def test_an_injected_workload_reads_as_the_user_wrote_it() -> None:
    user_env = [{"name": "HF_HOME", "value": "/models"}]
    engine = container()
    engine["env"] = user_env
    obj = deployment(containers=[engine])
    rendered = render_injection_fragment(obj, settings_for(), ClusterInfo(True))
    assert isinstance(rendered, RenderedInjection)
    injected = applied(obj, rendered.workload_apply)
    before, after = read_workload(obj), read_workload(injected)
    engine_before, engine_after = before.user_containers[0], after.user_containers[0]
    assert injected["spec"]["template"]["spec"]["containers"][0]["args"] != engine_before.spec["args"]
    assert engine_after.spec["args"] == engine_before.spec["args"]
    assert engine_after.spec["env"] == user_env  # kvoffload's env entries are not the user's
    assert engine_after.options == engine_before.options == AppendFlag()
    assert engine_after.we_own_args and not engine_before.we_own_args
    assert after.manages_anything and not before.manages_anything
    assert after.volumes == before.volumes  # kvoffload's volumes are not the user's


def test_an_options_file_from_a_configmap_is_read_with_its_source_and_the_model() -> None:
    options = {"name": "opts", "configMap": {"name": "llm-options"}}
    engine = container(options_file="/etc/trtllm/options.yaml")
    engine["volumeMounts"] = [{"name": "opts", "mountPath": "/etc/trtllm"}]
    workload = read_workload(deployment(containers=[engine], volumes=[options]))
    (read,) = workload.user_containers
    assert isinstance(read.options, MergeFromConfigMap) and read.options.configmap == "llm-options"
    assert read.model == "meta-llama/Llama-3.1-8B-Instruct"


class _Recorder:
    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.created.append(copy.deepcopy(body))
        return body


def test_an_event_names_the_workload_by_its_reference_and_is_posted_once_per_state() -> None:
    kube = _Recorder()
    events = EventRecorder(kube)  # type: ignore[arg-type]
    ref = read_workload({**deployment(), "metadata": {**deployment()["metadata"], "uid": "u-1",
                                                      "resourceVersion": "42"}}).ref  # fmt: skip
    events.post(ref, "Warning", "KvoffloadInvalid", "bad", "s1")
    events.post(ref, "Warning", "KvoffloadInvalid", "bad", "s1")
    events.post(WorkloadRef("Deployment", "ns", "other"), "Warning", "KvoffloadInvalid", "bad", "s1")
    assert len(kube.created) == 2
    involved = [e["involvedObject"] for e in kube.created]
    assert involved[0] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": ref.name, "namespace": "ns",
                           "uid": "u-1", "resourceVersion": "42"}  # fmt: skip
    assert involved[1]["uid"] is None and involved[1]["resourceVersion"] is None
