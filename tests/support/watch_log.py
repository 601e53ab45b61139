"""``kubectl get --watch`` kept running in the background: every version of a namespace's objects
of one resource, in the order the apiserver sent them (to read a history, not only the end)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from hack.localcluster import LocalCluster


class WatchLog:
    """Every watch event of ``resource`` in ``namespace`` from ``start`` on, written to ``path``."""

    def __init__(self, cluster: LocalCluster, resource: str, namespace: str, path: Path) -> None:
        self.path = path
        argv = [str(cluster.bin_dir / "kubectl"), "--kubeconfig", str(cluster.admin_kubeconfig), "get", resource,
                "-n", namespace, "--watch", "--output-watch-events", "-o", "json"]  # fmt: skip
        self._out = open(path, "wb")  # noqa: SIM115 - closed in stop()
        self._popen = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self._popen.terminate()
        self._popen.wait(timeout=10)
        self._out.close()

    def events(self) -> list[dict[str, Any]]:
        """The events written so far (``{"type": ..., "object": ...}``), oldest first."""
        text, decoder, at = self.path.read_text(), json.JSONDecoder(), 0
        found: list[dict[str, Any]] = []
        while True:
            while at < len(text) and text[at].isspace():
                at += 1
            if at >= len(text):
                return found
            try:
                event, at = decoder.raw_decode(text, at)
            except ValueError:
                return found  # an event still being written
            found.append(event)
