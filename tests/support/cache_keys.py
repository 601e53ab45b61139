"""A policy's node-cache keys as the kubelet would mount them: the operator's own Secret, each pod
kind's files written into a directory of its own."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvoffload.operator.node.cache_objects import render_cache_keys_secret
from kvoffload.operator.node.caches import new_cache_keys
from kvoffload.operator.plan.containers import CACHE_POD_KEY_FILES, ENGINE_KEY_FILES


def _mount(data: dict[str, str], files: Sequence[str], directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name in files:
        (directory / name).write_text(data[name])
    return directory


def policy_keys(root: Path, policy: str, namespace: str = "team-a") -> tuple[Path, Path]:
    """(the cache pod's key directory, the engines' key directory) for a fresh policy's Secret."""
    meta = {"name": policy, "namespace": namespace, "uid": f"uid-{policy}"}
    secret = render_cache_keys_secret({"metadata": meta}, new_cache_keys())
    data = secret["stringData"]
    return (
        _mount(data, CACHE_POD_KEY_FILES, root / f"{namespace}-{policy}-cache-pod"),
        _mount(data, ENGINE_KEY_FILES, root / f"{namespace}-{policy}-engine"),
    )


def self_made_client(root: Path, server_public_of: Path) -> Path:
    """A client that made its own keypair and knows the server's public key (it is no secret)."""
    keys = new_cache_keys()
    return _mount(
        {**keys, "server.public": (server_public_of / "server.public").read_text()},
        ENGINE_KEY_FILES,
        root / "self-made",
    )
