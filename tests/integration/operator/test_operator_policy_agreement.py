"""One policy, one verdict: a spec the real apiserver admits (CRD schema + CEL) is accepted by the
operator, by the sidecar (the policy file the operator writes) and by the connector (the env the
operator renders); a spec it refuses, the operator refuses too.

Specs are drawn from the CRD's own schema (enums, patterns, ranges) plus values just either side
of every limit, and judged by the apiserver with a server-side dry run, in batches.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

from hack.localcluster import LocalCluster
from hack.workloads import trtllm_deployment
from kvoffload import contract as c
from kvoffload.connector import settings as connector_settings
from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
from kvoffload.operator.plan.fragment import ClusterInfo, RenderedInjection, render_injection_fragment
from kvoffload.policy_values import WORKLOAD_DEPENDENT, PolicyError
from kvoffload.sidecar import settings as sidecar_settings
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]
CRD = REPO_ROOT / "charts" / "kvoffload" / "crds" / "kvcachepolicies.yaml"
BATCH = 60

NEAR_MISSES: dict[str, list[Any]] = {
    "quantity": ["63Mi", "64Mi", "1Pi", "1025Ti", "2Pi", "0", "0.5", "1.5Gi", "1e3", "1ki", "1Ki", "8G", " 1Gi"],
    "url": ["redis://redis:6379", "rediss://redis:6380", "redis://redis:6379/1", "redis://u:pw@redis:6379",
            "redis://[::1]:6379/0", "redis://redis:65536", "redis://cache-user@redis.cache:6380/"],
    "path": ["/var/cache/kv", "/a/../b", "/..", "relative", "/a\x00b", "/", "/dev/shm", "/dev/shm/l2",
             "/var/run/kvoffload", "/var", "/opt", "/opt/venv", "/etc", "/etc/kvoffload", "/proc/self", "/sys",
             "/cache/", "/a//b", "/a/./b", "/tmp/l2", "/var/cache/kvoffload-l2", "/var/runner"],
    "image": ["registry.example/sidecar:1", "a b", "x\x01y", "x" * 1025],
    "name": ["redis-auth", "Bad_Name", "a.b-c", "a..b", "-a", "x" * 254],
}  # fmt: skip
FIELD_KIND = {"shmSize": "quantity", "l1Size": "quantity", "size": "quantity", "url": "url", "path": "path",
              "image": "image", "bundleImage": "image", "name": "name"}  # fmt: skip
RESOURCES = st.sampled_from([{}, {"limits": {"memory": "8Gi"}}, {"requests": {"cpu": "500m", "memory": "1Gi"}}])


def crd_spec_schema() -> dict[str, Any]:
    doc = yaml.safe_load(CRD.read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]  # type: ignore[no-any-return]


def from_schema(schema: Mapping[str, Any], name: str = "spec") -> st.SearchStrategy[Any]:
    """Values the schema's own types, enums, patterns and ranges describe, and their near misses."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return RESOURCES
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: from_schema(v, k) for k, v in props.items() if k in required},
            optional={k: from_schema(v, k) for k, v in props.items() if k not in required},
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo, hi = schema.get("minimum", 0), schema.get("maximum", 10**6)
        return st.one_of(st.integers(lo, hi), st.sampled_from([lo - 1, lo, hi, hi + 1, 48, 64, 96, 256]))
    if "enum" in schema:
        return st.sampled_from([*schema["enum"], "other"])
    misses = st.sampled_from(NEAR_MISSES[FIELD_KIND[name]]) if name in FIELD_KIND else st.nothing()
    if "pattern" in schema:
        pattern = (
            schema["pattern"].encode().decode("unicode_escape") if "\\x" in schema["pattern"] else schema["pattern"]
        )
        top = schema.get("maxLength", 64)
        return st.one_of(st.from_regex(pattern, fullmatch=True).filter(lambda s: len(s) <= top), misses)
    return st.one_of(st.text(max_size=12), misses)


def admitted_by_apiserver(cluster: LocalCluster, namespace: str, specs: list[Any]) -> list[bool | str]:
    """Server-side dry run of one KVCachePolicy per spec: True where admitted, else the apiserver's reason."""
    items = [{"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
              "metadata": {"name": f"p-{i}", "namespace": namespace}, "spec": spec} for i, spec in enumerate(specs)]  # fmt: skip
    out = cluster.kubectl("create", "--dry-run=server", "-o", "name", "-f", "-",
                          input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}), check=False)  # fmt: skip
    created = set(re.findall(r"/p-(\d+)$", out.stdout, re.M))
    refused = dict(re.findall(r'"p-(\d+)" is invalid: (.*)', out.stderr))
    return [True if str(i) in created else refused.get(str(i), "refused") for i in range(len(specs))]


def operator_verdict(spec: Any) -> InjectionSettings | PolicyError:
    policy = {"metadata": {"name": "p"}, "spec": spec}
    return resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, OperatorDefaults(), "ns")


def container_env(rendered: RenderedInjection, name: str) -> dict[str, str]:
    spec = rendered.workload_apply["spec"]["template"]["spec"]
    containers = [*spec.get("initContainers", []), *spec["containers"]]
    found = next(x for x in containers if x["name"] == name)
    return {e["name"]: e["value"] for e in found.get("env", []) if "value" in e}


WORKLOAD = trtllm_deployment("llm", "ns", annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: "p"})


def check_components_accept(resolved: InjectionSettings, rendered: RenderedInjection) -> None:
    """The sidecar reads the operator's policy file and env; the connector reads the engine's env."""
    if resolved.backend == c.BACKEND_SIDECAR and resolved.mode == "sidecar":
        env = container_env(rendered, c.SIDECAR_CONTAINER)
        if resolved.redis_tier and resolved.redis_tier.password_secret_name:
            env[c.ENV_L2_REDIS_PASSWORD] = "from-the-secret"
        if resolved.redis_tier and resolved.redis_tier.url_secret_name:
            env[c.ENV_L2_REDIS_URL] = "redis://user@from-the-secret:6379"  # what kubelet resolves
        sidecar_settings.load_settings(env, resolved.policy_document())
    engine_env = container_env(rendered, rendered.engine_container)
    llm_args = SimpleNamespace(model="m", kv_cache_config=SimpleNamespace(tokens_per_block=None))
    connector_settings.parse_settings(engine_env, llm_args)


@settings(max_examples=5, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])  # fmt: skip
@given(specs=st.lists(from_schema(crd_spec_schema()), min_size=BATCH, max_size=BATCH))
def test_what_the_apiserver_admits_every_component_accepts_and_the_rest_the_operator_refuses(
    cluster: LocalCluster, namespace: str, operator_kubeconfig: object, specs: list[Any]
) -> None:
    disagreements = []
    for spec, admitted in zip(specs, admitted_by_apiserver(cluster, namespace, specs), strict=True):
        event("admitted" if admitted else "refused")
        problem = disagreement(spec, admitted)
        if problem:
            disagreements.append(f"{problem}\n  spec={spec!r}")
    assert not disagreements, "\n".join(disagreements)


def disagreement(spec: Any, admitted: bool | str) -> str | None:
    """Why the components' verdict on ``spec`` differs from the apiserver's, or None.

    The operator may refuse an admitted spec only for a reason the apiserver cannot see (this
    workload's engine block size, the operator's defaults): ``WORKLOAD_DEPENDENT``, with an Event.
    """
    verdict = operator_verdict(spec)
    if admitted is not True:
        return (
            None
            if isinstance(verdict, PolicyError)
            else f"the apiserver refused ({admitted}) what the operator accepts"
        )
    if isinstance(verdict, PolicyError):
        return (
            None
            if verdict.reason == WORKLOAD_DEPENDENT
            else f"the apiserver admitted what the operator refuses: {verdict.message}"
        )
    rendered = render_injection_fragment(WORKLOAD, verdict, ClusterInfo(native_sidecars=True))
    if isinstance(rendered, PolicyError):
        return None if rendered.reason == WORKLOAD_DEPENDENT else f"the operator's renderer refuses: {rendered.message}"
    try:
        check_components_accept(verdict, rendered)
    except (sidecar_settings.SettingsError, connector_settings.SettingsError) as exc:
        return f"the apiserver and the operator admitted what a component refuses: {exc}"
    return None


EDGES = [
    {"shmSize": "1.5Gi"},
    {"cache": {"chunkSize": 48}},
    {"cache": {"l1Size": "1ki"}},
    {"l2": {"fs": {"path": "/cache", "size": "2Pi"}}},
    {"l2": {"fs": {"path": "/a/../b", "size": "1Gi"}}},
    {"l2": {"redis": {"url": "redis://r:6379", "passwordSecretRef": {"name": "Bad_Name", "key": "k"}}}},
    {
        "l2": {
            "redis": {
                "urlSecretRef": {"name": "redis-url", "key": "url"},
                "passwordSecretRef": {"name": "r", "key": "pw"},
            }
        }
    },
    {"l2": {"redis": {"urlSecretRef": {"name": "redis-url", "key": "url"}, "url": "redis://r:6379"}}},
    {"l2": {"redis": {"urlSecretRef": {"name": "Bad_Name", "key": "url"}}}},
    {"l2": {"redis": {}}},
    {"sidecar": {"image": "x\x01y"}},
    {"connector": {"lookupTimeoutMs": 6000, "retrieveTimeoutMs": 5000}},
    {"connector": {"lookupTimeoutMs": 6000}},
    {"kvEvents": {"enabled": True, "topic": "kv@ pod@m"}},
    {"kvEvents": {"enabled": True, "topic": "t" * 257}},
    {"kvEvents": {"enabled": True, "topic": "kv@$(KVOFFLOAD_POD_IP):8000@m"}},
    {"kvEvents": {"enabled": True}, "connector": {"backend": "inprocess"}},
]


def test_edges_either_side_of_each_limit_get_one_verdict(
    cluster: LocalCluster, namespace: str, operator_kubeconfig: object
) -> None:
    verdicts = admitted_by_apiserver(cluster, namespace, EDGES)
    problems = [f"{p}: {s!r}" for s, a in zip(EDGES, verdicts, strict=True) if (p := disagreement(s, a))]
    assert not problems, "\n".join(problems)
