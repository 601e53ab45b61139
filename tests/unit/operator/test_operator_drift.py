"""The resync's drift check: a live object carries an apply body, or the apply must be sent."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
from kvoffload.operator.plan.drift import carries, object_carries
from kvoffload.operator.plan.fragment import ClusterInfo, render_injection_fragment
from tests.unit.operator.workload_builders import applied, deployment

pytestmark = pytest.mark.operator


def merged(live: Any, body: Any) -> Any:
    """Roughly what Server-Side Apply stores: the body merged into the live object by list-map keys."""
    if isinstance(body, dict) and isinstance(live, dict):
        out = dict(live)
        for key, value in body.items():
            out[key] = merged(live.get(key), value) if key in live else copy.deepcopy(value)
        return out
    if isinstance(body, list) and isinstance(live, list) and body and all(isinstance(i, dict) for i in body):
        out_list = list(live)
        for item in body:
            name = item.get("name", item.get("mountPath", item.get("containerPort")))
            index = next((i for i, x in enumerate(out_list) if isinstance(x, dict)
                          and name in (x.get("name"), x.get("mountPath"), x.get("containerPort"))), None)  # fmt: skip
            if index is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[index] = merged(out_list[index], item)
        return out_list
    return copy.deepcopy(body)


def injected() -> tuple[dict[str, Any], dict[str, Any]]:
    """(apply body, live object after the apply plus fields the apiserver defaults)."""
    obj = deployment(annotations={c.ANN_ENABLED: "true"})
    settings = resolve_settings(obj["metadata"]["annotations"], None, OperatorDefaults(), "ns")
    assert isinstance(settings, InjectionSettings)
    rendered = render_injection_fragment(obj, settings, ClusterInfo(True), None)
    assert not isinstance(rendered, type(None)) and hasattr(rendered, "workload_apply")
    live = applied(obj, rendered.workload_apply)
    for container in live["spec"]["template"]["spec"]["containers"]:  # apiserver defaults are extra fields
        container["terminationMessagePath"] = "/dev/termination-log"
    live["status"] = {"replicas": 1, "observedGeneration": live["metadata"]["generation"]}
    return rendered.workload_apply, live


def test_a_live_object_with_the_applied_fragment_and_defaults_carries_it() -> None:
    body, live = injected()
    assert object_carries(body, live)


def test_a_deleted_sidecar_a_changed_env_value_or_a_changed_hash_is_drift() -> None:
    body, live = injected()
    spec = live["spec"]["template"]["spec"]
    gone = copy.deepcopy(live)
    gone["spec"]["template"]["spec"]["initContainers"] = [
        x for x in spec["initContainers"] if x["name"] != c.SIDECAR_CONTAINER
    ]
    assert not object_carries(body, gone)
    edited = copy.deepcopy(live)
    sidecar = next(x for x in edited["spec"]["template"]["spec"]["initContainers"] if x["name"] == c.SIDECAR_CONTAINER)
    next(e for e in sidecar["env"] if e["name"] == "KVOFFLOAD_L1_SIZE")["value"] = "1Gi"
    assert not object_carries(body, edited)
    rehashed = copy.deepcopy(live)
    rehashed["spec"]["template"]["metadata"]["annotations"][c.ANN_CONFIG_HASH] = "0" * 16
    assert not object_carries(body, rehashed)


def test_lists_of_scalars_are_atomic_and_list_maps_match_by_key() -> None:
    assert carries({"args": ["--a", "--b"]}, {"args": ["--a", "--b"], "x": 1})
    assert not carries({"args": ["--a", "--b"]}, {"args": ["--b", "--a"]})
    assert not carries({"args": ["--a"]}, {"args": ["--a", "--user-flag"]})
    ports = [{"containerPort": 80, "protocol": "TCP"}, {"containerPort": 9455, "protocol": "TCP", "name": "m"}]
    assert carries({"ports": [{"containerPort": 9455, "name": "m"}]}, {"ports": ports})
    assert not carries({"ports": [{"containerPort": 9455, "name": "other"}]}, {"ports": ports})
    assert carries(
        {"env": [{"name": "A", "value": "1"}]}, {"env": [{"name": "B", "value": "2"}, {"name": "A", "value": "1"}]}
    )
    assert not carries({"env": [{"name": "A", "value": "1"}]}, {"env": [{"name": "A", "value": "2"}]})


def test_a_missing_object_or_a_missing_key_never_carries() -> None:
    assert not object_carries({"apiVersion": "v1", "kind": "ConfigMap", "data": {"k": "v"}}, None)
    assert not carries({"data": {"k": "v"}}, {"data": {}})
    assert not carries({"emptyDir": {}}, {})
    assert carries({"emptyDir": {}}, {"emptyDir": {"sizeLimit": "1Gi"}})


def test_a_resync_or_a_restart_without_drift_sends_no_write_and_one_with_drift_applies() -> None:
    from kvoffload.operator.api.kube import configmap_path
    from kvoffload.operator.plan.fragment import configmap_name
    from tests.unit.operator.test_operator_reconcile import FakeKube, reconciler, workload_applies

    kube = FakeKube()
    r, _ = reconciler(kube)
    obj = deployment(annotations={c.ANN_ENABLED: "true"})
    assert r.reconcile(obj) == "applied"
    (cm_apply,) = [path for op, path, _ in kube.calls if "/configmaps/" in path]
    _body, live = injected()
    kube.objects[configmap_path("ns", configmap_name("llama"))] = {"metadata": {}, "data": {}}
    assert r.reconcile(live, force=True) == "applied"  # the ConfigMap lost its data: drift
    calls = len(kube.calls)
    settings = resolve_settings(obj["metadata"]["annotations"], None, OperatorDefaults(), "ns")
    assert isinstance(settings, InjectionSettings)
    rendered = render_injection_fragment(live, settings, ClusterInfo(True), None)
    kube.objects[configmap_path("ns", configmap_name("llama"))] = merged({}, rendered.configmap_apply)  # type: ignore[union-attr]
    assert r.reconcile(live, force=True) == "unchanged"
    assert len(kube.calls) == calls and cm_apply and len(workload_applies(kube)) == 2
    restarted, _ = reconciler(kube)  # an operator that starts sees every workload once, no cache
    assert restarted.reconcile(live) == "unchanged"
    assert len(kube.calls) == calls


def test_the_event_of_the_operators_own_apply_and_late_events_of_the_old_generation_are_no_ops() -> None:
    from tests.unit.operator.test_operator_reconcile import FakeKube, reconciler, workload_applies

    obj = deployment(annotations={c.ANN_ENABLED: "true"})

    class ApplyingKube(FakeKube):
        """Answers a workload apply with the object as the apiserver would store it."""

        def apply(self, path: str, body: Any, field_manager: str, force: bool = False) -> dict[str, Any]:
            super().apply(path, body, field_manager, force)
            if "/configmaps/" in path:
                return dict(body)
            stored = applied(obj, dict(body))
            stored["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
            return stored

    kube = ApplyingKube()
    r, _ = reconciler(kube)
    assert r.reconcile(obj) == "applied"
    answer_generation = obj["metadata"].get("generation", 1) + 1
    own_event = applied(obj, kube_body(kube, obj))
    own_event["metadata"]["generation"] = answer_generation
    assert r.reconcile(own_event) == "noop"
    assert r.reconcile(obj) == "noop"  # a status event of the old generation, delivered late
    assert len(workload_applies(kube)) == 1


def kube_body(kube: Any, obj: dict[str, Any]) -> dict[str, Any]:
    settings = resolve_settings(obj["metadata"]["annotations"], None, OperatorDefaults(), "ns")
    assert isinstance(settings, InjectionSettings)
    rendered = render_injection_fragment(obj, settings, ClusterInfo(True), None)
    return rendered.workload_apply  # type: ignore[union-attr,no-any-return]
