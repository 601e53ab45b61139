"""The connector bundle in a TensorRT-LLM-shaped image, with the env and options file the operator renders.

The bundle is built by ``hack/build_bundle.py`` (the Dockerfile's recipe) for the image's Python;
the engine is the TensorRT-LLM stand-in running in ``$KVOFFLOAD_CACHE/trtllm-image``, which holds
only what a TensorRT-LLM image ships on this path (``hack/trtllm-image/requirements.txt``): no
lmcache, no kvoffload, none of lmcache's other dependencies. It stores to and loads from a real
LMCache server.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hack import trtllm_image
from hack.journey import shared_prefix_prompts
from hack.workloads import trtllm_container, trtllm_deployment
from kvoffload import contract as c
from kvoffload.connector.bundle import LMCACHE_COMPILED
from kvoffload.operator.admission.records import injected_pod
from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
from kvoffload.operator.intent.workload import read_workload
from kvoffload.operator.plan.fragment import ClusterInfo, RenderedInjection, render, render_injection_fragment
from kvoffload.operator.plan.injection_plan import InjectionPlan, RecordedOptions, plan_workload
from kvoffload.operator.plan.injection_record import InjectionRecord
from kvoffload.operator.plan.workload_apply import render_admission
from tests.support.lmcache_server import LMCacheServer
from tests.support.options_init import options_init_container, run_options_init

pytestmark = [pytest.mark.connector, pytest.mark.chart]

PREFIX_TOKENS = 512


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return trtllm_image.build_bundle(tmp_path_factory.mktemp("bundle") / "kvoffload-bundle")


@pytest.fixture(scope="module")
def rendered() -> RenderedInjection:
    """What the operator injects into a plain trtllm-serve Deployment with default settings."""
    settings = resolve_settings({c.ANN_ENABLED: "true"}, None, OperatorDefaults(), "llm")
    assert isinstance(settings, InjectionSettings), settings
    result = render_injection_fragment(
        trtllm_deployment("llama", "llm"), settings, ClusterInfo(native_sidecars=True, operator_version="test")
    )
    assert isinstance(result, RenderedInjection), result
    return result


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, rendered: RenderedInjection) -> Iterator[LMCacheServer]:
    policy = json.loads(rendered.configmap_apply["data"][c.POLICY_FILE])
    lmcache = LMCacheServer(chunk_size=policy["cache"]["chunkSize"], log_dir=tmp_path_factory.mktemp("lmcache"))
    lmcache.start()
    try:
        yield lmcache
    finally:
        lmcache.stop()


def engine_env(rendered: RenderedInjection, bundle: Path, run_dir: Path, server_url: str) -> dict[str, str]:
    """The engine container's rendered env, container paths mapped to local folders; only the URL differs."""
    spec = rendered.workload_apply["spec"]["template"]["spec"]
    engine = next(x for x in spec["containers"] if x["name"] == rendered.engine_container)
    mounts = {c.BUNDLE_MOUNT_PATH: str(bundle), c.RUN_MOUNT_PATH: str(run_dir)}
    env: dict[str, str] = {}
    for var in engine["env"]:
        value = var["value"]
        for container_path, local in mounts.items():
            value = value.replace(container_path, local)
        env[var["name"]] = value
    env[c.ENV_SERVER_URL] = server_url  # the sidecar's 127.0.0.1 port is the test server's
    (run_dir / "metrics").mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    return {**base, **env}


def run_engine(
    workdir: Path, env: dict[str, str], options_yaml: str, prompts: list[Any]
) -> subprocess.CompletedProcess[str]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / c.TRTLLM_OPTIONS_FILE).write_text(options_yaml)
    (workdir / "prompts.json").write_text(json.dumps(prompts))
    argv = trtllm_image.engine_argv(
        "--options", str(workdir / c.TRTLLM_OPTIONS_FILE), "--prompts", str(workdir / "prompts.json"),
        "--out", str(workdir / "report.json"),
    )  # fmt: skip
    return subprocess.run(argv, env=env, cwd=workdir, capture_output=True, text=True, timeout=600)


def partial_bundle(bundle: Path, dest: Path, drop_deps: tuple[str, ...]) -> Path:
    """A copy of ``bundle`` (links) whose ``deps/`` lacks every entry starting with one of ``drop_deps``."""
    (dest / c.BUNDLE_DEPS_DIR).mkdir(parents=True)
    (dest / c.BUNDLE_PYTHON_DIR).symlink_to(bundle / c.BUNDLE_PYTHON_DIR)
    shutil.copy(bundle / c.BUNDLE_MANIFEST, dest / c.BUNDLE_MANIFEST)
    for entry in (bundle / c.BUNDLE_DEPS_DIR).iterdir():
        if not entry.name.lower().startswith(drop_deps):
            (dest / c.BUNDLE_DEPS_DIR / entry.name).symlink_to(entry)
    return dest


def test_bundle_stores_and_loads_bit_exact_in_a_trtllm_image(
    bundle: Path, rendered: RenderedInjection, server: LMCacheServer, tmp_path: Path
) -> None:
    env = engine_env(rendered, bundle, tmp_path / "run", server.url)
    options = rendered.configmap_apply["data"][c.TRTLLM_OPTIONS_FILE]
    done = run_engine(tmp_path / "engine", env, options, shared_prefix_prompts(3, PREFIX_TOKENS, 32))
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "engine" / "report.json").read_text())

    results = [r for phase in report["phases"] if "results" in phase for r in phase["results"]]
    assert results and not any(r["failed"] for r in results)
    assert report["kv_mismatches"] == 0
    later = report["phases"][2]["results"]
    assert all(r["connector_matched_tokens"] >= PREFIX_TOKENS for r in later), later

    # The only compiled code the connector loads from the bundle's python/ is bundle.LMCACHE_COMPILED
    # (lmcache.cuda_ops, built against one torch, is not on the connector's path).
    ours = str(bundle / c.BUNDLE_PYTHON_DIR)
    loaded = {name for name, path in report["extension_files"].items() if path.startswith(ours)}
    assert loaded == set(LMCACHE_COMPILED), loaded

    origins = report["modules"]
    image_site = str(trtllm_image.IMAGE_ENV)
    for ours in ("kvoffload.connector", "kvoffload.contract", "lmcache"):
        assert origins[ours].startswith(str(bundle / c.BUNDLE_PYTHON_DIR)), (ours, origins[ours])
    # The bundle is the connector's distribution and the floor (common's packages): no operator, no sidecar.
    floor = {
        p.name
        for p in (trtllm_image.REPO_ROOT / "common" / "src" / "kvoffload").iterdir()
        if (p / "__init__.py").is_file()
    }
    assert sorted(
        p.name for p in (bundle / c.BUNDLE_PYTHON_DIR / "kvoffload").iterdir() if p.is_dir() and p.name != "__pycache__"
    ) == sorted({"connector", *floor})
    for missing_from_image in ("cachetools", "numba"):
        assert str(bundle / c.BUNDLE_DEPS_DIR) in origins[missing_from_image], origins[missing_from_image]
    for pinned_by_image in ("torch", "numpy", "zmq", "pydantic", "fastapi", "prometheus_client"):
        assert origins[pinned_by_image].startswith(image_site), (pinned_by_image, origins[pinned_by_image])


@pytest.mark.parametrize(
    ("dropped", "named", "not_named"),
    [
        (("",), ("cachetools", "numba", "msgspec"), ("torch", "numpy")),  # no deps/ at all
        (("numba", "llvmlite"), ("numba",), ("cachetools",)),
    ],
    ids=["without-deps", "without-numba"],
)
def test_bundle_missing_a_package_fails_at_start_naming_it(
    bundle: Path,
    rendered: RenderedInjection,
    tmp_path: Path,
    dropped: tuple[str, ...],
    named: tuple[str, ...],
    not_named: tuple[str, ...],
) -> None:
    broken = partial_bundle(bundle, tmp_path / "bundle", dropped)
    env = engine_env(rendered, broken, tmp_path / "run", "tcp://127.0.0.1:9")
    options = rendered.configmap_apply["data"][c.TRTLLM_OPTIONS_FILE]
    done = run_engine(tmp_path / "engine", env, options, shared_prefix_prompts(1, 64, 8))
    assert done.returncode != 0
    line = next(x for x in reversed(done.stderr.splitlines()) if "BundleError: " in x)
    assert "found neither in the TensorRT-LLM image nor in the connector bundle" in line, line
    assert all(name in line for name in named), line
    assert not any(name in line for name in not_named), line


def test_the_pods_options_init_step_runs_from_the_bundle_in_a_trtllm_image(bundle: Path, tmp_path: Path) -> None:
    """Admission mode's options init container runs ``python3 -m kvoffload.trtllm_options_init`` with
    the engine's image and the bundle on PYTHONPATH: in the image's Python (no kvoffload of its own)
    it merges the user's file into the same bytes template mode writes."""
    user = "max_batch_size: 8\nkv_cache_config: {free_gpu_memory_fraction: 0.9}\n"
    engine = trtllm_container("/config/extra.yaml")
    engine["volumeMounts"] = [{"name": "cfg", "mountPath": "/config"}]
    workload = trtllm_deployment("llama", "llm", containers=[engine],
                                 volumes=[{"name": "cfg", "configMap": {"name": "llama-options"}}])  # fmt: skip
    settings = resolve_settings({c.ANN_ENABLED: "true"}, None, OperatorDefaults(), "llm")
    assert isinstance(settings, InjectionSettings) and settings.connector_source == "init-container"
    cluster = ClusterInfo(native_sidecars=True, operator_version="test", injection="admission")
    plan = plan_workload(read_workload(copy.deepcopy(workload)), settings, cluster, RecordedOptions(user))
    assert isinstance(plan, InjectionPlan), plan
    rendered = render_admission(plan)
    record = InjectionRecord.from_json(rendered.workload_apply["metadata"]["annotations"][c.ANN_INJECTION_RECORD])
    assert isinstance(record, InjectionRecord)
    template = copy.deepcopy(workload["spec"]["template"])
    pod = {"metadata": {"labels": template["metadata"]["labels"]}, "spec": template["spec"]}
    injected = injected_pod(pod, "Deployment", "llama", "llm", record)
    assert isinstance(injected, dict), injected
    init = options_init_container(injected)
    assert {"name": c.ENV_PYTHONPATH, "value": c.BUNDLE_PYTHONPATH} in init["env"]
    assert (bundle / c.BUNDLE_PYTHON_DIR / "kvoffload" / "trtllm_options_init.py").is_file()
    alone = subprocess.run([str(trtllm_image.image_python()), "-c", "import kvoffload.trtllm_options_init"],
                           env={"PATH": os.environ.get("PATH", "")}, capture_output=True, timeout=60, check=False)  # fmt: skip
    assert alone.returncode != 0, "the image has a kvoffload of its own: the run below would not test the bundle"
    ran = run_options_init(injected, {"/config/extra.yaml": user}, tmp_path / "pod",
                           python=str(trtllm_image.image_python()), pythonpath=str(bundle / c.BUNDLE_PYTHON_DIR))  # fmt: skip
    assert ran.returncode == 0 and ran.stderr == "", ran.stderr
    template_mode = render(replace(plan, cluster=replace(cluster, injection="template")))
    assert ran.options == template_mode.files[c.TRTLLM_OPTIONS_FILE]
