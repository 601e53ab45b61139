"""A real Kubernetes control plane as local processes, without Docker.

etcd, kube-apiserver (RBAC, ServiceAccount token signing, PodSecurity
admission, TLS), kube-controller-manager, kube-scheduler and kwok (which marks
pods on fake GPU nodes Running). Used by the tests' session fixture and by the
demo. Binaries come from ``hack/setup.sh`` (``$KVOFFLOAD_CACHE/bin``).

    python -m hack.localcluster up [--dir DIR]   # start and wait; Ctrl-C stops
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hack.pki import kubeconfig_yaml, make_pki
from hack.ports import free_port

CACHE_DIR = Path(
    os.environ.get("KVOFFLOAD_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvoffload"
)
BIN_DIR = CACHE_DIR / "bin"
REQUIRED_BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "kubectl", "helm")
FAKE_NODE_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"


class ControlPlaneError(RuntimeError):
    """The control plane could not be started; the message says which part and why."""


def missing_binaries(bin_dir: Path = BIN_DIR) -> list[str]:
    """Names of required tools not present in ``bin_dir``."""
    return [b for b in REQUIRED_BINARIES if not os.access(bin_dir / b, os.X_OK)]


def fake_gpu_node(name: str, gpus: int = 8) -> dict[str, object]:
    """A Node that kwok manages, advertising ``gpus`` NVIDIA GPUs."""
    capacity = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti", GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {FAKE_NODE_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
            },
        },
        "status": {"capacity": capacity, "allocatable": capacity, "nodeInfo": {"kubeletVersion": "fake"}},
    }


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: None
    verbs: [get, list, watch]
  - level: None
    resources: [{group: coordination.k8s.io, resources: [leases]}]
    namespaces: [kube-system, kube-node-lease]
  - level: Metadata
"""
"""Every write, at Metadata level (who, what, which object, the answer); reads and the node and
control-plane heartbeats are left out."""


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path


@dataclass
class LocalCluster:
    """etcd + kube-apiserver + controller-manager + scheduler + kwok under ``workdir``."""

    workdir: Path
    bin_dir: Path = BIN_DIR
    gpu_nodes: int = 2
    verbose: bool = False
    procs: list[_Proc] = field(default_factory=list)
    api_port: int = 0
    started_in_s: float = 0.0

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    @property
    def audit_log(self) -> Path:
        """The apiserver's audit log: one JSON line per write request (create, update, patch,
        delete), with its user, verb, object and response code; tests count requests from it."""
        return self.workdir / "logs" / "audit.jsonl"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    def _log(self, msg: str) -> None:
        if self.verbose:
            print(f"[localcluster] {msg}", file=sys.stderr, flush=True)

    def _spawn(self, name: str, argv: Sequence[str]) -> _Proc:
        log = self.workdir / "logs" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(log, "wb")  # noqa: SIM115 - lives as long as the process
        popen = subprocess.Popen(list(argv), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        proc = _Proc(name, popen, log)
        self.procs.append(proc)
        self._log(f"started {name} (pid {popen.pid}), log {log}")
        return proc

    def _fail(self, proc: _Proc, why: str) -> ControlPlaneError:
        tail = proc.log.read_text(errors="replace")[-3000:] if proc.log.exists() else ""
        return ControlPlaneError(f"{proc.name}: {why}\n--- last lines of {proc.log} ---\n{tail}")

    def _wait(self, proc: _Proc, ready: callable, timeout: float, what: str) -> None:  # type: ignore[valid-type]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.popen.poll() is not None:
                raise self._fail(proc, f"exited with code {proc.popen.returncode} before {what}")
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.2)
        raise self._fail(proc, f"not {what} within {timeout:.0f} s")

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, kubeconfig: Path | None = None
                ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """Run the real kubectl against this cluster (admin unless ``kubeconfig`` is given)."""
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), "--kubeconfig", str(kubeconfig or self.admin_kubeconfig), *args],
            input=input, capture_output=True, text=True, check=check, timeout=120,
        )  # fmt: skip

    def start(self) -> LocalCluster:
        """Start every component and wait until the apiserver is ready and nodes are Ready."""
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise ControlPlaneError(f"missing binaries in {self.bin_dir}: {', '.join(missing)}; run hack/setup.sh")
        t0 = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        make_pki(self.pki)
        try:
            self._start_etcd()
            self._start_apiserver()
            self._start_controllers()
            self._create_fake_nodes()
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - t0
        self._log(f"control plane ready in {self.started_in_s:.1f} s at {self.server}")
        return self

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        proc = self._spawn("etcd", [
            str(self.bin_dir / "etcd"), "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}", "--initial-cluster", f"default=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--quota-backend-bytes", str(4 * 2**30), "--log-level", "warn",
        ])  # fmt: skip

        def healthy() -> bool:
            import urllib.request

            with urllib.request.urlopen(f"{self.etcd_url}/health", timeout=1) as r:
                return b'"true"' in r.read()

        self._wait(proc, healthy, 30, "healthy")

    def _start_apiserver(self) -> None:
        self.api_port = free_port()
        pki = self.pki
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY)
        proc = self._spawn("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={self.api_port}",
            f"--cert-dir={pki}", f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}", f"--client-ca-file={pki / 'ca.crt'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.0.0.0/24", "--endpoint-reconciler-type=none",
            "--authorization-mode=Node,RBAC", "--allow-privileged=true",
            "--enable-admission-plugins=NodeRestriction", "--profiling=false",
            "--storage-media-type=application/vnd.kubernetes.protobuf",
            f"--audit-policy-file={policy}", f"--audit-log-path={self.audit_log}", "--audit-log-format=json",
            "--audit-log-maxsize=0",
        ])  # fmt: skip
        self.admin_kubeconfig.write_text(
            kubeconfig_yaml(
                self.server,
                pki / "ca.crt",
                {"client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")},
            )
        )

        def ready() -> bool:
            return self.kubectl("get", "--raw", "/readyz", check=False).stdout.strip() == "ok"

        self._wait(proc, ready, 90, "ready")

    def _component_kubeconfig(self, name: str) -> Path:
        path = self.workdir / f"{name}.kubeconfig"
        path.write_text(
            kubeconfig_yaml(
                self.server,
                self.pki / "ca.crt",
                {"client-certificate": str(self.pki / f"{name}.crt"), "client-key": str(self.pki / f"{name}.key")},
            )
        )
        return path

    def _start_controllers(self) -> None:
        cm = self._component_kubeconfig("controller-manager")
        self._spawn("kube-controller-manager", [
            str(self.bin_dir / "kube-controller-manager"), f"--kubeconfig={cm}",
            f"--authentication-kubeconfig={cm}", f"--authorization-kubeconfig={cm}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}",
            "--leader-elect=false", "--use-service-account-credentials=true",
            f"--service-account-private-key-file={self.pki / 'sa.key'}",
            f"--root-ca-file={self.pki / 'ca.crt'}",
            "--controllers=*,-nodeipam,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller",
            "--concurrent-deployment-syncs=10", "--concurrent-replicaset-syncs=10",
            "--kube-api-qps=200", "--kube-api-burst=400",
        ])  # fmt: skip
        sched = self._component_kubeconfig("scheduler")
        self._spawn("kube-scheduler", [
            str(self.bin_dir / "kube-scheduler"), f"--kubeconfig={sched}",
            f"--authentication-kubeconfig={sched}", f"--authorization-kubeconfig={sched}",
            "--bind-address=127.0.0.1", f"--secure-port={free_port()}", "--leader-elect=false",
            "--kube-api-qps=200", "--kube-api-burst=400",
        ])  # fmt: skip
        self._spawn("kwok", [
            str(self.bin_dir / "kwok"), f"--kubeconfig={self.admin_kubeconfig}",
            f"--config={self.bin_dir / 'kwok-stages.yaml'}",
            "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={FAKE_NODE_ANNOTATION}=fake",
            "--manage-nodes-with-label-selector=", "--manage-single-node=",
            "--cidr=10.0.0.0/24", "--node-ip=10.0.0.1", "--node-lease-duration-seconds=40",
            f"--server-address=127.0.0.1:{free_port()}",
        ])  # fmt: skip

    def _create_fake_nodes(self) -> None:
        for i in range(self.gpu_nodes):
            self.kubectl("apply", "-f", "-", input=json.dumps(fake_gpu_node(f"gpu-node-{i}")))
        kwok = next(p for p in self.procs if p.name == "kwok")

        def nodes_ready() -> bool:
            out = self.kubectl("get", "nodes", "-o", "json").stdout
            nodes = json.loads(out)["items"]
            ready = [
                n for n in nodes
                if any(c["type"] == "Ready" and c["status"] == "True" for c in n.get("status", {}).get("conditions", []))
            ]  # fmt: skip
            return len(ready) >= self.gpu_nodes

        self._wait(kwok, nodes_ready, 60, "reporting the fake GPU nodes Ready")
        # Other components must still be alive after start-up.
        for proc in self.procs:
            if proc.popen.poll() is not None:
                raise self._fail(proc, f"exited with code {proc.popen.returncode}")

    def service_account_kubeconfig(self, namespace: str, name: str, path: Path, duration: str = "24h") -> Path:
        """A kubeconfig that authenticates as ServiceAccount ``namespace/name`` with a bound token."""
        token = self.kubectl("create", "token", name, "-n", namespace, f"--duration={duration}").stdout.strip()
        path.write_text(kubeconfig_yaml(self.server, self.pki / "ca.crt", {"token": token}, name=f"{namespace}-{name}"))
        return path

    @contextlib.contextmanager
    def paused(self, component: str) -> Iterator[None]:
        """``component`` (``kube-controller-manager``, ``kube-scheduler``, ``kwok``) frozen (SIGSTOP)
        for the block, as a control plane too busy to keep up; it goes on where it was (SIGCONT)."""
        (proc,) = [p for p in self.procs if p.name == component and p.popen.poll() is None]
        proc.popen.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            proc.popen.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop every component, newest first."""
        for proc in reversed(self.procs):
            if proc.popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in reversed(self.procs):
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait(timeout=5)
        self.procs.clear()

    def restart(self, component: str, grace_s: float = 30.0) -> None:
        """Restart one component with the same arguments (for fault tests).

        SIGTERM first; a component still running after ``grace_s`` (kube-apiserver drains open
        watches for a long time) is SIGKILLed, as kubelet would after the grace period.
        """
        proc = next(p for p in self.procs if p.name == component)
        argv = list(proc.popen.args)  # type: ignore[arg-type]
        os.killpg(proc.popen.pid, signal.SIGTERM)
        try:
            proc.popen.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(timeout=30)
        self.procs.remove(proc)
        self._spawn(component, argv)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running_cluster(workdir: Path | None = None, **kwargs: object) -> Iterator[LocalCluster]:
    """Start a cluster in ``workdir`` (a temp dir by default) and stop it afterwards."""
    tmp = None
    if workdir is None:
        tmp = tempfile.mkdtemp(prefix="kvoffload-cluster-")
        workdir = Path(tmp)
    cluster = LocalCluster(workdir=workdir, **kwargs)  # type: ignore[arg-type]
    try:
        yield cluster.start()
    finally:
        cluster.stop()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up"])
    parser.add_argument("--dir", type=Path, default=Path(".cache/cluster"))
    parser.add_argument("--gpu-nodes", type=int, default=2)
    args = parser.parse_args(argv)
    shutil.rmtree(args.dir, ignore_errors=True)
    cluster = LocalCluster(workdir=args.dir.resolve(), gpu_nodes=args.gpu_nodes, verbose=True)
    cluster.start()
    print(f"export KUBECONFIG={cluster.admin_kubeconfig}", flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
