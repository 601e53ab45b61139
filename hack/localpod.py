"""A pod as the apiserver stores it, run as local processes: containers' commands with their env,
volumes as local folders. No Docker: the demo and the e2e test start what the pod spec says."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hack.localcluster import LocalCluster
from kvoffload import contract


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    """Status and body of a GET; (0, error) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except OSError as err:
        return 0, str(err)


def downward_api_value(pod: dict[str, Any], field_path: str) -> str:
    """What the kubelet writes for a downward API ``fieldPath`` (the parts our pods use)."""
    meta = pod["metadata"]
    for part in ("annotations", "labels"):
        prefix = f"metadata.{part}['"
        if field_path.startswith(prefix) and field_path.endswith("']"):
            return str((meta.get(part) or {})[field_path[len(prefix) : -2]])
    if field_path in ("metadata.name", "metadata.namespace", "metadata.uid"):
        return str(meta[field_path.split(".")[1]])
    raise LookupError(f"downward API field {field_path!r} is not supported by the local pod runner")


@dataclass
class LocalPod:
    """A pod's containers run as local processes, with volumes as local folders."""

    pod: dict[str, Any]
    workdir: Path
    cluster: LocalCluster
    volume_dirs: dict[str, Path] = field(default_factory=dict)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def container(self, name: str) -> dict[str, Any]:
        spec = self.pod["spec"]
        for c in spec.get("initContainers", []) + spec.get("containers", []):
            if c["name"] == name:
                return c  # type: ignore[no-any-return]
        raise LookupError(f"pod {self.pod['metadata']['name']} has no container {name!r}")

    def materialize_volumes(self, bundle_source: Path) -> None:
        """emptyDirs become folders; ConfigMap volumes get their keys as files, downward API volumes the
        pod's fields; the bundle is 'copied' in."""
        ns = self.pod["metadata"]["namespace"]
        for volume in self.pod["spec"].get("volumes", []):
            path = self.workdir / "volumes" / volume["name"]
            path.mkdir(parents=True, exist_ok=True)
            self.volume_dirs[volume["name"]] = path
            if "configMap" in volume:
                cm = json.loads(
                    self.cluster.kubectl("get", "configmap", volume["configMap"]["name"], "-n", ns, "-o", "json").stdout
                )
                items = volume["configMap"].get("items") or [{"key": k, "path": k} for k in cm.get("data", {})]
                for item in items:
                    (path / item["path"]).write_text(cm["data"][item["key"]])
            elif "downwardAPI" in volume:
                for item in volume["downwardAPI"]["items"]:
                    (path / item["path"]).write_text(downward_api_value(self.pod, item["fieldRef"]["fieldPath"]))
        # The connector-bundle init container copies /kvoffload-bundle/. into its volume;
        # locally the same files come from a --target install of this checkout.
        if contract.VOLUME_BUNDLE in self.volume_dirs:
            init = self.container(contract.BUNDLE_INIT_CONTAINER)
            assert any(m["name"] == contract.VOLUME_BUNDLE for m in init["volumeMounts"])
            dest = self.volume_dirs[contract.VOLUME_BUNDLE]
            shutil.copytree(bundle_source, dest, dirs_exist_ok=True)

    def _mounts(self, container: dict[str, Any]) -> list[tuple[str, Path]]:
        mounts = []
        for m in container.get("volumeMounts", []):
            local = self.volume_dirs[m["name"]]
            if m.get("subPath"):
                local = local / m["subPath"]
            mounts.append((m["mountPath"].rstrip("/"), local))
        return sorted(mounts, key=lambda m: -len(m[0]))

    def local_path(self, container: dict[str, Any], value: str) -> str:
        """Rewrite container paths inside ``value`` (also ':'-separated lists) to local folders."""
        parts = []
        for part in value.split(":"):
            for mount_path, local in self._mounts(container):
                if part == mount_path or part.startswith(mount_path + "/"):
                    part = str(local) + part[len(mount_path) :]
                    break
            parts.append(part)
        return ":".join(parts)

    def env(self, container: dict[str, Any]) -> dict[str, str]:
        """The container's env exactly as injected, with valueFrom resolved the way kubelet would."""
        ns = self.pod["metadata"]["namespace"]
        env: dict[str, str] = {}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = self.local_path(container, var["value"])
                continue
            source = var.get("valueFrom", {})
            if "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                env[var["name"]] = {
                    "metadata.name": self.pod["metadata"]["name"],
                    "metadata.namespace": ns,
                    "status.podIP": "127.0.0.1",
                    "spec.nodeName": self.pod["spec"].get("nodeName", ""),
                }.get(path, "")
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                out = self.cluster.kubectl(
                    "get", "secret", ref["name"], "-n", ns, "-o", f"jsonpath={{.data.{ref['key']}}}"
                ).stdout
                import base64

                env[var["name"]] = base64.b64decode(out).decode()
            elif "resourceFieldRef" in source:
                env[var["name"]] = "0"
        return env

    def run_python_init(self, name: str, python: Path) -> None:
        """Run init container ``name``, a ``python3 -m ...`` command, to completion with ``python``
        (the image's interpreter), its env and its paths mapped to the local volumes, as the kubelet
        runs it before the pod's containers; raise with its log when it fails."""
        container = self.container(name)
        command = [str(x) for x in container["command"]]
        if command[0] != "python3":
            raise LookupError(f"init container {name} runs {command[0]}, not python3")
        args = [self.local_path(container, str(a)) for a in container.get("args", [])]
        code = self.start([str(python), *command[1:], *args], self.env(container), name).wait(timeout=120)
        if code != 0:
            log = (self.workdir / f"{name}.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"init container {name} exited with {code}: {log}")

    def start(self, argv: list[str], env: dict[str, str], name: str) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - lives as long as the process
        base = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR", "KVOFFLOAD_CACHE")}
        proc = subprocess.Popen(
            argv, env={**base, **env}, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.processes.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.processes):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        for proc in reversed(self.processes):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
