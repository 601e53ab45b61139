"""The env contract: every env var the operator sets on a container is read there (by our component,
or by the named program that owns it), and every env var a component reads is set by the operator
or documented as the user's to set.

What the operator sets comes from its real renderers over a spread of policies; what a component
reads is every ``contract.ENV_*`` its source names.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from hack.workloads import trtllm_deployment
from kvoffload import contract as c
from kvoffload.operator.intent.settings import OperatorDefaults, resolve_settings
from kvoffload.operator.node.cache_objects import cache_settings, render_cache_pod, render_node_mode_fragment
from kvoffload.operator.plan.fragment import ClusterInfo, RenderedInjection, render_injection_fragment
from kvoffload.policy_values import PolicyError

pytestmark = [pytest.mark.operator, pytest.mark.sidecar, pytest.mark.connector]
ROOT = Path(__file__).resolve().parents[2]
ENV_NAMES = {getattr(c, n): n for n in dir(c) if n.startswith("ENV_")}

READ_ELSEWHERE = {
    c.ENV_PYTHONHASHSEED: "the Python interpreter (stable hashing across the engine's processes)",
    c.ENV_PYTHONPATH: "the Python interpreter (the bundle's import path)",
    c.ENV_LMCACHE_TRACK_USAGE: "LMCache (usage reporting off)",
    c.ENV_NVIDIA_VISIBLE_DEVICES: "the NVIDIA container runtime",
    c.ENV_NVIDIA_DRIVER_CAPABILITIES: "the NVIDIA container runtime",
    c.ENV_TMPDIR: "Python's tempfile in the sidecar and LMCache (the root filesystem is read-only)",
    c.ENV_NUMBA_CACHE_DIR: "numba, for LMCache's CPU kernels (the root filesystem is read-only)",
    c.ENV_POD_IP: "Kubernetes, which expands $(KVOFFLOAD_POD_IP) in the KV-events topic",
}
"""Env vars the operator sets for a program other than our components; the name says which."""

USER_SET = {
    "connector": {
        c.ENV_ASYNC_SAVE,
        c.ENV_ASYNC_LOAD_MIN_TOKENS,
        c.ENV_LOAD_COST_GUARD,
        c.ENV_LAYERWISE_LOADS,
        c.ENV_RECOMPUTE_TOKENS_PER_S,
        c.ENV_HEARTBEAT_INTERVAL_MS,
        c.ENV_MODEL_NAME,
        c.ENV_TOKENS_PER_BLOCK,
    },
    "sidecar": {
        c.ENV_GRACE_SECONDS,
        c.ENV_SHM_NAME,
        c.ENV_L2_FS_PATH,
        c.ENV_L2_FS_SIZE,
        c.ENV_L2_REDIS_URL,
        c.ENV_WARM_STANDBY,
    },
}
"""Env vars a component reads that the operator leaves to the user (each documented in docs/)."""

POLICIES: list[dict[str, Any]] = [
    {},
    {"l2": {"fs": {"path": "/cache", "size": "10Gi"},
            "redis": {"url": "redis://r:6379", "passwordSecretRef": {"name": "s", "key": "k"}}}},
    {"connector": {"backend": "inprocess"}, "cache": {"l1Size": "1Gi"}},
    {"connector": {"saveDecodeTokens": True}, "sidecar": {"gpuAccess": "nvidia-runtime"}},
    {"kvEvents": {"enabled": True, "topic": "kv@$(KVOFFLOAD_POD_IP):8000@m"}},
    {"kvEvents": {"enabled": True, "format": "vllm-positional"}},
]  # fmt: skip


def component_reads(component: str) -> set[str]:
    """The env vars a component's source reads: every ``contract.ENV_*`` it names."""
    found: set[str] = set()
    for path in (ROOT / component / "src" / "kvoffload" / component).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("ENV_") and hasattr(c, node.attr):
                found.add(getattr(c, node.attr))
    return found


def _env_of(containers: list[dict[str, Any]], name: str) -> set[str]:
    return {e["name"] for x in containers if x["name"] == name for e in x.get("env", [])}


def operator_sets() -> dict[str, set[str]]:
    """Env var names the operator sets on the cache server and on the engine, over every policy above."""
    sets: dict[str, set[str]] = {"sidecar": set(), "connector": set()}
    for spec in POLICIES:
        policy = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "generation": 1}, "spec": spec}
        settings = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, OperatorDefaults(), "ns")
        assert not isinstance(settings, PolicyError), settings.message
        workload = trtllm_deployment("llm", "ns", annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: "p"})
        for native in (True, False):
            rendered = render_injection_fragment(workload, settings, ClusterInfo(native_sidecars=native))
            assert isinstance(rendered, RenderedInjection)
            pod = rendered.workload_apply["spec"]["template"]["spec"]
            containers = [*pod.get("initContainers", []), *pod["containers"]]
            sets["sidecar"] |= _env_of(containers, c.SIDECAR_CONTAINER)
            sets["connector"] |= _env_of(containers, rendered.engine_container)
    node_policy = {"metadata": {"name": "p", "namespace": "ns", "uid": "u", "generation": 1}, "spec": {"mode": "node"}}
    node_settings = cache_settings(node_policy, OperatorDefaults())
    assert not isinstance(node_settings, PolicyError)
    cache_pod = render_cache_pod(node_policy, node_settings, "node-a")["spec"]
    sets["sidecar"] |= {e["name"] for x in cache_pod["containers"] for e in x.get("env", [])}
    node_annotations = {c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}
    engine_settings = resolve_settings(node_annotations, node_policy, OperatorDefaults(), "ns")
    assert not isinstance(engine_settings, PolicyError)
    engine = render_node_mode_fragment(trtllm_deployment("llm", "ns", annotations=node_annotations), engine_settings,
                                       ClusterInfo(native_sidecars=True))  # fmt: skip
    assert isinstance(engine, RenderedInjection)
    sets["connector"] |= _env_of(
        engine.workload_apply["spec"]["template"]["spec"]["containers"], engine.engine_container
    )
    return sets


@pytest.mark.parametrize("component", ["sidecar", "connector"])
def test_every_env_var_the_operator_sets_is_read_there(component: str) -> None:
    unread = operator_sets()[component] - component_reads(component) - set(READ_ELSEWHERE)
    assert not unread, f"the operator sets {sorted(unread)} on the {component}, and nothing there reads them"


@pytest.mark.parametrize("component", ["sidecar", "connector"])
def test_every_env_var_a_component_reads_is_set_by_the_operator_or_documented(component: str) -> None:
    unset = component_reads(component) - operator_sets()[component] - USER_SET[component]
    assert not unset, f"the {component} reads {sorted(unset)}, which the operator never sets and docs do not list"
    docs = "".join(p.read_text() for p in (ROOT / "docs").glob("*.md"))
    undocumented = sorted(name for name in USER_SET[component] if name not in docs)
    assert not undocumented, f"user-set env vars missing from docs/: {undocumented}"


def test_every_env_name_in_the_contract_is_used() -> None:
    used = component_reads("operator") | component_reads("sidecar") | component_reads("connector")
    assert set(ENV_NAMES) - used == set(), "dead names in common/src/kvoffload/contract.py"
