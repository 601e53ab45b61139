"""Support for the operator's integration tests: the operator process and shared steps.

The operator runs as a real process against the real control plane, as its own ServiceAccount.

The ServiceAccount is bound to a ClusterRole built from the chart's
``files/operator-clusterrole-rules.yaml``, the same file the Helm chart renders, so these tests
prove that exactly those rules suffice.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from hack.localcluster import LocalCluster
from hack.ports import free_port
from hack.workloads import get, list_objects, trtllm_deployment, wait_for
from kvoffload import contract as c
from kvoffload.operator.intent.settings import OperatorDefaults
from tests.conftest import REPO_ROOT


def gitops_manifest(name: str, namespace: str, image: str, opted_in: bool) -> dict[str, Any]:
    """A user's TensorRT-LLM Deployment as it sits in git (no status, no server fields): two replicas,
    surge one, ``opted_in`` by the kvoffload annotation."""
    body = trtllm_deployment(name, namespace, replicas=2, annotations={c.ANN_ENABLED: "true"} if opted_in else {})
    body["spec"]["template"]["spec"]["containers"][0]["image"] = image
    body["spec"]["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    return body


CHART = REPO_ROOT / "charts" / "kvoffload"
RULES_FILE = CHART / "files" / "operator-clusterrole-rules.yaml"
NODE_MODE_RULES_FILE = CHART / "files" / "operator-node-mode-rules.yaml"
NODES_RULES_FILE = CHART / "files" / "operator-nodes-rules.yaml"
TEMPLATE_RULES_FILE = CHART / "files" / "operator-template-rules.yaml"
LEADER_ELECTION_RULES_FILE = CHART / "files" / "operator-leader-election-rules.yaml"
ADMISSION_RULES_FILE = CHART / "files" / "operator-admission-rules.yaml"
ADMISSION_WEBHOOK_RULES_FILE = CHART / "files" / "operator-admission-webhook-rules.yaml"
ADMISSION_NAMESPACE_RULES_FILE = CHART / "files" / "operator-admission-namespace-rules.yaml"
CRD_FILE = CHART / "crds" / "kvcachepolicies.yaml"
OPERATOR_NAMESPACE = "kvoffload-system"
OPERATOR_SA = "kvoffload-operator"
SIDECAR_IMAGE = "registry.example/kvoffload/sidecar:test"
BUNDLE_IMAGE = "registry.example/kvoffload/connector-bundle:test"


DEFAULTS_FLAGS = (
    "--sidecar-image", SIDECAR_IMAGE, "--bundle-image", BUNDLE_IMAGE,
    "--default-l1-size", "4Gi", "--default-shm-size", "1Gi",
)  # fmt: skip
"""The defaults every test operator runs with (``operator_defaults`` gives the same in-process)."""


def operator_defaults() -> OperatorDefaults:
    """The ``OperatorDefaults`` a test operator process computes from ``DEFAULTS_FLAGS``."""
    from kvoffload.operator.cli import build_parser, defaults_from

    return defaults_from(build_parser().parse_args(list(DEFAULTS_FLAGS)))


def admission_args(port: int) -> list[str]:
    """The operator's flags for injection at admission, its webhook on 127.0.0.1:``port``."""
    return ["--injection", "admission", "--webhook-port", str(port),
            "--webhook-url", f"https://127.0.0.1:{port}{c.WEBHOOK_PATH}"]  # fmt: skip


def register_webhook_as_the_chart_does(
    cluster: LocalCluster, port: int, release_namespace: str = OPERATOR_NAMESPACE
) -> None:
    """What Helm installs with injection.mode=admission (``webhook_configuration`` without a caBundle),
    pointed at a test operator's webhook on 127.0.0.1:``port``; the operator then patches the caBundle
    in. Applied again for another port, it is a Service whose endpoints moved to another pod."""
    from kvoffload.operator.admission.webhook_tls import webhook_configuration

    client = {"url": f"https://127.0.0.1:{port}{c.WEBHOOK_PATH}"}
    body = webhook_configuration(c.WEBHOOK_CONFIGURATION_NAME, b"", client, (), release_namespace)
    for hook in body["webhooks"]:
        del hook["clientConfig"]["caBundle"]
    cluster.kubectl("apply", "-f", "-", input=json.dumps(body))


def webhook_port(proc: OperatorProcess) -> int:
    """The ``--webhook-port`` an admission-mode test operator was started with."""
    args = proc.extra_args
    return int(args[args.index("--webhook-port") + 1])


def admission_rules(prefix: str) -> dict[str, Path]:
    """The rules files the chart adds with injection.mode admission, under ClusterRole names from ``prefix``."""
    return {f"{prefix}-admission": ADMISSION_RULES_FILE, f"{prefix}-admission-ns": ADMISSION_NAMESPACE_RULES_FILE,
            f"{prefix}-admission-webhook": ADMISSION_WEBHOOK_RULES_FILE}  # fmt: skip


def child_pythonpath() -> str:
    """PYTHONPATH for an operator process the tests start: the repository, then the caller's own (a
    second worktree's sources ahead of the editable install's)."""
    return os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)


_STARTED: list[OperatorProcess] = []
"""Every operator process the session started: at most one may run at a time."""


@dataclass
class OperatorProcess:
    """``python -m kvoffload.operator`` with the ServiceAccount kubeconfig; restartable."""

    kubeconfig: Path
    workdir: Path
    extra_args: list[str] = field(default_factory=list)
    metrics_port: int = 0
    health_port: int = 0
    popen: subprocess.Popen[bytes] | None = None
    starts: int = 0
    lease_namespace: str = OPERATOR_NAMESPACE
    """Where its leader-election Lease lives; the identity is this object's workdir (a pod's name)."""
    overlap_allowed: bool = False
    """Start even while another operator runs (as a RollingUpdate does); leader election keeps one acting."""
    version: str | None = None
    """Run as this operator version (another image of an upgrade), not the checkout's."""

    @property
    def log_path(self) -> Path:
        return self.workdir / f"operator-{self.starts}.log"

    def start(self) -> None:
        others = [p for p in _STARTED if p is not self and p.popen is not None and p.popen.poll() is None]
        assert self.overlap_allowed or not others, (
            f"another operator is still running ({others[0].workdir}): two would race each other"
        )
        if self not in _STARTED:
            _STARTED.append(self)
        self.starts += 1
        self.metrics_port, self.health_port = free_port(), free_port()
        launch = ["-m", "kvoffload.operator"]
        if self.version is not None:  # the package's version set before any module reads it
            launch = ["-c", f"import runpy, kvoffload.operator as o; o.__version__ = {self.version!r}; "
                            "runpy.run_module('kvoffload.operator', run_name='__main__', alter_sys=True)"]  # fmt: skip
        argv = [
            sys.executable, *launch,
            "--kubeconfig", str(self.kubeconfig),
            "--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port),
            *DEFAULTS_FLAGS, "--resync-seconds", "0", "--log-level", "info",
            "--leader-election-namespace", self.lease_namespace, *self.extra_args,
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": child_pythonpath(), "POD_NAME": f"operator-{self.workdir.name}",
               "POD_IP": "127.0.0.1"}  # fmt: skip
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
        self.popen = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir, env=env)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise AssertionError(f"operator exited with {self.popen.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"operator not healthy within 90 s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies."""
        if self.popen and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(timeout=30)

    def stop(self) -> None:
        if self.popen and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Current samples: {(name, sorted labels): value}."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return samples

    def metric_sum(self, name: str, **labels: str) -> float:
        return sum(
            v for (n, lbls), v in self.metrics().items()
            if n == name and all(dict(lbls).get(k) == val for k, val in labels.items())
        )  # fmt: skip


APISERVER_TEMPLATE_KEYS = ("creationTimestamp",)


def kind_of(resource: str) -> str:
    return {"deployment": "Deployment", "statefulset": "StatefulSet"}[resource]


def annotate(cluster: LocalCluster, resource: str, name: str, namespace: str, *pairs: str) -> dict[str, Any]:
    """``kubectl annotate``; returns the object right after (a Deployment's generation counts
    annotation changes too, so tests measure the operator's own changes from here)."""
    out = cluster.kubectl("annotate", "--overwrite", resource, name, "-n", namespace, *pairs, "-o", "json")
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def template(obj: dict[str, Any]) -> dict[str, Any]:
    """The pod template, minus what only the apiserver writes."""
    tpl = copy.deepcopy(obj["spec"]["template"])
    for key in APISERVER_TEMPLATE_KEYS:
        tpl.get("metadata", {}).pop(key, None)
    return tpl  # type: ignore[no-any-return]


def all_containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def is_injected(obj: dict[str, Any]) -> bool:
    annotations = obj["spec"]["template"].get("metadata", {}).get("annotations", {})
    return c.ANN_CONFIG_HASH in annotations and any(x["name"] == c.SIDECAR_CONTAINER for x in all_containers(obj))


def is_clean(obj: dict[str, Any]) -> bool:
    spec = obj["spec"]["template"]["spec"]
    names = {x["name"] for x in all_containers(obj)} | {v["name"] for v in spec.get("volumes", [])}
    return not any(n.startswith("kvoffload-") for n in names) and not any(
        m.get("manager") == c.FIELD_MANAGER for m in obj["metadata"].get("managedFields", [])
    )


def wait_injected(cluster: LocalCluster, resource: str, name: str, namespace: str, timeout: float = 90
                  ) -> dict[str, Any]:  # fmt: skip
    return wait_for(  # type: ignore[no-any-return]
        lambda: (o := get(cluster, resource, name, namespace)) and is_injected(o) and o,
        timeout=timeout, what=f"{resource}/{name} injected",
    )  # fmt: skip


def wait_clean(cluster: LocalCluster, resource: str, name: str, namespace: str, timeout: float = 90
               ) -> dict[str, Any]:  # fmt: skip
    return wait_for(  # type: ignore[no-any-return]
        lambda: (o := get(cluster, resource, name, namespace)) and is_clean(o) and o,
        timeout=timeout, what=f"{resource}/{name} back to its original template",
    )  # fmt: skip


def events_for(cluster: LocalCluster, namespace: str, name: str, reason: str | None = None) -> list[dict[str, Any]]:
    items = list_objects(cluster, "events", namespace)
    return [
        e for e in items
        if e["involvedObject"].get("name") == name and (reason is None or e.get("reason") == reason)
    ]  # fmt: skip


def running_pods(cluster: LocalCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    return [
        p for p in list_objects(cluster, "pods", namespace, selector) if p.get("status", {}).get("phase") == "Running"
    ]


def server_side_apply(cluster: LocalCluster, manager: str, obj: dict[str, Any], force: bool = False) -> None:
    args = ["apply", "--server-side", f"--field-manager={manager}", "-f", "-"]
    if force:
        args.append("--force-conflicts")
    cluster.kubectl(*args, input=json.dumps(obj))


def assert_no_duplicates(dep: dict[str, Any]) -> None:
    """Each injected container, volume, env var and the options flag appear exactly once."""
    spec = dep["spec"]["template"]["spec"]
    names = Counter(x["name"] for x in all_containers(dep))
    assert names[c.SIDECAR_CONTAINER] == 1 and names[c.BUNDLE_INIT_CONTAINER] == 1, names
    assert all(n == 1 for n in names.values()), names
    volumes = Counter(v["name"] for v in spec["volumes"])
    assert all(n == 1 for n in volumes.values()), volumes
    engine = next(x for x in spec["containers"] if x["name"] == "trtllm")
    env = Counter(e["name"] for e in engine["env"])
    assert all(n == 1 for n in env.values()), env
    assert engine["args"].count("--extra_llm_api_options") == 1
