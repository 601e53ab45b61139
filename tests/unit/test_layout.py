"""Package layout rules: the stdlib `operator` is never shadowed, and components import only what they may."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import kvoffload

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_python_run_from_the_repo_root_imports_the_stdlib_operator() -> None:
    location = _run("import operator; print(operator.__file__)")
    assert not location.startswith(str(ROOT))
    assert location.endswith("operator.py")


def test_the_package_is_real_folders_without_symlinks() -> None:
    links = [p for p in (ROOT / "kvoffload").rglob("*") if p.is_symlink()]
    assert links == []
    folders = [p for p in (ROOT / "kvoffload").rglob("*") if p.is_dir() and p.name != "__pycache__"]
    assert {p.name for p in folders} >= {"operator", "sidecar", "connector"}
    assert all((p / "__init__.py").exists() for p in folders), "every folder is a regular package"


def _modules_after_importing(modules: list[str]) -> set[str]:
    code = "import sys, json\n" + "".join(f"import {m}\n" for m in modules) + "print(json.dumps(sorted(sys.modules)))"
    return set(json.loads(_run(code)))


def _component_modules(component: str) -> list[str]:
    return [
        f"kvoffload.{component}.{m.name}"
        for m in pkgutil.iter_modules([str(ROOT / "kvoffload" / component)])
        if not m.name.startswith("_") or m.name == "__main__"
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


def test_version_is_exposed() -> None:
    assert kvoffload.__version__
