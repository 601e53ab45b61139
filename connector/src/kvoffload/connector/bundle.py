"""The connector bundle at run time: its ``deps/`` on ``sys.path``, and a loud check that lmcache loads here.

The operator's init container copies the bundle (``kvoffload.contract``: ``python/``, ``deps/``,
``bundle.json``) into the TensorRT-LLM pod and puts ``python/`` first on PYTHONPATH. lmcache needs
third-party packages that TensorRT-LLM images lack; the bundle carries them in ``deps/``, which is
appended to the END of ``sys.path`` here, so every package the image ships (torch, numpy, pydantic,
fastapi, pyzmq...) stays the image's own. Outside a bundle (development, the sidecar) nothing changes.

TensorRT-LLM turns any exception from a connector's constructor into "Error instantiating
connector" and stops, so what cannot work here fails at start with one message naming the cause
(wrong Python, a missing package, lmcache's compiled part not loading against the image's torch).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload import contract

logger = logging.getLogger("kvoffload.connector")

LMCACHE_SEAM = "kvoffload.connector.lmcache_seam"
"""The connector's one module that imports lmcache (imported here once the bundle's path is set)."""

LMCACHE_COMPILED = ("lmcache.lmcache_native",)
"""lmcache's compiled extensions on that path (linked against libtorch). ``lmcache.cuda_ops`` is not
on it: the connector copies blocks with torch itself."""

LMCACHE_THIRD_PARTY = (
    "numpy",
    "torch",
    "zmq",
    "yaml",
    "requests",
    "prometheus_client",
    "msgspec",
    "cachetools",
    "numba",
    "nvtx",
    "psutil",
    "cpuinfo",
    "sortedcontainers",
    "opentelemetry",
    "aiohttp",
)
"""Top-level packages lmcache 0.5.6 imports on that path (``python -X importtime``); named when missing."""


class BundleError(RuntimeError):
    """The bundle cannot work in this engine's environment; the message names why."""


@dataclass(frozen=True)
class Bundle:
    """A connector bundle found on disk."""

    root: Path
    python_tag: str
    lmcache_version: str

    @property
    def deps(self) -> Path:
        return self.root / contract.BUNDLE_DEPS_DIR


def find_bundle(package_file: str = __file__) -> Bundle | None:
    """The bundle holding this package (``<root>/python/kvoffload/connector/``), or None outside one."""
    python_dir = Path(os.path.abspath(package_file)).parent.parent.parent
    root = python_dir.parent
    manifest = root / contract.BUNDLE_MANIFEST
    if python_dir.name != contract.BUNDLE_PYTHON_DIR or not manifest.is_file():
        return None
    data = json.loads(manifest.read_text())
    return Bundle(root=root, python_tag=str(data["python"]), lmcache_version=str(data["lmcache"]))


def python_mismatch(bundle: Bundle, cache_tag: str | None) -> str | None:
    """Why this interpreter cannot load the bundle's compiled parts, or None when it can."""
    if cache_tag == bundle.python_tag:
        return None
    return (
        f"kvoffload: the connector bundle at {bundle.root} was built for {bundle.python_tag} but TensorRT-LLM runs "
        f"{cache_tag}; lmcache's compiled parts load only in the Python they were built for: "
        f"use a connector-bundle image built for {cache_tag} (docs/connector.md, 'Images')"
    )


def add_deps(bundle: Bundle, path: list[str]) -> bool:
    """Append the bundle's ``deps/`` to the END of ``path`` (once); True when it was added."""
    deps = str(bundle.deps)
    if deps in path or not bundle.deps.is_dir():
        return False
    path.append(deps)
    return True


def missing_packages(names: tuple[str, ...], find: Callable[[str], Any] = importlib.util.find_spec) -> list[str]:
    """The top-level packages in ``names`` that nothing on ``sys.path`` provides."""
    return [name for name in names if find(name) is None]


def _torch_version() -> str:
    torch = sys.modules.get("torch")
    return str(getattr(torch, "__version__", "not imported"))


def load_lmcache(bundle: Bundle | None) -> None:
    """Import what the backend needs from lmcache, or raise ``BundleError`` saying what is missing."""
    where = f"the connector bundle at {bundle.root}" if bundle else "this environment"
    missing = missing_packages(LMCACHE_THIRD_PARTY)
    if missing:
        raise BundleError(
            f"kvoffload: lmcache needs {', '.join(missing)}, found neither in the TensorRT-LLM image nor in {where}"
        )
    try:
        importlib.import_module("lmcache")
    except ImportError as exc:
        raise BundleError(f"kvoffload: cannot import lmcache from {where}: {exc}") from exc
    for name in LMCACHE_COMPILED:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise BundleError(
                f"kvoffload: lmcache's compiled extension {name} from {where} does not load against this image's "
                f"torch {_torch_version()} (Python {sys.implementation.cache_tag}): {exc}; "
                "see docs/connector.md, 'Images', for the images it is known to load in"
            ) from exc
    try:
        seam = importlib.import_module(LMCACHE_SEAM)
    except ImportError as exc:
        raise BundleError(f"kvoffload: cannot import lmcache's client from {where}: {exc}") from exc
    try:
        seam.check_lmcache_version()
    except seam.LMCacheVersionError as exc:
        raise BundleError(f"{exc} (from {where})") from exc


def prepare(path: list[str] | None = None) -> Bundle | None:
    """Run before the backend imports lmcache: check the bundle, append its ``deps/``, load lmcache."""
    bundle = find_bundle()
    if bundle is not None:
        reason = python_mismatch(bundle, sys.implementation.cache_tag)
        if reason:
            raise BundleError(reason)
        if add_deps(bundle, sys.path if path is None else path):
            importlib.invalidate_caches()
        logger.info(
            "event=bundle root=%s python=%s lmcache=%s torch=%s",
            bundle.root,
            bundle.python_tag,
            bundle.lmcache_version,
            _torch_version(),
        )
    load_lmcache(bundle)
    return bundle
