"""The pure renderer: odd pod specs, conflicts with user settings, determinism, removal."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
from kvoffload.operator.intent.trtllm_options import OPTIONS_PATH
from kvoffload.operator.intent.workload import read_workload
from kvoffload.operator.plan.fragment import (
    ClusterInfo,
    RenderedInjection,
    render_injection_fragment,
    render_removal,
)
from kvoffload.operator.plan.fragment import render as fragment_render
from kvoffload.operator.plan.injection_plan import RecordedOptions, plan_workload
from kvoffload.operator.plan.injection_record import record_of
from kvoffload.policy_values import WORKLOAD_DEPENDENT, PolicyError
from kvoffload.quantity import parse_bytes
from tests.unit.operator.workload_builders import applied, container, deployment, live

pytestmark = pytest.mark.operator
NATIVE = ClusterInfo(native_sidecars=True, operator_version="9.9.9")
PLAIN = ClusterInfo(native_sidecars=False, operator_version="9.9.9")


def settings_for(**annotations: str) -> InjectionSettings:
    s = resolve_settings({c.ANN_ENABLED: "true", **annotations}, None, OperatorDefaults(), "ns")
    assert isinstance(s, InjectionSettings), s
    return s


def render(obj: dict[str, Any], cluster: ClusterInfo = NATIVE, user_options: str | None = None,
           **annotations: str) -> RenderedInjection:  # fmt: skip
    r = render_injection_fragment(obj, settings_for(**annotations), cluster, user_options)
    assert isinstance(r, RenderedInjection), r
    return r


def fail(obj: dict[str, Any], **annotations: str) -> PolicyError:
    r = render_injection_fragment(obj, settings_for(**annotations), NATIVE)
    assert isinstance(r, PolicyError), r
    return r


def pod(body: dict[str, Any]) -> dict[str, Any]:
    return body["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(x for x in items if x["name"] == name)


def env_of(x: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in x.get("env", [])}


def test_plain_trtllm_deployment_gets_the_full_injection() -> None:
    r = render(deployment())
    body = r.workload_apply
    assert body["metadata"] == {"name": "llama", "namespace": "ns"}
    assert set(body["spec"]) == {"template"}  # nothing outside the pod template
    spec = pod(body)
    assert [x["name"] for x in spec["initContainers"]] == [c.BUNDLE_INIT_CONTAINER, c.SIDECAR_CONTAINER]
    sidecar = named(spec["initContainers"], c.SIDECAR_CONTAINER)
    assert sidecar["restartPolicy"] == "Always" and sidecar["command"] == ["kvoffload-sidecar"]
    assert {p["name"] for p in sidecar["ports"]} == {c.SIDECAR_PORT_NAME, c.REQUEST_PORT_NAME}
    assert sidecar["startupProbe"]["httpGet"] == {"path": c.PATH_STARTUP, "port": c.SIDECAR_PORT_NAME, "scheme": "HTTP"}
    assert sidecar["readinessProbe"]["httpGet"]["path"] == c.PATH_READY
    assert sidecar["livenessProbe"]["httpGet"]["path"] == c.PATH_LIVE
    assert sidecar["resources"] == {"requests": {"cpu": "1", "memory": "22Gi"}, "limits": {"memory": "22Gi"}}
    sc = sidecar["securityContext"]
    assert sc["runAsNonRoot"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c.ENV_NVIDIA_VISIBLE_DEVICES not in env_of(sidecar)  # the shared-memory data path needs no GPU
    assert "nvidia.com/gpu" not in json.dumps(sidecar)
    assert spec["shareProcessNamespace"] is True
    assert "runtimeClassName" not in spec  # not configured
    engine = named(spec["containers"], "trtllm")
    env = env_of(engine)
    assert env[c.ENV_SERVER_URL] == "tcp://127.0.0.1:5555" and env[c.ENV_PYTHONHASHSEED] == "0"
    assert env[c.ENV_PROMETHEUS_MULTIPROC_DIR] == c.METRICS_DIR and env[c.ENV_PYTHONPATH] == c.BUNDLE_PYTHONPATH
    assert engine["args"][-2:] == ["--extra_llm_api_options", OPTIONS_PATH]
    assert {m["mountPath"] for m in engine["volumeMounts"]} == {
        c.SHM_MOUNT_PATH, c.RUN_MOUNT_PATH, c.BUNDLE_MOUNT_PATH, c.TRTLLM_OPTIONS_MOUNT_PATH}  # fmt: skip
    assert "image" not in engine and "resources" not in engine  # never touches the user's fields
    volumes = {v["name"]: v for v in spec["volumes"]}
    # /dev/shm holds LMCache's L1 (20Gi) plus the engine's own share (8Gi).
    assert volumes[c.VOLUME_SHM]["emptyDir"] == {"medium": "Memory", "sizeLimit": "28Gi"}
    assert volumes[c.VOLUME_TRTLLM_OPTIONS]["configMap"]["name"] == "llama-kvoffload"
    meta = body["spec"]["template"]["metadata"]
    assert meta["annotations"][c.ANN_INJECTED_VERSION] == "9.9.9"
    assert meta["annotations"][c.ANN_CONFIG_HASH] == r.config_hash
    assert meta["annotations"]["prometheus.io/port"] == "9455"
    assert r.forceable_fields == ('.spec.template.spec.containers[name="trtllm"].args',)
    cm = r.configmap_apply
    assert cm["metadata"]["name"] == "llama-kvoffload"
    assert cm["metadata"]["ownerReferences"] == [
        {"apiVersion": "apps/v1", "kind": "Deployment", "name": "llama", "uid": "uid-llama"}]  # fmt: skip
    assert "KvoffloadConnectorWorker" in cm["data"][c.TRTLLM_OPTIONS_FILE]
    assert json.loads(cm["data"][c.POLICY_FILE])["cache"]["l1Size"] == "20Gi"


def test_old_clusters_get_a_plain_sidecar_container() -> None:
    spec = pod(render(deployment(), PLAIN).workload_apply)
    assert [x["name"] for x in spec["initContainers"]] == [c.BUNDLE_INIT_CONTAINER]
    sidecar = named(spec["containers"], c.SIDECAR_CONTAINER)
    assert "restartPolicy" not in sidecar


def test_existing_init_containers_are_kept_and_ours_added() -> None:
    obj = deployment()
    obj["spec"]["template"]["spec"]["initContainers"] = [{"name": "download-model", "image": "busybox"}]
    obj = live(obj)
    spec = pod(render(obj).workload_apply)
    assert "download-model" not in [x["name"] for x in spec["initContainers"]]  # theirs: untouched, not owned


def test_existing_dev_shm_volume_is_reused() -> None:
    engine = container()
    engine["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    obj = deployment(containers=[engine], volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory"}}])
    spec = pod(render(obj).workload_apply)
    assert c.VOLUME_SHM not in [v["name"] for v in spec["volumes"]]
    assert all(m["mountPath"] != c.SHM_MOUNT_PATH for m in named(spec["containers"], "trtllm")["volumeMounts"])
    sidecar = named(spec["initContainers"], c.SIDECAR_CONTAINER)
    assert {"name": "dshm", "mountPath": "/dev/shm"} in sidecar["volumeMounts"]


@pytest.mark.parametrize(("size_limit", "refused"), [("64Mi", True), ("27Gi", True), ("28Gi", False), ("1Ti", False)])
def test_a_users_dev_shm_too_small_for_the_l1_is_refused_before_a_pod_would_run_slow(
    size_limit: str, refused: bool
) -> None:
    engine = container()
    engine["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volume = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size_limit}}
    r = render_injection_fragment(deployment(containers=[engine], volumes=[volume]), settings_for(), NATIVE)
    if refused:  # defaults: a 20Gi L1 beside the engine's 8Gi share needs 28Gi
        assert isinstance(r, PolicyError) and r.reason == "shm_too_small" and "at least 28Gi" in r.message, r
    else:
        assert isinstance(r, RenderedInjection), r


def test_several_containers_pick_the_gpu_one() -> None:
    helper = {"name": "proxy", "image": "envoy", "resources": {"limits": {"cpu": "1"}}}
    obj = deployment(containers=[helper, container()])
    r = render(obj)
    assert r.engine_container == "trtllm"
    assert [x["name"] for x in pod(r.workload_apply)["containers"]] == ["trtllm"]


def test_container_annotation_wins() -> None:
    obj = deployment(containers=[container(name="a"), container(name="b")])
    assert render(obj, **{c.ANN_CONTAINER: "b"}).engine_container == "b"
    e = fail(obj, **{c.ANN_CONTAINER: "zz"})
    assert e.field == c.ANN_CONTAINER and "a, b" in e.message


@pytest.mark.parametrize(
    "containers",
    [
        [container(name="a"), container(name="b")],  # two GPU containers
        [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}],  # no GPU, two containers
    ],
)
def test_ambiguous_container_is_an_error_listing_the_choices(containers: list[dict[str, Any]]) -> None:
    e = fail(deployment(containers=containers))
    assert e.reason == "ambiguous_container" and c.ANN_CONTAINER in e.message and "a, b" in e.message


def test_only_container_without_gpu_request_is_the_engine() -> None:
    plain = container()
    plain.pop("resources")
    assert render(deployment(containers=[plain])).engine_container == "trtllm"


@pytest.mark.parametrize(
    ("name", "value", "outcome"),
    [
        (c.ENV_PYTHONHASHSEED, "0", "shared"),  # same value: co-owned
        (c.ENV_PYTHONHASHSEED, "42", "error"),  # required and different
        (c.ENV_SERVER_URL, "tcp://elsewhere:1", "error"),
        (c.ENV_CHUNK_SIZE, "512", "user"),  # tunable: the user's value stays
        (c.ENV_LOOKUP_TIMEOUT_MS, "30", "user"),
        (c.ENV_PYTHONPATH, "/app", "error"),
        (c.ENV_PYTHONPATH, f"{c.BUNDLE_PYTHONPATH}:/app", "shared"),
    ],
)
def test_existing_env_var_of_the_same_name(name: str, value: str, outcome: str) -> None:
    engine = container()
    engine["env"] = [{"name": name, "value": value}]
    obj = deployment(containers=[engine])
    r = render_injection_fragment(obj, settings_for(), NATIVE)
    if outcome == "error":
        assert isinstance(r, PolicyError) and r.reason == "conflict"
        assert name in r.message and repr(value) in r.message
        return
    assert isinstance(r, RenderedInjection)
    env = env_of(named(pod(r.workload_apply)["containers"], "trtllm"))
    if outcome == "shared":
        assert env[name] == value
    else:
        assert name not in env


def test_env_value_from_for_a_required_variable_is_an_error() -> None:
    engine = container()
    engine["env"] = [{"name": c.ENV_PYTHONHASHSEED, "valueFrom": {"configMapKeyRef": {"name": "x", "key": "y"}}}]
    e = fail(deployment(containers=[engine]))
    assert "valueFrom" in e.message


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda s: s["containers"].append({"name": c.SIDECAR_CONTAINER, "image": "mine"}), "containers"),
        (lambda s: s["volumes"].append({"name": c.VOLUME_RUN, "emptyDir": {}}), "volumes"),
        (lambda s: s["containers"][0].update(volumeMounts=[{"name": "v", "mountPath": c.RUN_MOUNT_PATH}]),
         "volumeMounts"),
        (lambda s: s.update(shareProcessNamespace=False), "shareProcessNamespace"),
    ],
)  # fmt: skip
def test_user_fields_that_collide_with_ours_are_errors(mutate: Any, field: str) -> None:
    manifest = deployment()
    manifest.pop("metadata")
    obj = deployment()
    mutate(obj["spec"]["template"]["spec"])
    e = fail(live({**obj, "metadata": {"name": "llama", "namespace": "ns", "annotations": {}}}))
    assert field in e.field or field in e.message
    assert e.reason == "conflict"


@pytest.mark.parametrize("backend", ["sidecar", "inprocess"])
def test_a_host_network_workload_is_refused_before_its_cache_listens_on_the_nodes_loopback(backend: str) -> None:
    obj = deployment()
    obj["spec"]["template"]["spec"]["hostNetwork"] = True
    e = fail(obj, **{c.ANN_BACKEND: backend})
    assert e.field == "spec.template.spec.hostNetwork" and e.reason == "host_network"
    assert "node's loopback" in e.message and "remove hostNetwork" in e.message


def test_user_scrape_annotations_are_left_alone_with_a_warning() -> None:
    obj = deployment()
    obj["spec"]["template"]["metadata"]["annotations"] = {"prometheus.io/port": "8000"}
    r = render(live({**obj, "metadata": {"name": "llama", "namespace": "ns"}}))
    annotations = r.workload_apply["spec"]["template"]["metadata"]["annotations"]
    assert "prometheus.io/port" not in annotations
    assert any("prometheus.io/port" in w for w in r.warnings)


def test_connector_source_image_skips_the_bundle() -> None:
    spec = pod(render(deployment(), **{c.ANN_CONNECTOR_SOURCE: "image"}).workload_apply)
    assert [x["name"] for x in spec["initContainers"]] == [c.SIDECAR_CONTAINER]
    assert c.ENV_PYTHONPATH not in env_of(named(spec["containers"], "trtllm"))
    assert c.VOLUME_BUNDLE not in [v["name"] for v in spec["volumes"]]


def test_inprocess_backend_has_no_sidecar_and_the_connector_serves_the_pod_metrics() -> None:
    applied_body = render(deployment(), **{c.ANN_BACKEND: "inprocess"}).workload_apply
    spec = pod(applied_body)
    assert c.SIDECAR_CONTAINER not in json.dumps(spec) and "shareProcessNamespace" not in spec
    engine = named(spec["containers"], "trtllm")
    assert env_of(engine)[c.ENV_BACKEND] == "inprocess"
    assert env_of(engine)[c.ENV_METRICS_PORT] == str(c.ENGINE_METRICS_PORT)
    assert [p["name"] for p in engine["ports"]] == [c.ENGINE_METRICS_PORT_NAME]
    annotations = applied_body["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(c.ENGINE_METRICS_PORT)


def test_inprocess_backend_sizes_the_engines_l1_and_shm_from_the_policy() -> None:
    """With backend inprocess the engine hosts LMCache's server: its L1 is the policy's (not the
    connector's 1Gi default) and lives in the pod's /dev/shm, which must hold it."""
    s = settings_for(**{c.ANN_BACKEND: "inprocess", c.ANN_CPU_CACHE_SIZE: "6Gi"})
    spec = pod(render(deployment(), **{c.ANN_BACKEND: "inprocess", c.ANN_CPU_CACHE_SIZE: "6Gi"}).workload_apply)
    assert env_of(named(spec["containers"], "trtllm"))[c.ENV_L1_SIZE] == "6Gi"
    shm = named(spec["volumes"], c.VOLUME_SHM)["emptyDir"]["sizeLimit"]
    assert parse_bytes(shm, "shm") == s.shm_bytes + 6 * 2**30


def test_with_a_sidecar_the_connector_serves_no_metrics_port() -> None:
    spec = pod(render(deployment()).workload_apply)
    engine = named(spec["containers"], "trtllm")
    assert c.ENV_METRICS_PORT not in env_of(engine) and "ports" not in engine


def test_policy_tiers_and_runtime_class() -> None:
    policy = {"metadata": {"name": "p"}, "spec": {
        "l2": {"fs": {"path": "/cache", "size": "5Gi"},
               "redis": {"url": "redis://r:6379", "passwordSecretRef": {"name": "redis", "key": "pw"}}},
        "sidecar": {"runtimeClassName": "nvidia", "gpuAccess": "nvidia-runtime"}}}  # fmt: skip
    s = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, OperatorDefaults(), "ns")
    assert isinstance(s, InjectionSettings)
    r = render_injection_fragment(deployment(), s, NATIVE)
    assert isinstance(r, RenderedInjection)
    spec = pod(r.workload_apply)
    assert spec["runtimeClassName"] == "nvidia"
    sidecar = named(spec["initContainers"], c.SIDECAR_CONTAINER)
    assert env_of(sidecar)[c.ENV_L2_REDIS_PASSWORD] == {"secretKeyRef": {"name": "redis", "key": "pw"}}
    assert env_of(sidecar)[c.ENV_NVIDIA_VISIBLE_DEVICES] == "all"  # opted in: sees the GPU without requesting one
    assert {"name": c.VOLUME_L2_FS, "mountPath": "/cache"} in sidecar["volumeMounts"]
    assert named(spec["volumes"], c.VOLUME_L2_FS)["emptyDir"] == {"sizeLimit": "5Gi"}


@pytest.mark.parametrize("files_on_pod", [False, True], ids=["template", "admission"])
def test_a_redis_url_from_a_secret_reaches_the_cache_server_by_reference_and_nothing_rendered_names_it(
    files_on_pod: bool,
) -> None:
    """The URL (and its user) stay in the user's Secret: the pod, its files and the record name only
    the Secret, so no write of the operator's and no answer of its webhook carries them."""
    policy = {
        "metadata": {"name": "p"},
        "spec": {
            "l2": {
                "redis": {
                    "urlSecretRef": {"name": "redis-url", "key": "url"},
                    "passwordSecretRef": {"name": "redis", "key": "pw"},
                }
            }
        },
    }
    s = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, OperatorDefaults(), "ns")
    assert isinstance(s, InjectionSettings)
    plan = plan_workload(read_workload(deployment()), s, NATIVE, RecordedOptions(None), None)
    assert not isinstance(plan, PolicyError)
    r = fragment_render(plan, files_on_pod=files_on_pod)
    sidecar = named(pod(r.workload_apply)["initContainers"], c.SIDECAR_CONTAINER)
    assert env_of(sidecar)[c.ENV_L2_REDIS_URL] == {"secretKeyRef": {"name": "redis-url", "key": "url"}}
    assert json.loads(r.files[c.POLICY_FILE])["l2"]["redis"]["urlSecretRef"] == {"name": "redis-url", "key": "url"}
    everything = json.dumps([r.workload_apply, r.files, r.configmap_apply, record_of(plan).to_json()])
    assert "redis://" not in everything
    assert json.loads(record_of(plan).to_json())["settings"]["redis_tier"]["url"] is None


def test_rendering_is_deterministic_and_the_hash_follows_the_config() -> None:
    a, b = render(deployment()), render(deployment())
    assert json.dumps(a.workload_apply, sort_keys=False) == json.dumps(b.workload_apply, sort_keys=False)
    assert a.configmap_apply == b.configmap_apply
    bigger = render(deployment(), **{c.ANN_CPU_CACHE_SIZE: "30Gi"})
    assert bigger.config_hash != a.config_hash


@pytest.mark.parametrize("cluster", [NATIVE, PLAIN])
def test_rerendering_from_the_injected_object_is_a_no_op(cluster: ClusterInfo) -> None:
    obj = deployment()
    first = render(obj, cluster)
    injected = applied(obj, first.workload_apply)
    second = render(injected, cluster)
    assert second.workload_apply == first.workload_apply
    assert applied(injected, second.workload_apply)["spec"] == injected["spec"]


def test_rerendering_after_a_policy_change_replaces_our_values_only() -> None:
    obj = deployment()
    injected = applied(obj, render(obj).workload_apply)
    changed = render(injected, **{c.ANN_CPU_CACHE_SIZE: "30Gi", c.ANN_SHM_SIZE: "2Gi"})
    spec = pod(changed.workload_apply)
    assert named(spec["volumes"], c.VOLUME_SHM)["emptyDir"]["sizeLimit"] == "32Gi"  # 30Gi L1 + 2Gi
    engine = named(spec["containers"], "trtllm")
    assert engine["args"].count("--extra_llm_api_options") == 1


@pytest.mark.parametrize(
    ("user_options", "chunk", "refused"),
    [
        (None, "48", "tokens_per_block, 32 (TensorRT-LLM's default)"),  # no options file: ours, default blocks
        ("kv_cache_config:\n  tokens_per_block: 16\n", "48", None),
        ("kv_cache_config:\n  tokens_per_block: 64\n", "96", "tokens_per_block, 64 (its options file)"),
        (None, "256", None),
    ],
)
def test_a_chunk_size_the_engines_blocks_do_not_divide_is_refused_before_the_engine_starts(
    user_options: str | None, chunk: str, refused: str | None
) -> None:
    policy = {"metadata": {"name": "p"}, "spec": {"cache": {"chunkSize": int(chunk)}}}
    settings = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, OperatorDefaults(), "ns")
    assert isinstance(settings, InjectionSettings), settings
    obj = deployment()
    if user_options is not None:
        engine = container(options_file="/config/extra.yaml")
        engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config"}]
        obj = deployment(containers=[engine], volumes=[{"name": "cfg", "configMap": {"name": "llm-options"}}])
    r = render_injection_fragment(obj, settings, NATIVE, user_options)
    if refused is None:
        assert isinstance(r, RenderedInjection), r
    else:
        assert isinstance(r, PolicyError) and r.field == "cache.chunkSize" and refused in r.message, r


def test_options_from_a_configmap_are_merged_and_the_arg_rewritten() -> None:
    engine = container(options_file="/config/extra.yaml")
    engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config"}]
    obj = deployment(containers=[engine], volumes=[{"name": "cfg", "configMap": {"name": "llm-options"}}])
    r = render(obj, user_options="max_batch_size: 8\nkv_cache_config:\n  free_gpu_memory_fraction: 0.8\n")
    spec = pod(r.workload_apply)
    args = named(spec["containers"], "trtllm")["args"]
    assert args[args.index("--extra_llm_api_options") + 1] == OPTIONS_PATH
    assert (
        r.workload_apply["spec"]["template"]["metadata"]["annotations"][c.ANN_ORIGINAL_OPTIONS_PATH]
        == "/config/extra.yaml"
    )
    merged = r.configmap_apply["data"][c.TRTLLM_OPTIONS_FILE]
    assert "max_batch_size: 8" in merged and "free_gpu_memory_fraction: 0.8" in merged
    assert "enable_block_reuse: true" in merged
    # Re-rendering from the injected object keeps the original path known.
    again = render(applied(obj, r.workload_apply), user_options="max_batch_size: 8\n")
    assert again.workload_apply["spec"]["template"]["metadata"]["annotations"][c.ANN_ORIGINAL_OPTIONS_PATH] == (
        "/config/extra.yaml")  # fmt: skip


def test_options_baked_into_the_image_get_a_manual_step_warning() -> None:
    obj = deployment(containers=[container(options_file="/app/options.yaml")])
    r = render(obj)
    assert "args" not in named(pod(r.workload_apply)["containers"], "trtllm")
    assert len(r.warnings) == 1 and OPTIONS_PATH in r.warnings[0] and "/app/options.yaml" in r.warnings[0]
    assert r.forceable_fields == ()


def test_removal_of_an_untouched_workload_does_nothing() -> None:
    assert render_removal(read_workload(deployment())).steps == ()


def test_removal_restores_args_then_hands_them_off_then_releases() -> None:
    obj = deployment()
    original_args = copy.deepcopy(obj["spec"]["template"]["spec"]["containers"][0]["args"])
    injected = applied(obj, render(obj).workload_apply)
    plan = render_removal(read_workload(injected))
    managers = [s.field_manager for s in plan.steps]
    assert managers == [c.FIELD_MANAGER, c.FIELD_MANAGER_HANDOFF, c.FIELD_MANAGER]
    assert pod(plan.steps[0].body)["containers"] == [{"name": "trtllm", "args": original_args}]
    assert plan.steps[1].body == plan.steps[0].body
    assert plan.steps[2].body == {"apiVersion": "apps/v1", "kind": "Deployment",
                                  "metadata": {"name": "llama", "namespace": "ns"}}  # fmt: skip


def test_removal_without_args_is_one_empty_apply() -> None:
    obj = deployment(containers=[container(options_file="/app/options.yaml")])
    injected = applied(obj, render(obj).workload_apply)
    plan = render_removal(read_workload(injected))
    assert len(plan.steps) == 1 and "spec" not in plan.steps[0].body


def test_unsupported_kind_is_an_error() -> None:
    obj = deployment()
    obj["kind"] = "DaemonSet"
    assert fail(obj).reason == "unsupported"


NAMES = st.sampled_from(["trtllm", "proxy", "sidecar", "a", c.SIDECAR_CONTAINER])
ENV_NAMES = st.sampled_from([c.ENV_PYTHONHASHSEED, c.ENV_CHUNK_SIZE, c.ENV_PYTHONPATH, "HF_HOME", c.ENV_SERVER_URL])


@st.composite
def odd_containers(draw: Any) -> list[dict[str, Any]]:
    names = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
    out = []
    for name in names:
        x = container(name=name, options_file=draw(st.sampled_from([None, "/app/o.yaml"])))
        if draw(st.booleans()):
            x.pop("resources")
        x["env"] = [{"name": n, "value": draw(st.sampled_from(["0", "1", "/x"]))}
                    for n in draw(st.lists(ENV_NAMES, max_size=3, unique=True))]  # fmt: skip
        if draw(st.booleans()):
            x["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        out.append(x)
    return out


@settings(max_examples=150, deadline=None)
@given(
    odd_containers(), st.booleans(), st.sampled_from([{}, {c.ANN_CONTAINER: "trtllm"}, {c.ANN_BACKEND: "inprocess"}])
)
def test_fuzz_renderer_never_raises_and_injects_exactly_once(containers: list[dict[str, Any]], native: bool,
                                                             annotations: dict[str, str]) -> None:  # fmt: skip
    obj = deployment(containers=containers, volumes=[{"name": "dshm", "emptyDir": {"medium": "Memory"}}])
    cluster = NATIVE if native else PLAIN
    r = render_injection_fragment(obj, settings_for(**annotations), cluster)
    if isinstance(r, PolicyError):
        assert r.message and r.field
        return
    spec = pod(r.workload_apply)
    names = [x["name"] for x in [*spec.get("initContainers", []), *spec["containers"]]]
    assert len(names) == len(set(names))
    again = render_injection_fragment(applied(obj, r.workload_apply), settings_for(**annotations), cluster)
    assert isinstance(again, RenderedInjection) and again.workload_apply == r.workload_apply


@pytest.mark.parametrize(
    ("user_options", "setting"),
    [
        ("kv_connector_config:\n  connector_module: kvbm.trtllm\n  connector_worker_class: W\n", "kv_connector_config"),
        ("kv_connector_config:\n  connector: lmcache\n", "kv_connector_config.connector"),
        ("kv_cache_config:\n  enable_block_reuse: false\n", "kv_cache_config.enable_block_reuse"),
        ("kv_cache_config:\n  host_cache_size: 1073741824\n", "kv_cache_config.host_cache_size"),
        ("kv_cache_config:\n  max_attention_window: [4096, 32768]\n  use_kv_cache_manager_v2: false\n",
         "kv_cache_config.max_attention_window"),
        ("scheduler_config:\n  capacity_scheduler_policy: MAX_UTILIZATION\n", "scheduler_config.capacity_scheduler_policy"),
        ("pipeline_parallel_size: 2\n", "pipeline_parallel_size"),
        ("max_beam_width: 4\n", "max_beam_width"),
    ],
)  # fmt: skip
def test_user_options_tensorrt_llm_refuses_with_a_connector_are_refused_naming_the_setting(
    user_options: str, setting: str
) -> None:
    engine = container(options_file="/config/extra.yaml")
    engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config"}]
    obj = deployment(containers=[engine], volumes=[{"name": "cfg", "configMap": {"name": "llm-options"}}])
    r = render_injection_fragment(obj, settings_for(), NATIVE, user_options)
    assert isinstance(r, PolicyError) and r.reason == "invalid_options", r
    assert r.field == "ConfigMap llm-options key extra.yaml" and f"{setting}: " in r.message, r.message


@pytest.mark.parametrize(
    "user_options",
    [
        "kv_cache_config:\n  enable_block_reuse: true\n  enable_partial_reuse: true\n  host_cache_size: 0\n",
        "scheduler_config:\n  capacity_scheduler_policy: GUARANTEED_NO_EVICT\n",
        "kv_connector_config:\n  connector_module: kvoffload.connector.trtllm\n",
        "speculative_config:\n  decoding_type: MTP\n  num_nextn_predict_layers: 1\n",
        "kv_cache_config:\n  max_attention_window: [32768, 32768]\n",
        "kv_cache_config:\n  max_attention_window: [4096, 32768]\n",  # VSWA: served on KVCacheManagerV2
        "kv_cache_config:\n  use_kv_cache_manager_v2: true\n",
        "kv_cache_config:\n  use_kv_cache_manager_v2: auto\n",
    ],
)
def test_user_options_that_run_with_the_connector_are_kept(user_options: str) -> None:
    engine = container(options_file="/config/extra.yaml")
    engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config"}]
    obj = deployment(containers=[engine], volumes=[{"name": "cfg", "configMap": {"name": "llm-options"}}])
    r = render_injection_fragment(obj, settings_for(), NATIVE, user_options)
    assert isinstance(r, RenderedInjection), r
    merged = yaml.safe_load(r.configmap_apply["data"][c.TRTLLM_OPTIONS_FILE])
    for key, value in yaml.safe_load(user_options).items():
        assert {**merged[key], **value} == merged[key] if isinstance(value, dict) else merged[key] == value


def test_a_hybrid_linear_attention_model_is_refused_before_the_pod_naming_why() -> None:
    """Qwen3-Next's linear-attention layers keep a recurrent state, not per-token KV: a prefix cannot be
    restored from cached blocks. The operator says so before the pod, from the model argument."""
    engine = container()
    engine["args"] = ["Qwen/Qwen3-Next-80B-A3B-Instruct"]
    r = render_injection_fragment(deployment(containers=[engine]), settings_for(), NATIVE)
    assert isinstance(r, PolicyError) and r.reason == "unsupported", r
    assert "Qwen3-Next mixes linear-attention layers" in r.message and "opt this workload out" in r.message


@pytest.mark.parametrize(
    ("model", "feature"),
    [
        ("openai/gpt-oss-120b", "GPT-OSS alternates sliding-window and full-attention"),
        ("/models/google/gemma-3-27b-it", "Gemma 3 alternates local sliding-window"),
    ],
)
def test_a_sliding_window_model_is_injected_unless_its_options_force_the_v1_manager(model: str, feature: str) -> None:
    """GPT-OSS and Gemma run on KVCacheManagerV2 by default, where the connector serves their layer
    groups; an options file forcing V1 (which refuses a connector with sliding windows) is refused
    before the pod, naming the setting."""
    engine = container(options_file="/config/extra.yaml")
    engine["args"] = ["serve", model, "--extra_llm_api_options", "/config/extra.yaml"]
    engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config"}]
    obj = deployment(containers=[engine], volumes=[{"name": "cfg", "configMap": {"name": "llm-options"}}])
    served = render_injection_fragment(
        obj, settings_for(), NATIVE, "kv_cache_config:\n  free_gpu_memory_fraction: 0.8\n"
    )
    assert isinstance(served, RenderedInjection), served
    v1 = render_injection_fragment(obj, settings_for(), NATIVE, "kv_cache_config:\n  use_kv_cache_manager_v2: false\n")
    assert isinstance(v1, PolicyError) and v1.reason == "unsupported", v1
    assert feature in v1.message and "use_kv_cache_manager_v2: false" in v1.message


@pytest.mark.parametrize(
    ("args", "feature"),
    [
        (["serve", "deepseek-ai/DeepSeek-V3.2-Exp"], "DeepSeek-V3.2 adds sparse attention"),
        (["/models/deepseek-ai/DeepSeek-V4"], "DeepSeek-V4 keeps KV layer groups of different tokens per block"),
    ],
)
def test_a_latent_attention_model_the_connector_cannot_serve_is_refused_before_the_pod_naming_why(
    args: list[str], feature: str
) -> None:
    """Sparse or compressed attention beside the latent: refused at engine start (by TensorRT-LLM or
    the connector), so the operator says so first, from the model argument."""
    engine = container()
    engine["args"] = args
    r = render_injection_fragment(deployment(containers=[engine]), settings_for(), NATIVE)
    assert isinstance(r, PolicyError) and r.reason == "unsupported", r
    assert r.field == "container trtllm model" and feature in r.message and "opt this workload out" in r.message


@pytest.mark.parametrize(
    "args",
    [
        ["meta-llama/Llama-3.1-8B-Instruct"],
        ["serve", "deepseek-ai/DeepSeek-R1-Distill-Llama-8B"],  # a Llama: no latent attention
        ["serve", "deepseek-ai/DeepSeek-V3"],  # multi-head latent attention: one latent per layer, served
        ["/models/deepseek-ai/DeepSeek-R1-0528"],
        ["moonshotai/Kimi-K2-Instruct"],
        ["deepseek-ai/DeepSeek-V2-Lite"],
        ["--host", "0.0.0.0", "openai/gpt-oss-120b"],
        ["serve", "google/gemma-3-27b-it"],  # sliding windows on KVCacheManagerV2 (its default for Gemma)
    ],
)
def test_models_of_one_layer_group_latent_attention_or_unknown_ones_are_injected(args: list[str]) -> None:
    engine = container()
    engine["args"] = args
    r = render_injection_fragment(deployment(containers=[engine]), settings_for(), NATIVE)
    assert not isinstance(r, PolicyError), r


def test_kvoffloads_containers_run_on_a_read_only_root_and_write_only_to_their_run_volume() -> None:
    spec = pod(render(deployment()).workload_apply)
    cache = named(spec["initContainers"], c.SIDECAR_CONTAINER)
    bundle = named(spec["initContainers"], c.BUNDLE_INIT_CONTAINER)
    for injected in (cache, bundle):
        assert injected["securityContext"]["readOnlyRootFilesystem"] is True, injected["name"]
    env = env_of(cache)
    run_mount = next(m for m in cache["volumeMounts"] if m["name"] == c.VOLUME_RUN)
    assert run_mount["mountPath"] == c.RUN_MOUNT_PATH and not run_mount.get("readOnly")
    assert env[c.ENV_TMPDIR] == c.RUN_MOUNT_PATH
    assert env[c.ENV_NUMBA_CACHE_DIR].startswith(c.RUN_MOUNT_PATH + "/")


def _with_policy(spec: dict[str, Any]) -> InjectionSettings | PolicyError:
    policy = {"metadata": {"name": "p"}, "spec": spec}
    return resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, OperatorDefaults(), "ns")


def test_kv_events_on_put_the_events_port_on_the_cache_server_and_tell_both_sides() -> None:
    topic = "kv@$(KVOFFLOAD_POD_IP):8000@llama"
    s = _with_policy({"kvEvents": {"enabled": True, "topic": topic}})
    assert isinstance(s, InjectionSettings)
    r = render_injection_fragment(deployment(), s, NATIVE)
    assert isinstance(r, RenderedInjection)
    spec = pod(r.workload_apply)
    sidecar = named(spec["initContainers"], c.SIDECAR_CONTAINER)
    assert {"name": c.KV_EVENTS_PORT_NAME, "containerPort": c.KV_EVENTS_PORT, "protocol": "TCP"} in sidecar["ports"]
    env = env_of(sidecar)
    assert env[c.ENV_KV_EVENTS_PORT] == str(c.KV_EVENTS_PORT) and env[c.ENV_KV_EVENTS_TOPIC] == topic
    names = [e["name"] for e in sidecar["env"]]  # Kubernetes expands $(VAR) only for a VAR defined before
    assert names.index(c.ENV_POD_IP) < names.index(c.ENV_KV_EVENTS_TOPIC)
    assert env[c.ENV_POD_IP] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
    assert env_of(named(spec["containers"], "trtllm"))[c.ENV_KV_EVENTS] == "true"
    assert json.loads(r.files[c.POLICY_FILE])["kvEvents"] == {"enabled": True, "topic": topic}
    assert c.ENV_KV_EVENTS_FORMAT not in env  # the default format (vLLM >= 0.24's maps) sets nothing


def test_a_kv_events_format_other_than_the_default_reaches_the_cache_server_and_a_bad_one_is_refused() -> None:
    s = _with_policy({"kvEvents": {"enabled": True, "format": "vllm-positional"}})
    assert isinstance(s, InjectionSettings)
    r = render_injection_fragment(deployment(), s, NATIVE)
    assert isinstance(r, RenderedInjection)
    sidecar = named(pod(r.workload_apply)["initContainers"], c.SIDECAR_CONTAINER)
    assert env_of(sidecar)[c.ENV_KV_EVENTS_FORMAT] == "vllm-positional"
    assert json.loads(r.files[c.POLICY_FILE])["kvEvents"]["format"] == "vllm-positional"
    bad = _with_policy({"kvEvents": {"enabled": True, "format": "vllm-0.23"}})
    assert (
        isinstance(bad, PolicyError) and bad.field.endswith("kvEvents.format") and "vllm-positional" in bad.allowed
    ), bad


def test_kv_events_off_by_default_render_exactly_what_they_rendered_before() -> None:
    """Off (the default): no port, no env, and the policy file without a kvEvents key, so that an
    operator upgrade rolls no pod of a workload that did not turn events on."""
    r = render(deployment())
    assert c.KV_EVENTS_PORT_NAME not in json.dumps(r.workload_apply)
    assert "KV_EVENTS" not in json.dumps(r.workload_apply) and c.ENV_POD_IP not in json.dumps(r.workload_apply)
    assert "kvEvents" not in r.files[c.POLICY_FILE]
    assert c.KV_EVENTS_PORT != 5557  # TensorRT-LLM's (and vLLM's) own event port, which the engine may bind


def test_kv_events_with_the_inprocess_backend_are_refused_naming_the_field() -> None:
    """In one spec, as the CRD's rule does; with the backend from the operator's defaults, per workload."""
    s = _with_policy({"kvEvents": {"enabled": True}, "connector": {"backend": "inprocess"}})
    assert isinstance(s, PolicyError) and s.field.endswith("connector.backend") and "kvEvents" in s.allowed, s
    policy = {"metadata": {"name": "p"}, "spec": {"kvEvents": {"enabled": True}}}
    defaults = OperatorDefaults(spec={"connector": {"backend": "inprocess"}})
    merged = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, defaults, "ns")
    assert isinstance(merged, PolicyError) and merged.field.endswith("kvEvents.enabled"), merged
    assert merged.reason == WORKLOAD_DEPENDENT


@pytest.mark.parametrize("topic", ["kv@ pod@m", "x" * 257, "a\x00b"])
def test_a_kv_events_topic_with_spaces_control_characters_or_too_long_is_refused(topic: str) -> None:
    s = _with_policy({"kvEvents": {"enabled": True, "topic": topic}})
    assert isinstance(s, PolicyError) and s.field.endswith("kvEvents.topic"), s


def test_an_injection_record_without_kv_events_is_the_one_written_before_they_existed() -> None:
    """Admission mode hashes the record into the pod template's label: a new field at its default
    must not change it, or an operator upgrade would roll every workload."""
    assert not {"kv_events", "kv_events_topic"} & settings_for().as_record().keys()
    on = _with_policy({"kvEvents": {"enabled": True, "topic": "t"}})
    assert isinstance(on, InjectionSettings)
    assert InjectionSettings.from_record(on.as_record()) == on
    assert InjectionSettings.from_record(settings_for().as_record()) == settings_for()
