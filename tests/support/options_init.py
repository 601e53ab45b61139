"""Run an injected pod's options init container (``c.OPTIONS_INIT_CONTAINER``) as a local process,
as the kubelet would run it: each of its mounts is a folder (or, with ``subPath``, a file) under a
local root, the user's ConfigMap files are written where the pod would mount them, and its command
runs with this checkout's Python (or one given). The file the engine would read comes back."""

from __future__ import annotations

import os
import posixpath
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload import contract as c

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
OPTIONS_PATH = posixpath.join(c.TRTLLM_OPTIONS_MOUNT_PATH, c.TRTLLM_OPTIONS_FILE)


@dataclass(frozen=True)
class InitRun:
    returncode: int
    stderr: str
    options: str | None
    """The engine's options file as the init container left it (None: not written)."""


def options_init_container(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The pod's options init container (an AssertionError where there is none)."""
    found = [
        x for x in (pod.get("spec") or {}).get("initContainers") or [] if x.get("name") == c.OPTIONS_INIT_CONTAINER
    ]
    assert len(found) == 1, f"the pod has {len(found)} {c.OPTIONS_INIT_CONTAINER} init containers"
    return dict(found[0])


def run_options_init(pod: Mapping[str, Any], user_files: Mapping[str, str], root: Path,
                     python: str = sys.executable, pythonpath: str | None = None) -> InitRun:  # fmt: skip
    """Run ``pod``'s options init container with ``user_files`` (path in the engine -> text; only
    those under one of the container's mounts are visible to it) under ``root``."""
    container = options_init_container(pod)
    mounts = [str(m["mountPath"]).rstrip("/") for m in container.get("volumeMounts") or []]
    for path, text in user_files.items():
        if any(path == m or path.startswith(m + "/") for m in mounts):
            file = root / path.lstrip("/")
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(text)
    for mount in container.get("volumeMounts") or []:
        if not mount.get("subPath"):
            (root / str(mount["mountPath"]).lstrip("/")).mkdir(parents=True, exist_ok=True)

    def local(arg: str) -> str:
        return str(root / arg.lstrip("/")) if any(arg == m or arg.startswith(m + "/") for m in mounts) else arg

    command = [str(x) for x in container["command"]]
    assert command[0] == "python3", command
    argv = [python, *command[1:], *(local(str(a)) for a in container.get("args") or [])]
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": pythonpath or str(REPO_ROOT / "common" / "src")}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    out = root / OPTIONS_PATH.lstrip("/")
    return InitRun(done.returncode, done.stderr, out.read_text() if out.exists() else None)
