"""Hypothesis strategies over everything a user controls: annotations, policy specs, pod templates, sidecar env."""

from __future__ import annotations

import json
import re
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from hack.workloads import trtllm_container, trtllm_deployment
from kvoffload import contract as c
from kvoffload.operator.intent.settings import (
    OperatorDefaults,
)
from kvoffload.operator.plan.fragment import RenderedInjection
from tests.support.scale import count

EXAMPLES = count(ci=1000, soak=5000)


FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


DEFAULTS = OperatorDefaults(sidecar_image="registry.example/sidecar:t", bundle_image="registry.example/bundle:t")


DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


HOSTILE = st.sampled_from([
    "", " ", "true", "TRUE", "yes", "1", "-1", "0", "20Gi", "-20Gi", "20GB", "20 Gi", "1e3", "1Ei", "999999Pi",
    "sidecar", "node", "Sidecar", "inprocess", "image", "init-container", "--port=1", "--extra_llm_api_options=/x",
    "a\nb: c", "x\"; rm -rf /", "$(id)", "`id`", "{{ .Values }}", "${HOME}", "key: value\n- item", "\u200b",
    "ñandú", "名字", "\U0001f600", "a" * 300, "redis://x", "redis://u:p@h:1", "rediss://h", "http://h", "/abs",
    "rel/path", "..", "nul\x00byte", "kvoffload-cache", "trtllm", "lru", "LRU", "ARC", "null", "[]", "{}",
])  # fmt: skip


TEXT = st.one_of(HOSTILE, st.text(max_size=40))


SCALAR: st.SearchStrategy[Any] = st.one_of(
    TEXT, st.integers(-(2**70), 2**70), st.booleans(), st.none(), st.floats(allow_nan=True)
)


JSONISH: st.SearchStrategy[Any] = st.recursive(
    SCALAR, lambda kids: st.one_of(st.lists(kids, max_size=3), st.dictionaries(TEXT, kids, max_size=3)), max_leaves=8
)


ANNOTATION_KEYS = st.sampled_from([
    c.ANN_ENABLED, c.ANN_POLICY, c.ANN_CONTAINER, c.ANN_CONNECTOR_SOURCE, c.ANN_MODE, c.ANN_CPU_CACHE_SIZE,
    c.ANN_SHM_SIZE, c.ANN_BACKEND, "kvoffload.io/unknown", "other.io/x",
])  # fmt: skip


ANNOTATIONS = st.dictionaries(ANNOTATION_KEYS, TEXT, max_size=8)


def _policy_value(key: str) -> st.SearchStrategy[Any]:
    """Mostly plausible values for a known policy field, sometimes anything."""
    plausible: dict[str, st.SearchStrategy[Any]] = {
        "mode": st.sampled_from(["sidecar", "node", "x"]),
        "shmSize": st.sampled_from(["1Gi", "512Mi", "0", "-1Gi", "1.5Gi", "100m"]),
        "l1Size": st.sampled_from(["4Gi", "256Mi", "0", "1Pi", "3Ki", "abc"]),
        "evictionPolicy": st.sampled_from(["LRU", "ARC", "FIFO"]),
        "chunkSize": st.integers(-32, 70000),
        "maxWorkers": st.integers(-2, 100),
        "backend": st.sampled_from(["sidecar", "inprocess", "remote"]),
        "source": st.sampled_from(["init-container", "image", "git"]),
        "gpuAccess": st.sampled_from(["none", "nvidia-runtime", "all"]),
        "timeout": st.integers(-1, 700_000),
        "image": TEXT,
        "path": st.one_of(st.sampled_from(["/var/cache/kv", "/tmp/l2"]), TEXT),
        "url": st.one_of(st.sampled_from(["redis://redis:6379", "rediss://r.example:6380/0"]), TEXT),
    }
    return st.one_of(plausible.get(key, JSONISH), plausible.get(key, JSONISH), JSONISH)


POLICY_SPEC: st.SearchStrategy[Any] = st.fixed_dictionaries(
    {},
    optional={
        "mode": _policy_value("mode"),
        "shmSize": _policy_value("shmSize"),
        "cache": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "l1Size": _policy_value("l1Size"),
                    "evictionPolicy": _policy_value("evictionPolicy"),
                    "chunkSize": _policy_value("chunkSize"),
                    "maxWorkers": _policy_value("maxWorkers"),
                },
            ),
            JSONISH,
        ),
        "sidecar": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "image": _policy_value("image"),
                    "gpuAccess": _policy_value("gpuAccess"),
                    "runtimeClassName": TEXT,
                    "resources": JSONISH,
                    "imagePullPolicy": st.sampled_from(["Always", "Never", "Sometimes"]),
                },
            ),
            JSONISH,
        ),
        "connector": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "backend": _policy_value("backend"),
                    "source": _policy_value("source"),
                    "bundleImage": _policy_value("image"),
                    "lookupTimeoutMs": _policy_value("timeout"),
                    "retrieveTimeoutMs": _policy_value("timeout"),
                    "storeTimeoutMs": _policy_value("timeout"),
                    "saveDecodeTokens": st.one_of(st.booleans(), TEXT),
                },
            ),
            JSONISH,
        ),
        "l2": st.one_of(
            st.fixed_dictionaries(
                {},
                optional={
                    "fs": st.fixed_dictionaries(
                        {}, optional={"path": _policy_value("path"), "size": _policy_value("l1Size")}
                    ),
                    "redis": st.fixed_dictionaries(
                        {},
                        optional={
                            "url": _policy_value("url"),
                            "passwordSecretRef": st.one_of(st.fixed_dictionaries({"name": TEXT, "key": TEXT}), JSONISH),
                        },
                    ),
                },
            ),
            JSONISH,
        ),
    },
)


def policy_object(spec: Any) -> dict[str, Any]:
    return {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
            "metadata": {"name": "p", "namespace": "ns", "resourceVersion": "1", "generation": 1}, "spec": spec}  # fmt: skip


CONTAINER_NAMES = st.sampled_from(["trtllm", "engine", "server", "kvoffload-cache", "a" * 63, "sidecar-x"])


ENV_VARS = st.lists(
    st.fixed_dictionaries({"name": st.sampled_from([c.ENV_SERVER_URL, c.ENV_PYTHONHASHSEED, c.ENV_CHUNK_SIZE,
                                                     "HF_HOME", "PATH", c.ENV_PYTHONPATH]), "value": TEXT}),
    max_size=4, unique_by=lambda e: e["name"],
)  # fmt: skip


ARGS = st.lists(st.one_of(HOSTILE, st.sampled_from(["--extra_llm_api_options", "/etc/opts.yaml", "--port", "8000"])),
                max_size=6)  # fmt: skip


@st.composite
def workloads(draw: st.DrawFn) -> dict[str, Any]:
    """A Deployment as a user might write it, including odd args/env/names."""
    names = draw(st.lists(CONTAINER_NAMES, min_size=1, max_size=3, unique=True))
    containers = []
    for i, name in enumerate(names):
        container = trtllm_container(name=name)
        container["args"] = draw(ARGS) if draw(st.booleans()) else container["args"]
        container["env"] = draw(ENV_VARS)
        if i > 0 and draw(st.integers(0, 4)):
            container["resources"] = {}  # mostly one GPU container: the rest of the renderer gets exercised
        containers.append(container)
    volumes = draw(st.lists(st.fixed_dictionaries({"name": st.sampled_from(["data", c.VOLUME_SHM, "dshm"]),
                                                   "emptyDir": st.just({})}),
                            max_size=2, unique_by=lambda v: v["name"]))  # fmt: skip
    obj = trtllm_deployment("fuzz-" + draw(st.sampled_from(["a", "b" * 40, "c-1"])), "ns",
                            annotations={c.ANN_ENABLED: "true"}, containers=containers, volumes=volumes)  # fmt: skip
    obj["metadata"].update({"uid": "u-1", "generation": 1, "resourceVersion": "7"})
    return obj


VALID_SPEC = st.fixed_dictionaries({}, optional={
    "shmSize": st.sampled_from(["1Gi", "512Mi", "3G"]),
    "cache": st.fixed_dictionaries({}, optional={
        "l1Size": st.sampled_from(["4Gi", "256Mi", "1Ti"]), "chunkSize": st.sampled_from([16, 256, 65536]),
        "maxWorkers": st.integers(1, 64), "evictionPolicy": st.sampled_from(["LRU", "ARC"])}),
    "sidecar": st.fixed_dictionaries({}, optional={
        "gpuAccess": st.sampled_from(["none", "nvidia-runtime"]), "runtimeClassName": st.sampled_from(["", "nvidia"]),
        "resources": st.sampled_from([{}, {"limits": {"memory": "8Gi"}}])}),
    "connector": st.fixed_dictionaries({}, optional={
        "backend": st.sampled_from(["sidecar", "inprocess"]), "source": st.sampled_from(["init-container", "image"]),
        "saveDecodeTokens": st.booleans(), "lookupTimeoutMs": st.integers(1, 600_000)}),
    "l2": st.fixed_dictionaries({}, optional={
        "fs": st.fixed_dictionaries({"path": st.sampled_from(["/var/cache/kv", "/l2"]),
                                     "size": st.sampled_from(["10Gi", "1Mi"])}),
        "redis": st.fixed_dictionaries({"url": st.just("redis://redis.cache:6379")}, optional={
            "passwordSecretRef": st.just({"name": "redis-auth", "key": "password"})})}),
})  # fmt: skip


def check_rendered(rendered: RenderedInjection) -> None:
    """Invariants every apply body must keep for the apiserver to accept it."""
    json.dumps(rendered.workload_apply)
    json.dumps(rendered.configmap_apply)
    spec = rendered.workload_apply["spec"]["template"]["spec"]
    for list_name in ("containers", "initContainers"):
        items = spec.get(list_name) or []
        assert len({x["name"] for x in items}) == len(items), f"duplicate {list_name}"
        for container in items:
            assert DNS_LABEL.match(container["name"]), container["name"]
            envs = container.get("env") or []
            assert len({e["name"] for e in envs}) == len(envs), "duplicate env"
            assert all(isinstance(e.get("value", ""), str) for e in envs)
            assert all(isinstance(a, str) for a in container.get("args") or [])
            mounts = container.get("volumeMounts") or []
            assert len({m["mountPath"] for m in mounts}) == len(mounts), "duplicate mountPath"
    volumes = spec.get("volumes") or []
    assert len({v["name"] for v in volumes}) == len(volumes)
    assert all(isinstance(v, str) for v in rendered.configmap_apply.get("data", {}).values())


RENDER_ANNOTATIONS = st.one_of(
    st.fixed_dictionaries({}, optional={c.ANN_CONTAINER: CONTAINER_NAMES, c.ANN_CPU_CACHE_SIZE: st.just("2Gi"),
                                        c.ANN_SHM_SIZE: st.sampled_from(["1Gi", "64Mi"])}),
    ANNOTATIONS,
)  # fmt: skip


SIDECAR_ENV_KEYS = st.sampled_from([
    c.ENV_REQUEST_PORT, c.ENV_LMCACHE_HTTP_PORT, c.ENV_SIDECAR_HTTP_PORT, c.ENV_L1_SIZE, c.ENV_EVICTION_POLICY,
    c.ENV_MAX_WORKERS, c.ENV_L2_FS_PATH, c.ENV_L2_FS_SIZE, c.ENV_L2_REDIS_URL, c.ENV_L2_REDIS_PASSWORD,
    c.ENV_INSTANCE_ID, c.ENV_SHM_NAME, c.ENV_GRACE_SECONDS, c.ENV_CHUNK_SIZE, c.ENV_LMCACHE_TRACK_USAGE,
    c.ENV_PROMETHEUS_MULTIPROC_DIR,
])  # fmt: skip


SIDECAR_VALUES = st.one_of(TEXT, st.integers(-5, 70000).map(str), st.sampled_from(["5555", "9455", "1Gi", "/tmp/x"]))
