"""The bundle's run-time checks: where deps/ goes on sys.path, and the one-line errors at start."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload import contract as c
from kvoffload.connector import bundle as b

pytestmark = pytest.mark.connector


def make_bundle(root: Path, python_tag: str = "cpython-312") -> Path:
    """A bundle folder layout with this package's file where the real one would be."""
    connector = root / c.BUNDLE_PYTHON_DIR / "kvoffload" / "connector"
    connector.mkdir(parents=True)
    (root / c.BUNDLE_DEPS_DIR).mkdir()
    (root / c.BUNDLE_MANIFEST).write_text(json.dumps({"python": python_tag, "lmcache": "0.5.6"}))
    return connector / "bundle.py"


def test_a_package_inside_a_bundle_finds_it(tmp_path: Path) -> None:
    found = b.find_bundle(str(make_bundle(tmp_path)))
    assert found == b.Bundle(root=tmp_path, python_tag="cpython-312", lmcache_version="0.5.6")


def test_the_development_tree_is_not_a_bundle() -> None:
    assert b.find_bundle() is None


def test_deps_go_to_the_end_of_sys_path_once(tmp_path: Path) -> None:
    found = b.find_bundle(str(make_bundle(tmp_path)))
    assert found
    path = ["/image/site-packages", str(tmp_path / c.BUNDLE_PYTHON_DIR)]
    assert b.add_deps(found, path) is True
    assert b.add_deps(found, path) is False
    assert path == ["/image/site-packages", str(tmp_path / c.BUNDLE_PYTHON_DIR), str(tmp_path / c.BUNDLE_DEPS_DIR)]


def test_a_bundle_for_another_python_is_refused_naming_both(tmp_path: Path) -> None:
    found = b.find_bundle(str(make_bundle(tmp_path, "cpython-312")))
    assert found
    assert b.python_mismatch(found, "cpython-312") is None
    reason = b.python_mismatch(found, "cpython-310")
    assert reason and "built for cpython-312 but TensorRT-LLM runs cpython-310" in reason


def test_missing_packages_are_named() -> None:
    assert b.missing_packages(("json", "kvoffload_no_such_package", "os")) == ["kvoffload_no_such_package"]


def test_a_compiled_part_that_does_not_load_fails_naming_the_extension_and_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = b.importlib.import_module

    def fake_import(name: str) -> object:
        if name in b.LMCACHE_COMPILED:
            raise ImportError("undefined symbol: _ZN3c10 (stand-in)")
        return real(name)

    monkeypatch.setattr(b.importlib, "import_module", fake_import)
    with pytest.raises(b.BundleError, match=r"lmcache\.lmcache_native .* does not load against this image's torch"):
        b.load_lmcache(None)


def test_an_lmcache_the_seam_was_not_written_for_is_refused_at_start_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The connector uses private names of LMCache (listed in lmcache_seam); on another version it
    stops at start naming both versions, before any of them is reached."""
    import lmcache

    from kvoffload.connector import lmcache_seam

    b.load_lmcache(None)  # the pinned version passes
    monkeypatch.setattr(lmcache, "__version__", "0.5.7")
    with pytest.raises(b.BundleError) as refused:
        b.load_lmcache(None)
    message = str(refused.value)
    assert "\n" not in message
    assert "LMCache 0.5.7 is installed" in message
    assert all(v in message for v in lmcache_seam.SUPPORTED_LMCACHE_VERSIONS)


def test_lmcache_native_uses_no_symbol_of_torchs_cpp_api() -> None:
    """lmcache_native links libtorch but calls none of it, so it loads against any image's torch;
    if a new lmcache changes that, the bundle starts to depend on the image's torch build."""
    import lmcache

    nm = shutil.which("nm")
    assert nm, "binutils' nm is needed to read lmcache's extension"
    native = next(Path(lmcache.__file__).parent.glob(f"lmcache_native.{sys.implementation.cache_tag}*.so"))
    undefined = subprocess.run(
        [nm, "-D", "-C", "--undefined-only", str(native)], capture_output=True, text=True, check=True
    )
    torch_api = [
        line for line in undefined.stdout.splitlines() if any(ns in line for ns in ("c10::", "at::", "torch::"))
    ]
    assert torch_api == []
