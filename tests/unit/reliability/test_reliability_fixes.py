"""Regression tests for what the reliability suite found (docs/reliability.md, "Fixed on the way")."""

from __future__ import annotations

from typing import Any

import pytest

from hack.workloads import trtllm_deployment
from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
from kvoffload.operator.plan.fragment import ClusterInfo, RenderedInjection, render_injection_fragment
from kvoffload.policy_values import PolicyError

pytestmark = pytest.mark.reliability
DEFAULTS = OperatorDefaults()
ON = {c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}


def _resolve(spec: dict[str, Any]) -> InjectionSettings | PolicyError:
    policy = {"metadata": {"name": "p", "namespace": "ns", "resourceVersion": "1"}, "spec": spec}
    return resolve_settings(ON, policy, DEFAULTS, "ns")


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"sidecar": {"image": " reg.example/s:1 --privileged"}}, "sidecar.image"),
        ({"sidecar": {"image": "reg.example/s:1\n"}}, "sidecar.image"),
        ({"connector": {"bundleImage": "reg.example/b:1\nprivileged: true"}}, "connector.bundleImage"),
        ({"sidecar": {"resources": {"limits": {"memory": "lots"}}}}, "sidecar.resources.limits.memory"),
        ({"sidecar": {"resources": {"requests": {"cpu": "-1"}}}}, "sidecar.resources.requests.cpu"),
        ({"sidecar": {"resources": {"privileged": True}}}, "sidecar.resources.privileged"),
        ({"sidecar": {"resources": {"limits": {"bad name": "1"}}}}, "sidecar.resources.limits"),
        ({"sidecar": {"runtimeClassName": "nvidia\n"}}, "sidecar.runtimeClassName"),  # `$` matched before \n
    ],
)
def test_policy_values_the_apiserver_would_refuse_are_refused_naming_the_field(spec: dict[str, Any], field: str
                                                                               ) -> None:  # fmt: skip
    result = _resolve(spec)
    assert isinstance(result, PolicyError) and result.field == f"KVCachePolicy p.spec.{field}", result


def test_valid_images_and_resources_still_pass() -> None:
    result = _resolve({"sidecar": {"image": "reg.example:5000/kvo/sidecar@sha256:" + "a" * 64,
                                   "resources": {"limits": {"memory": "8Gi", "nvidia.com/gpu": 0},
                                                 "requests": {"cpu": "500m", "memory": "1.5Gi"}}}})  # fmt: skip
    assert isinstance(result, InjectionSettings), result


@pytest.mark.parametrize("backend", [c.BACKEND_SIDECAR, c.BACKEND_INPROCESS])
def test_no_lmcache_usage_telemetry_from_any_injected_container(backend: str) -> None:
    settings = _resolve({"connector": {"backend": backend}})
    assert isinstance(settings, InjectionSettings)
    rendered = render_injection_fragment(trtllm_deployment("w", "ns", annotations=ON), settings,
                                         ClusterInfo(native_sidecars=True))  # fmt: skip
    assert isinstance(rendered, RenderedInjection)
    spec = rendered.workload_apply["spec"]["template"]["spec"]
    for container in spec["containers"] + spec.get("initContainers", []):
        if container["name"] == c.BUNDLE_INIT_CONTAINER:
            continue  # copies files; runs no lmcache
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert env.get(c.ENV_LMCACHE_TRACK_USAGE) == "false", container["name"]
