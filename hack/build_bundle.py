"""Build the connector bundle: the one recipe the Dockerfile's bundle-build stage and the tests both run.

Run it with the Python of the TensorRT-LLM images the bundle is for (3.12): pip picks the
wheels of the interpreter it runs on, and lmcache's compiled parts are per Python ABI.

    python3.12 hack/build_bundle.py --out /kvoffload-bundle --dist /wheels/kvoffload_common-0.1.0-py3-none-any.whl \
        --dist /wheels/kvoffload_connector-0.1.0-py3-none-any.whl

Without ``--dist`` it builds from this checkout's ``common/`` and ``connector/`` folders: the bundle
holds the connector's distribution and the floor it stands on, never the operator or the sidecar.

Layout (``kvoffload.contract``): ``python/`` holds kvoffload and lmcache (no dependencies) and is
put on PYTHONPATH by the operator; ``deps/`` holds the third-party packages lmcache imports that a
TensorRT-LLM image lacks, which the connector appends to the END of ``sys.path`` so the image's
own packages (torch, numpy, pydantic, fastapi, pyzmq...) always win. ``bundle.json`` records what
the bundle was built with; the connector compares it with the engine's Python at start.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HACK = Path(__file__).resolve().parent
REPO_ROOT = HACK.parent
BUNDLED_DISTRIBUTIONS = (REPO_ROOT / "common", REPO_ROOT / "connector")
sys.path.insert(0, str(REPO_ROOT / "common" / "src"))  # the contract, also where no kvoffload is installed

from kvoffload import contract  # noqa: E402

REQUIREMENTS = HACK / "bundle-requirements.txt"
DEFAULT_LMCACHE = "0.5.6"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", *args], check=True)


def _source_copy(dist: str, scratch: Path) -> str:
    """A wheel as given; a distribution's folder is copied first, so pip's in-tree build leaves the checkout clean."""
    source = Path(dist)
    if not source.is_dir():
        return dist
    copy = scratch / source.name
    shutil.copytree(source, copy, symlinks=True, ignore=shutil.ignore_patterns("*.egg-info", "__pycache__", "build"))
    return str(copy)


def build(out: Path, dists: list[str], lmcache_version: str, requirements: Path = REQUIREMENTS) -> Path:
    """Install kvoffload's distributions and lmcache into ``out/python``, lmcache's missing deps into ``out/deps``."""
    python_dir = out / contract.BUNDLE_PYTHON_DIR
    deps_dir = out / contract.BUNDLE_DEPS_DIR
    for folder in (python_dir, deps_dir):
        if folder.exists():
            shutil.rmtree(folder)
    with tempfile.TemporaryDirectory() as scratch:
        sources = [_source_copy(dist, Path(scratch)) for dist in dists]
        _pip("--target", str(python_dir), *sources, f"lmcache=={lmcache_version}")
    _pip("--only-binary=:all:", "--target", str(deps_dir), "-r", str(requirements))
    for cache in list(out.rglob("__pycache__")):
        shutil.rmtree(cache, ignore_errors=True)
    manifest = {
        "python": sys.implementation.cache_tag,
        "lmcache": lmcache_version,
        "python_dir": contract.BUNDLE_PYTHON_DIR,
        "deps_dir": contract.BUNDLE_DEPS_DIR,
    }
    (out / contract.BUNDLE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="bundle folder to (re)create")
    parser.add_argument(
        "--dist",
        action="append",
        dest="dists",
        help="a kvoffload wheel or distribution folder to bundle (repeat); default: common/ and connector/",
    )
    parser.add_argument("--lmcache-version", default=DEFAULT_LMCACHE)
    parser.add_argument(
        "--requirements", type=Path, default=REQUIREMENTS, help="deps/ list (for an image known to have some of them)"
    )
    args = parser.parse_args(argv)
    build(args.out, args.dists or [str(d) for d in BUNDLED_DISTRIBUTIONS], args.lmcache_version, args.requirements)
    return 0


if __name__ == "__main__":
    sys.exit(main())
