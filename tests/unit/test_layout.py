"""Layout rules: the design card's top level, four distributions sharing the ``kvoffload`` namespace,
the stdlib ``operator`` never shadowed, and components importing only what they may."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import tomllib

import kvoffload
import kvoffload.operator

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ("operator", "sidecar", "connector")
DISTRIBUTIONS = ("common", *COMPONENTS)


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_python_run_from_the_repo_root_imports_the_stdlib_operator() -> None:
    location = _run("import operator; print(operator.__file__)")
    assert not location.startswith(str(ROOT))
    assert location.endswith("operator.py")


def test_the_top_level_is_the_design_cards() -> None:
    for name in ("pyproject.toml", "operator", "sidecar", "connector", "charts", "tests", "Dockerfile"):
        assert (ROOT / name).exists(), name
    assert not (ROOT / "kvoffload").exists(), "the code lives in the component folders"


def test_each_folder_is_a_distribution_holding_its_part_of_the_kvoffload_namespace() -> None:
    for name in DISTRIBUTIONS:
        project = tomllib.loads((ROOT / name / "pyproject.toml").read_text())["project"]
        assert project["name"] == f"kvoffload-{name}"
        assert not (ROOT / name / "src" / "kvoffload" / "__init__.py").exists(), "kvoffload is a namespace package"
    for name in COMPONENTS:
        assert (ROOT / name / "src" / "kvoffload" / name / "__init__.py").exists()


def test_the_imported_kvoffload_is_the_four_folders_of_this_checkout() -> None:
    assert sorted(kvoffload.__path__) == sorted(str(ROOT / name / "src" / "kvoffload") for name in DISTRIBUTIONS)


def test_the_packages_are_real_folders_without_symlinks() -> None:
    for name in DISTRIBUTIONS:
        src = ROOT / name / "src"
        assert [p for p in src.rglob("*") if p.is_symlink()] == []
        folders = [p for p in (src / "kvoffload").rglob("*") if p.is_dir() and p.name != "__pycache__"]
        assert all((p / "__init__.py").exists() for p in folders), "every folder below kvoffload/ is a regular package"


def _modules_after_importing(modules: list[str]) -> set[str]:
    code = "import sys, json\n" + "".join(f"import {m}\n" for m in modules) + "print(json.dumps(sorted(sys.modules)))"
    return set(json.loads(_run(code)))


def _component_modules(component: str) -> list[str]:
    folder = ROOT / component / "src" / "kvoffload" / component
    return [
        m.name
        for m in pkgutil.walk_packages([str(folder)], prefix=f"kvoffload.{component}.")
        if not m.name.rsplit(".", 1)[-1].startswith("_") or m.name.endswith(".__main__")
    ]


def test_operator_imports_neither_torch_nor_lmcache() -> None:
    loaded = _modules_after_importing(_component_modules("operator"))
    assert not {"torch", "lmcache"} & loaded


def test_connector_never_imports_kopf_or_kubernetes() -> None:
    modules = [m for m in _component_modules("connector") if m != "kvoffload.connector.__main__"]
    loaded = _modules_after_importing(["tests.support.standin_path", *modules])
    assert not {"kopf", "kubernetes"} & loaded


def test_contract_imports_only_the_standard_library() -> None:
    loaded = _modules_after_importing(["kvoffload.contract", "kvoffload.quantity"])
    baseline = _modules_after_importing([])
    third_party = {m.split(".")[0] for m in loaded - baseline} - set(sys.stdlib_module_names) - {"kvoffload"}
    assert third_party == set()


def test_the_operators_version_is_the_distributions_version() -> None:
    versions = {
        tomllib.loads((ROOT / name / "pyproject.toml").read_text())["project"]["version"] for name in DISTRIBUTIONS
    }
    assert versions == {kvoffload.operator.__version__}
