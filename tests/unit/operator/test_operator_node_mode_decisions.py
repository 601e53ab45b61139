"""Node-shared mode's pure decisions: the engine fragment, the cache pods each node needs, the
plan that gets there from any starting point, the node-local Service and the policy status."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import contract as c
from kvoffload.operator.control.policy_status import desired_policy_status
from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
from kvoffload.operator.node.cache_objects import (
    cache_pod_name,
    cache_pod_selector,
    cache_settings,
    render_cache_keys_secret,
    render_cache_network_policy,
    render_cache_pod,
    render_cache_service,
    render_node_mode_fragment,
)
from kvoffload.operator.node.caches import new_cache_keys
from kvoffload.operator.node.placement import (
    desired_cache_pods,
    engine_nodes,
    node_cache_status,
    plan_cache_pods,
)
from kvoffload.operator.plan.containers import CACHE_KEYS_MOUNT, CACHE_POD_KEY_FILES, ENGINE_KEY_FILES
from kvoffload.operator.plan.fragment import ClusterInfo, RenderedInjection, render_injection_fragment
from kvoffload.operator.plan.node_wiring import (
    cache_keys_secret_name,
    cache_server_url,
    cache_service_name,
    node_shm_host_path,
)
from kvoffload.policy_values import PolicyError
from tests.unit.operator.workload_builders import applied, container, deployment

pytestmark = pytest.mark.operator
NATIVE = ClusterInfo(native_sidecars=True, operator_version="9.9.9")
DEFAULTS = OperatorDefaults()
NODES = ("gpu-node-0", "gpu-node-1", "gpu-node-2")


def policy(name: str = "shared", namespace: str = "ns", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "kvoffload.io/v1alpha1", "kind": "KVCachePolicy",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 1},
        "spec": {"mode": "node", "cache": {"l1Size": "4Gi"}, **spec},
    }  # fmt: skip


def node_settings(pol: dict[str, Any] | None = None, **annotations: str) -> InjectionSettings:
    pol = pol or policy()
    s = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: pol["metadata"]["name"], **annotations}, pol,
                         DEFAULTS, "ns")  # fmt: skip
    assert isinstance(s, InjectionSettings), s
    return s


def render_node(obj: dict[str, Any], **annotations: str) -> RenderedInjection:
    r = render_node_mode_fragment(obj, node_settings(**annotations), NATIVE)
    assert isinstance(r, RenderedInjection), r
    return r


def engine_pod(node: str | None, name: str, pol: str = "shared", phase: str = "Running",
               owner: str | None = "ReplicaSet", tolerations: list[dict[str, Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """An engine pod as a workload's controller makes it from an injected template."""
    spec: dict[str, Any] = {"containers": [container()]}
    if node:
        spec["nodeName"] = node
    if tolerations:
        spec["tolerations"] = tolerations
    meta: dict[str, Any] = {"name": name, "namespace": "ns",
                            "labels": {"app": "llm", c.LABEL_NODE_CACHE_POLICY: pol, c.LABEL_INJECTED: "true"}}  # fmt: skip
    if owner:
        meta["ownerReferences"] = [{"kind": owner, "name": "llm-5d8f7c9b4", "controller": True}]
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def pod_spec(r: RenderedInjection) -> dict[str, Any]:
    return r.workload_apply["spec"]["template"]["spec"]  # type: ignore[no-any-return]


# --- settings -----------------------------------------------------------------


def test_node_mode_is_accepted_from_the_policy_and_from_the_annotation() -> None:
    assert node_settings().mode == "node"
    sidecar_policy = policy(mode="sidecar")
    assert node_settings(sidecar_policy, **{c.ANN_MODE: "node"}).mode == "node"


@pytest.mark.parametrize(
    ("annotations", "pol", "field", "words"),
    [
        ({c.ANN_MODE: "node"}, None, c.ANN_MODE, "needs kvoffload.io/policy"),
        ({c.ANN_POLICY: "shared", c.ANN_BACKEND: "inprocess"}, policy(), c.ANN_BACKEND, "needs backend sidecar"),
    ],
)
def test_node_mode_needs_a_policy_and_the_sidecar_backend(
    annotations: dict[str, str], pol: dict[str, Any] | None, field: str, words: str
) -> None:
    e = resolve_settings({c.ANN_ENABLED: "true", **annotations}, pol, DEFAULTS, "ns")
    assert isinstance(e, PolicyError) and e.field == field and words in e.message, e


# --- the engine's fragment ------------------------------------------------------


def test_engine_fragment_wires_the_node_cache_instead_of_a_sidecar() -> None:
    r = render_node(deployment())
    spec = pod_spec(r)
    names = [x["name"] for x in [*spec.get("initContainers", []), *spec["containers"]]]
    assert names == [c.BUNDLE_INIT_CONTAINER, "trtllm"]
    assert "shareProcessNamespace" not in spec
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes[c.VOLUME_SHM] == {
        "name": c.VOLUME_SHM, "hostPath": {"path": "/dev/shm/kvoffload/ns/shared", "type": "DirectoryOrCreate"},
    }  # fmt: skip
    assert c.VOLUME_POLICY not in volumes
    env = {e["name"]: e["value"] for e in spec["containers"][0]["env"]}
    assert env[c.ENV_SERVER_URL] == "tcp://kvoffload-shared.ns.svc:5555" == cache_server_url("ns", "shared")
    assert env[c.ENV_BACKEND] == c.BACKEND_SIDECAR and env[c.ENV_PYTHONHASHSEED] == "0"
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    assert mounts[c.SHM_MOUNT_PATH] == c.VOLUME_SHM
    meta = r.workload_apply["spec"]["template"]["metadata"]
    assert meta["labels"] == {c.LABEL_INJECTED: "true", c.LABEL_NODE_CACHE_POLICY: "shared"}
    # No sidecar to serve the pod's /metrics: the connector serves them on its own port.
    assert env[c.ENV_METRICS_PORT] == str(c.ENGINE_METRICS_PORT)
    assert spec["containers"][0]["ports"] == [
        {"name": c.ENGINE_METRICS_PORT_NAME, "containerPort": c.ENGINE_METRICS_PORT, "protocol": "TCP"}
    ]
    assert {k: v for k, v in meta["annotations"].items() if k.startswith("prometheus.io/")} == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(c.ENGINE_METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }


def test_engine_fragment_is_the_sidecar_fragment_minus_the_sidecar() -> None:
    """Everything else the engine gets (options file, bundle, env, args) is sidecar mode's."""
    obj = deployment()
    node = render_node(obj)
    side = render_injection_fragment(obj, node_settings(**{c.ANN_MODE: "sidecar"}), NATIVE)
    assert isinstance(side, RenderedInjection)
    n_engine, s_engine = pod_spec(node)["containers"][0], pod_spec(side)["containers"][0]
    assert n_engine["args"] == s_engine["args"]
    # Node mode adds the policy's client keys (the node cache admits no other connection).
    assert n_engine["volumeMounts"] == [*s_engine["volumeMounts"], dict(CACHE_KEYS_MOUNT)]
    differing = {e["name"] for e in n_engine["env"]} ^ {e["name"] for e in s_engine["env"]}
    assert differing == {c.ENV_METRICS_PORT, c.ENV_CACHE_KEYS_DIR}  # no sidecar: the connector serves /metrics
    assert node.configmap_apply["data"][c.TRTLLM_OPTIONS_FILE] == side.configmap_apply["data"][c.TRTLLM_OPTIONS_FILE]
    assert node.config_hash != side.config_hash  # switching modes rolls the pods once


def _keys_volume(spec: dict[str, Any]) -> dict[str, Any]:
    return next(v for v in spec["volumes"] if v["name"] == c.VOLUME_CACHE_KEYS)


def test_engines_mount_only_their_policys_client_keys_and_the_cache_pod_only_the_servers() -> None:
    engine = pod_spec(render_node(deployment()))
    assert _keys_volume(engine)["secret"]["secretName"] == cache_keys_secret_name("shared")
    assert [i["key"] for i in _keys_volume(engine)["secret"]["items"]] == list(ENGINE_KEY_FILES)
    assert c.CACHE_KEY_SERVER_SECRET not in ENGINE_KEY_FILES
    env = {e["name"]: e["value"] for e in engine["containers"][0]["env"]}
    assert env[c.ENV_CACHE_KEYS_DIR] == c.CACHE_KEYS_MOUNT_PATH
    # Another policy's engines get that policy's Secret, never this one's.
    other_settings = node_settings(policy("other"))
    rendered = render_node_mode_fragment(deployment(), other_settings, NATIVE)
    assert isinstance(rendered, RenderedInjection)
    other = pod_spec(rendered)
    assert (
        _keys_volume(other)["secret"]["secretName"]
        == cache_keys_secret_name("other")
        != cache_keys_secret_name("shared")
    )
    pol = policy()
    settings_ = cache_settings(pol, DEFAULTS)
    assert isinstance(settings_, InjectionSettings)
    cache = render_cache_pod(pol, settings_, NODES[0])["spec"]
    assert [i["key"] for i in _keys_volume(cache)["secret"]["items"]] == list(CACHE_POD_KEY_FILES)
    assert c.CACHE_KEY_CLIENT_SECRET not in CACHE_POD_KEY_FILES
    server = cache["containers"][0]
    assert {"name": c.ENV_CACHE_KEYS_DIR, "value": c.CACHE_KEYS_MOUNT_PATH} in server["env"]
    assert dict(CACHE_KEYS_MOUNT) in server["volumeMounts"]
    # Sidecar mode: loopback only, no keys.
    side = render_injection_fragment(deployment(), node_settings(**{c.ANN_MODE: "sidecar"}), NATIVE)
    assert isinstance(side, RenderedInjection)
    assert all(v["name"] != c.VOLUME_CACHE_KEYS for v in pod_spec(side)["volumes"])


def test_the_key_secret_holds_two_fresh_keypairs_owned_by_the_policy() -> None:
    first, second = new_cache_keys(), new_cache_keys()
    files = {c.CACHE_KEY_SERVER_PUBLIC, c.CACHE_KEY_SERVER_SECRET, c.CACHE_KEY_CLIENT_PUBLIC, c.CACHE_KEY_CLIENT_SECRET}
    assert set(first) == files and len(set(first.values()) | set(second.values())) == 8
    secret = render_cache_keys_secret(policy(), first)
    assert secret["metadata"]["name"] == cache_keys_secret_name("shared")
    assert secret["metadata"]["ownerReferences"][0]["kind"] == c.POLICY_KIND
    assert secret["stringData"] == first


def test_render_is_deterministic_and_stable_on_the_injected_object() -> None:
    obj = deployment()
    first = render_node(obj)
    assert render_node(copy.deepcopy(obj)) == first
    again = render_node(applied(obj, first.workload_apply))
    assert again.workload_apply == first.workload_apply and again.config_hash == first.config_hash


def test_switching_from_sidecar_to_node_drops_the_sidecar_fields() -> None:
    obj = deployment()
    side = render_injection_fragment(obj, node_settings(**{c.ANN_MODE: "sidecar"}), NATIVE)
    assert isinstance(side, RenderedInjection)
    node = render_node(applied(obj, side.workload_apply))
    spec = pod_spec(node)
    # SSA drops every field the manager owned and no longer applies: the sidecar goes.
    assert all(x["name"] != c.SIDECAR_CONTAINER for x in spec.get("initContainers", []))
    assert "hostPath" in next(v for v in spec["volumes"] if v["name"] == c.VOLUME_SHM)


def test_user_shm_mount_and_per_workload_cache_size_are_errors_in_node_mode() -> None:
    obj = deployment(
        containers=[{**container(), "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}]}],
        volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    )
    e = render_node_mode_fragment(obj, node_settings(), NATIVE)
    assert isinstance(e, PolicyError) and e.reason == "conflict" and "/dev/shm" in e.message
    sized = deployment(annotations={c.ANN_CPU_CACHE_SIZE: "8Gi"})
    e = render_node_mode_fragment(sized, node_settings(**{c.ANN_CPU_CACHE_SIZE: "8Gi"}), NATIVE)
    assert isinstance(e, PolicyError) and e.field == c.ANN_CPU_CACHE_SIZE and "spec.cache.l1Size" in e.message


# --- cache pods -------------------------------------------------------------------


def test_five_replicas_over_three_nodes_need_three_cache_pods() -> None:
    pods = [engine_pod(NODES[i % 3], f"llm-{i}") for i in range(5)]
    pods += [
        engine_pod(None, "pending"),
        engine_pod("gpu-node-9", "done", phase="Succeeded"),
        engine_pod("gpu-node-8", "other-policy", pol="other"),
    ]
    pol = policy()
    settings_ = cache_settings(pol, DEFAULTS)
    assert isinstance(settings_, InjectionSettings)
    desired = desired_cache_pods(pol, settings_, pods)
    assert sorted(desired) == list(NODES)
    for node, pod in desired.items():
        assert pod["metadata"]["name"] == f"shared-cache-{node}"
        assert pod["metadata"]["annotations"][c.ANN_CACHE_NODE] == node
        term = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["nodeSelectorTerms"] == [{"matchFields": [{"key": "metadata.name", "operator": "In",
                                                               "values": [node]}]}]  # fmt: skip
        assert pod["metadata"]["ownerReferences"] == [{
            "apiVersion": "kvoffload.io/v1alpha1", "kind": "KVCachePolicy", "name": "shared", "uid": "uid-shared",
            "controller": True,
        }]  # fmt: skip
    hashes = {p["metadata"]["annotations"][c.ANN_CONFIG_HASH] for p in desired.values()}
    assert len(hashes) == 1  # one configuration per policy, whatever the node


def test_cache_pod_runs_the_sidecar_container_configured_by_env() -> None:
    pol = policy(cache={"l1Size": "4Gi", "evictionPolicy": "ARC", "chunkSize": 128},
                 l2={"fs": {"path": "/cache", "size": "10Gi"}})  # fmt: skip
    s = cache_settings(pol, DEFAULTS)
    assert isinstance(s, InjectionSettings)
    pod = render_cache_pod(pol, s, "gpu-node-0")
    side = render_injection_fragment(deployment(), node_settings(pol, **{c.ANN_MODE: "sidecar"}), NATIVE)
    assert isinstance(side, RenderedInjection)
    sidecar = next(x for x in pod_spec(side)["initContainers"] if x["name"] == c.SIDECAR_CONTAINER)
    (cache,) = pod["spec"]["containers"]
    for key in ("image", "command", "ports", "startupProbe", "readinessProbe", "livenessProbe", "resources",
                "securityContext"):  # fmt: skip
        assert cache[key] == sidecar[key], key
    env = {e["name"]: e.get("value") for e in cache["env"]}
    assert c.ENV_POLICY_FILE not in env
    assert env[c.ENV_REQUEST_HOST] == "0.0.0.0" and env[c.ENV_L1_SIZE] == "4Gi"
    assert (env[c.ENV_EVICTION_POLICY], env[c.ENV_CHUNK_SIZE]) == ("ARC", "128")
    assert (env[c.ENV_L2_FS_PATH], env[c.ENV_L2_FS_SIZE]) == ("/cache", "10Gi")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes[c.VOLUME_SHM]["hostPath"]["path"] == node_shm_host_path("ns", "shared")
    (prepare,) = pod["spec"]["initContainers"]
    assert prepare["command"] == ["chmod", "1777", "/dev/shm"] and prepare["securityContext"]["runAsUser"] == 0
    assert "tolerations" not in pod["spec"]
    assert pod["spec"]["securityContext"] == {"seccompProfile": {"type": "RuntimeDefault"}}
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert all(x["securityContext"]["readOnlyRootFilesystem"] for x in [*pod["spec"]["initContainers"], cache])


def test_a_cache_pod_tolerates_what_its_nodes_engines_tolerate_and_no_more() -> None:
    gpu = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    spot = {"key": "spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    pods = [engine_pod("n1", "a", tolerations=[gpu]), engine_pod("n1", "b", tolerations=[spot, gpu]),
            engine_pod("n2", "c", tolerations=[gpu]), engine_pod("n3", "d")]  # fmt: skip
    pol = policy()
    s = cache_settings(pol, DEFAULTS)
    assert isinstance(s, InjectionSettings)
    desired = desired_cache_pods(pol, s, pods)
    assert sorted(desired["n1"]["spec"]["tolerations"], key=str) == sorted([gpu, spot], key=str)
    assert desired["n2"]["spec"]["tolerations"] == [gpu]
    assert "tolerations" not in desired["n3"]["spec"]
    assert all({"operator": "Exists"} not in p["spec"].get("tolerations", []) for p in desired.values())
    hashes = {p["metadata"]["annotations"][c.ANN_CONFIG_HASH] for p in desired.values()}
    assert len(hashes) == 1, "an engine rollout that changes tolerations does not restart the caches"


@pytest.mark.parametrize(
    ("pod", "why"),
    [
        (engine_pod("n9", "bare", owner=None), "a bare pod that labels itself"),
        (engine_pod("n9", "job", owner="Job"), "a pod of a kind kvoffload does not inject"),
    ],
)
def test_no_cache_pod_for_a_pod_that_no_injected_workload_placed(pod: dict[str, Any], why: str) -> None:
    assert engine_nodes("shared", [pod]) == [], why
    uninjected = engine_pod("n9", "copied-label")
    del uninjected["metadata"]["labels"][c.LABEL_INJECTED]
    assert engine_nodes("shared", [uninjected]) == []


def _cache(node: str, name: str | None = None, digest: str = "h", phase: str = "Running",
           terminating: bool = False) -> dict[str, Any]:  # fmt: skip
    meta: dict[str, Any] = {
        "name": name or f"shared-cache-{node}",
        "annotations": {c.ANN_CACHE_NODE: node, c.ANN_CONFIG_HASH: digest},
    }
    if terminating:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node}, "status": {"phase": phase}}


PLAN_IDS = ["create", "steady", "node-left", "policy-gone", "outdated", "terminating", "failed", "duplicate",
            "wrong-node"]  # fmt: skip


def _want(*nodes: str) -> dict[str, dict[str, Any]]:
    return {n: _cache(n) for n in nodes}


@pytest.mark.parametrize(
    ("desired", "existing", "create", "delete"),
    [
        (_want("a", "b"), [], ["a", "b"], []),
        (_want("a", "b"), [_cache("a"), _cache("b")], [], []),
        (_want("a"), [_cache("a"), _cache("b")], [], ["shared-cache-b"]),
        ({}, [_cache("a")], [], ["shared-cache-a"]),
        (_want("a"), [_cache("a", digest="old")], [], ["shared-cache-a"]),  # recreated once it is gone
        (_want("a"), [_cache("a", terminating=True)], [], []),
        (_want("a"), [_cache("a", phase="Failed")], [], ["shared-cache-a"]),
        (_want("a"), [_cache("a"), _cache("a", name="stray")], [], ["stray"]),
        (_want("a"), [_cache("b", name="shared-cache-a")], [], ["shared-cache-a"]),
    ],
    ids=PLAN_IDS,
)
def test_plan_cache_pods(desired: dict[str, Any], existing: list[dict[str, Any]], create: list[str],
                         delete: list[str]) -> None:  # fmt: skip
    plan = plan_cache_pods(desired, existing)
    assert [m["metadata"]["annotations"][c.ANN_CACHE_NODE] for m in plan.create] == create
    assert list(plan.delete) == delete


@settings(max_examples=200, deadline=None)
@given(
    engines=st.lists(st.sampled_from(NODES), max_size=6),
    stale=st.lists(st.tuples(st.sampled_from(NODES), st.sampled_from(["h", "old"]), st.booleans()), max_size=5),
)
def test_repeated_passes_converge_to_one_cache_pod_per_engine_node(
    engines: list[str], stale: list[tuple[str, str, bool]]
) -> None:
    """From any leftover state (outdated, duplicate, terminating pods), a few passes give exactly
    one up-to-date cache pod per engine node and nothing else: what an operator restart relies on."""
    desired = _want(*sorted(set(engines)))
    cluster = [_cache(n, name=f"x{i}" if dup else None, digest=d) for i, (n, d, dup) in enumerate(stale)]
    cluster = list({p["metadata"]["name"]: p for p in cluster}.values())  # names are unique in a namespace
    for _ in range(3):
        plan = plan_cache_pods(desired, cluster)
        cluster = [p for p in cluster if p["metadata"]["name"] not in plan.delete] + list(plan.create)
    assert sorted(p["metadata"]["annotations"][c.ANN_CACHE_NODE] for p in cluster) == sorted(set(engines))
    assert all(p["metadata"]["annotations"][c.ANN_CONFIG_HASH] == "h" for p in cluster)
    assert plan_cache_pods(desired, cluster).create == () == plan_cache_pods(desired, cluster).delete


def test_engine_nodes_only_count_scheduled_running_pods_of_the_policy() -> None:
    pods = [engine_pod("n1", "a"), engine_pod("n2", "b", phase="Failed"), engine_pod(None, "c"),
            engine_pod("n3", "d", pol="other")]  # fmt: skip
    assert engine_nodes("shared", pods) == ["n1"]


# --- reaching the node's cache ----------------------------------------------------


def test_service_reaches_only_the_local_cache_pod_of_its_policy() -> None:
    pol = policy()
    svc = render_cache_service(pol)
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    assert svc["metadata"]["name"] == cache_service_name("shared")
    selector = svc["spec"]["selector"]
    s = cache_settings(pol, DEFAULTS)
    assert isinstance(s, InjectionSettings)
    cache_labels = render_cache_pod(pol, s, "gpu-node-0")["metadata"]["labels"]
    assert selector.items() <= cache_labels.items()
    engine_labels = pod_spec(render_node(deployment())) and render_node(deployment()).workload_apply["spec"][
        "template"]["metadata"]["labels"]  # fmt: skip
    assert not selector.items() <= engine_labels.items()
    other = render_cache_service(policy("other"))["spec"]["selector"]
    assert other != selector and other == cache_pod_selector("other")
    (port,) = svc["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (c.REQUEST_PORT, c.REQUEST_PORT_NAME)


def test_network_policy_admits_only_the_policys_engines_to_the_request_port() -> None:
    pol = policy()
    netpol = render_cache_network_policy(pol)
    s = cache_settings(pol, DEFAULTS)
    assert isinstance(s, InjectionSettings)
    cache_labels = render_cache_pod(pol, s, "gpu-node-0")["metadata"]["labels"]
    assert netpol["spec"]["podSelector"]["matchLabels"].items() <= cache_labels.items()
    assert netpol["spec"]["policyTypes"] == ["Ingress"]
    engines, metrics = netpol["spec"]["ingress"]
    engine_labels = render_node(deployment()).workload_apply["spec"]["template"]["metadata"]["labels"]
    (source,) = engines["from"]
    assert source["podSelector"]["matchLabels"].items() <= engine_labels.items()
    assert engines["ports"] == [{"port": c.REQUEST_PORT, "protocol": "TCP"}]
    assert "from" not in metrics and metrics["ports"] == [{"port": c.SIDECAR_HTTP_PORT, "protocol": "TCP"}]
    other = render_cache_network_policy(policy("other"))["spec"]["ingress"][0]["from"][0]["podSelector"]
    assert not other["matchLabels"].items() <= engine_labels.items(), "another policy's engines are not admitted"
    assert netpol["metadata"]["ownerReferences"][0]["kind"] == c.POLICY_KIND


def test_policies_and_namespaces_never_share_a_segment_directory_or_service() -> None:
    paths = {node_shm_host_path(ns, p) for ns in ("a", "a-b") for p in ("b-c", "c")}
    assert len(paths) == 4
    urls = {cache_server_url(ns, p) for ns in ("a", "b") for p in ("x", "y")}
    assert len(urls) == 4


def test_long_names_stay_valid_and_deterministic() -> None:
    long_policy, long_node = "p" * 63, "node-" + "n" * 200
    assert len(cache_service_name(long_policy)) <= 63 and cache_service_name(long_policy)[0].isalpha()
    assert cache_service_name("a.b") == "kvoffload-a-b"
    name = cache_pod_name(long_policy, long_node)
    assert len(name) <= 63 and name == cache_pod_name(long_policy, long_node)
    assert name != cache_pod_name(long_policy, long_node + "x")


# --- status -----------------------------------------------------------------------


def test_status_lists_each_nodes_cache_pod_and_readiness() -> None:
    ready = _cache("b")
    ready["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    rows = node_cache_status([ready, _cache("a"), _cache("c", terminating=True)])
    assert rows == [
        {"node": "a", "pod": "shared-cache-a", "ready": False},
        {"node": "b", "pod": "shared-cache-b", "ready": True},
    ]
    status = desired_policy_status(policy(), DEFAULTS, [], rows, now="2026-12-03T00:00:00Z")
    assert status["nodeCaches"] == rows and status["conditions"][0]["status"] == "True"
    assert "nodeCaches" not in desired_policy_status(policy(), DEFAULTS, [], now="2026-12-03T00:00:00Z")


def test_kv_events_in_node_mode_publish_from_the_nodes_cache_pod_to_routers_anywhere() -> None:
    """Node mode: the node's one cache server publishes for every engine on the node; its events port
    is on the cache pod, open to routers in the NetworkPolicy, and the engines report their stores."""
    pol = policy(kvEvents={"enabled": True})
    s = cache_settings(pol, DEFAULTS)
    assert isinstance(s, InjectionSettings) and s.kv_events
    (cache,) = render_cache_pod(pol, s, "gpu-node-0")["spec"]["containers"]
    assert {"name": c.KV_EVENTS_PORT_NAME, "containerPort": c.KV_EVENTS_PORT, "protocol": "TCP"} in cache["ports"]
    assert {e["name"]: e.get("value") for e in cache["env"]}[c.ENV_KV_EVENTS_PORT] == str(c.KV_EVENTS_PORT)
    _, anyone = render_cache_network_policy(pol, s.kv_events)["spec"]["ingress"]
    assert {"port": c.KV_EVENTS_PORT, "protocol": "TCP"} in anyone["ports"]
    _, anyone_off = render_cache_network_policy(pol)["spec"]["ingress"]
    assert {"port": c.KV_EVENTS_PORT, "protocol": "TCP"} not in anyone_off["ports"]
    r = render_node_mode_fragment(deployment(), node_settings(pol), NATIVE)
    assert isinstance(r, RenderedInjection)
    (engine,) = pod_spec(r)["containers"]
    assert {"name": c.ENV_KV_EVENTS, "value": "true"} in engine["env"]
