"""The user's journey on the local control plane, step by step.

Shared by the demo (``python -m hack.demo``, which narrates it) and the
end-to-end test (``tests/e2e``, which asserts on it). Everything is real:
helm, kubectl, kube-apiserver and controllers, the operator running with the
chart's ServiceAccount, LMCache's server started from the sidecar command the
apiserver stores, the connector loaded by the names in the generated options
file, and a Prometheus server scraping the pod's one /metrics endpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hack import trtllm_image
from hack.localcluster import LocalCluster
from hack.localpod import LocalPod, http_get
from hack.polling import wait_until
from hack.ports import free_port
from hack.workloads import trtllm_container, trtllm_deployment
from kvoffload import contract

REPO_ROOT = Path(__file__).resolve().parent.parent
CHART = REPO_ROOT / "charts" / "kvoffload"
RELEASE = "kvoffload"
RELEASE_NAMESPACE = "kvoffload-system"
OPERATOR_SERVICE_ACCOUNT = "kvoffload"  # the chart's fullname for release "kvoffload"
APISERVER_MANAGED = ("creationTimestamp", "generation", "resourceVersion", "uid", "managedFields")


class JourneyError(RuntimeError):
    """A step of the journey did not do what a user would expect; the message says which."""


def shared_prefix_prompts(num_requests: int = 6, prefix_tokens: int = 1024, suffix_tokens: int = 96) -> list[Any]:
    """Phases for the stand-in engine: a first request, device eviction, then requests sharing its prefix."""
    prefix = [(i * 7919) % 32000 + 1 for i in range(prefix_tokens)]

    def request(i: int) -> dict[str, Any]:
        suffix = [(i * 104729 + j * 31) % 32000 + 1 for j in range(suffix_tokens)]
        return {"request_id": i, "prompt": prefix + suffix, "max_new_tokens": 4}

    return [[request(0)], "evict", [request(i) for i in range(1, num_requests)]]


@dataclass
class Journey:
    """The steps a platform engineer takes, against a running ``LocalCluster``."""

    cluster: LocalCluster
    workdir: Path
    say: Callable[[str], None] = lambda _msg: None
    namespace: str = "llm"
    workload: str = "llama"
    operator: subprocess.Popen[bytes] | None = None
    operator_metrics_port: int = 0
    prometheus: subprocess.Popen[bytes] | None = None
    prometheus_port: int = 0
    sidecar_port: int = 0
    bundle: Path | None = None
    """The connector bundle (hack/build_bundle.py); built on first use unless given."""
    local_pod: LocalPod | None = None
    original_template: dict[str, Any] = field(default_factory=dict)
    installed: bool = False
    l1_size: str = "1Gi"
    engine_blocks: int = 512

    # --- helpers -------------------------------------------------------------
    def kubectl(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return self.cluster.kubectl(*args, **kw)

    def helm(self, *args: str) -> str:
        result = subprocess.run(
            [str(self.cluster.bin_dir / "helm"), "--kubeconfig", str(self.cluster.admin_kubeconfig), *args],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        if result.returncode != 0:
            raise JourneyError(f"helm {' '.join(args)} failed: {result.stderr.strip()}")
        return result.stdout

    def get_json(self, *args: str) -> dict[str, Any]:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)  # type: ignore[no-any-return]

    def deployment(self) -> dict[str, Any]:
        return self.get_json("deployment", self.workload, "-n", self.namespace)

    # --- 1. helm install --------------------------------------------------------
    def install_chart(self) -> str:
        """``helm install`` into a namespace that enforces PodSecurity restricted; returns NOTES."""
        self.kubectl("create", "namespace", RELEASE_NAMESPACE, check=False)
        self.kubectl("label", "namespace", RELEASE_NAMESPACE, "pod-security.kubernetes.io/enforce=restricted",
                     "--overwrite")  # fmt: skip
        # A small L1 for a laptop-sized demo: LMCache allocates all of it up front in /dev/shm. The
        # engine, the cache server and the control plane share a few cores here, so a lookup gets 1 s
        # (the chart's 100 ms is for an engine on a host of its own; a lookup past it is a miss). The
        # operator runs here, outside the cluster: the apiserver calls its webhook on 127.0.0.1.
        port = free_port()
        notes = self.helm(
            "install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE,
            "--set", f"defaults.cache.l1Size={self.l1_size}", "--set", "defaults.shmSize=256Mi",
            "--set", "defaults.connector.lookupTimeoutMs=1000",
            "--set", f"injection.webhookPort={port}",
            "--set", f"injection.webhookUrl=https://127.0.0.1:{port}{contract.WEBHOOK_PATH}",
        )  # fmt: skip
        self.installed = True
        self.say(f"helm install {RELEASE} charts/kvoffload -n {RELEASE_NAMESPACE}: CRD, RBAC, operator Deployment")
        return notes

    def start_operator(self) -> None:
        """Run the operator as a local process with the chart's ServiceAccount credentials."""
        kubeconfig = self.cluster.service_account_kubeconfig(
            RELEASE_NAMESPACE, OPERATOR_SERVICE_ACCOUNT, self.workdir / "operator.kubeconfig"
        )
        defaults = self.get_json("configmap", f"{RELEASE}-defaults", "-n", RELEASE_NAMESPACE)["data"]["defaults.json"]
        defaults_file = self.workdir / "defaults.json"
        defaults_file.write_text(defaults)
        deployment = self.get_json("deployment", f"{RELEASE}-operator", "-n", RELEASE_NAMESPACE)
        chart_args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        self.operator_metrics_port = free_port()
        args = [a for a in chart_args if not a.startswith(("--defaults-file", "--metrics-port", "--health-port"))]
        args += [f"--defaults-file={defaults_file}", f"--metrics-port={self.operator_metrics_port}",
                 f"--health-port={free_port()}", f"--kubeconfig={kubeconfig}"]  # fmt: skip
        log = open(self.workdir / "operator.log", "wb")  # noqa: SIM115
        self.operator = subprocess.Popen(
            ["kvoffload-operator", *args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        wait_until(
            lambda: http_get(f"http://127.0.0.1:{self.operator_metrics_port}/metrics")[0] == 200,
            60,
            "the operator's /metrics endpoint",
        )
        self.say(f"operator running as system:serviceaccount:{RELEASE_NAMESPACE}:{OPERATOR_SERVICE_ACCOUNT}")

    # --- 2. a TensorRT-LLM Deployment -------------------------------------------
    def create_workload(self, options_from_configmap: bool) -> None:
        self.kubectl("create", "namespace", self.namespace, check=False)
        self.kubectl("label", "namespace", self.namespace, "pod-security.kubernetes.io/enforce=baseline", "--overwrite")
        volumes: list[dict[str, Any]] = []
        container = trtllm_container()
        if options_from_configmap:
            options = {"kv_cache_config": {"free_gpu_memory_fraction": 0.85}, "max_batch_size": 64}
            cm = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": {"name": f"{self.workload}-options", "namespace": self.namespace},
                  "data": {"options.yaml": yaml.safe_dump(options)}}  # fmt: skip
            self.kubectl("apply", "-f", "-", input=json.dumps(cm))
            volumes = [{"name": "options", "configMap": {"name": f"{self.workload}-options"}}]
            container = trtllm_container(options_file="/config/options.yaml")
            container["volumeMounts"] = [{"name": "options", "mountPath": "/config"}]
        manifest = trtllm_deployment(self.workload, self.namespace, containers=[container], volumes=volumes)
        self.kubectl("apply", "-f", "-", input=json.dumps(manifest))
        wait_until(lambda: self.running_pods(injected=False), 90, "the TensorRT-LLM pod Running")
        self.original_template = self.deployment()["spec"]["template"]
        variant = "options file from a ConfigMap" if options_from_configmap else "no options file"
        self.say(f"created Deployment {self.namespace}/{self.workload} (trtllm-serve, 1 GPU, {variant}): pod Running")

    def running_pods(self, injected: bool) -> list[dict[str, Any]]:
        pods = self.get_json("pods", "-n", self.namespace, "-l", f"app={self.workload}")["items"]
        out = []
        for pod in pods:
            spec = pod["spec"]
            names = {c["name"] for c in spec.get("initContainers", []) + spec["containers"]}
            if (contract.SIDECAR_CONTAINER in names) != injected or pod["metadata"].get("deletionTimestamp"):
                continue
            if pod.get("status", {}).get("phase") == "Running":
                out.append(pod)
        return out

    # --- 3. annotate -------------------------------------------------------------
    def annotate(self) -> dict[str, Any]:
        self.kubectl("annotate", "deployment", self.workload, "-n", self.namespace, f"{contract.ANN_ENABLED}=true")
        self.say(f"kubectl annotate deployment {self.workload} {contract.ANN_ENABLED}=true")
        pod = wait_until(lambda: self.running_pods(injected=True), 120, "an injected pod Running")[0]
        injected = sorted(
            c["name"]
            for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]
            if c["name"].startswith("kvoffload")
        )
        label = self.deployment()["spec"]["template"]["metadata"]["labels"].get(contract.LABEL_INJECT)
        self.say(f"the template got one label ({contract.LABEL_INJECT}={label}); new ReplicaSet rolled out; "
                 f"pod {pod['metadata']['name']} Running with {', '.join(injected)} (added by the webhook)")  # fmt: skip
        return pod  # type: ignore[no-any-return]

    # --- 4. run the pod for real -----------------------------------------------
    def run_pod_locally(self, pod: dict[str, Any], prompts: list[Any]) -> dict[str, Any]:
        """Start the sidecar's command and a TensorRT-LLM stand-in with the injected wiring."""
        local = LocalPod(pod=pod, workdir=self.workdir / "pod", cluster=self.cluster)
        self.local_pod = local
        local.workdir.mkdir(parents=True, exist_ok=True)
        local.materialize_volumes(self.build_bundle())
        if any(c["name"] == contract.OPTIONS_INIT_CONTAINER for c in pod["spec"].get("initContainers", [])):
            # the engine's options file is written in the pod, from the bundle, by the image's Python
            local.run_python_init(contract.OPTIONS_INIT_CONTAINER, trtllm_image.image_python())

        sidecar = local.container(contract.SIDECAR_CONTAINER)
        sidecar_env = local.env(sidecar)
        argv = [*sidecar["command"], *sidecar.get("args", [])]
        local.start(argv, sidecar_env, "sidecar")
        port = next(p["containerPort"] for p in sidecar["ports"] if p["name"] == contract.SIDECAR_PORT_NAME)
        probe = sidecar["startupProbe"]["httpGet"]["path"]
        wait_until(lambda: http_get(f"http://127.0.0.1:{port}{probe}")[0] == 200, 120, "the sidecar's startupProbe")
        self.sidecar_port = port
        self.say(f"sidecar started from the stored pod spec: {' '.join(argv)}; {probe} answers 200")

        engine = next(c for c in pod["spec"]["containers"] if c["name"] != contract.SIDECAR_CONTAINER)
        engine_env = local.env(engine)
        options = self.options_path(engine)
        prompts_file = local.workdir / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        report_file = local.workdir / "engine-report.json"
        # The engine runs in the TensorRT-LLM-image environment with the bundle the operator's init
        # container copied in: nothing of the development venv is visible to it.
        proc = local.start(
            trtllm_image.engine_argv(
                "--options", local.local_path(engine, options), "--prompts", str(prompts_file),
                "--out", str(report_file), "--num-blocks", str(self.engine_blocks),
            ),
            engine_env, "engine",
        )  # fmt: skip
        code = proc.wait(timeout=600)
        if code != 0:
            tail = (local.workdir / "engine.log").read_text(errors="replace")[-3000:]
            raise JourneyError(f"the TensorRT-LLM stand-in exited with {code}:\n{tail}")
        report: dict[str, Any] = json.loads(report_file.read_text())
        return report

    def options_path(self, engine: dict[str, Any]) -> str:
        args = [*engine.get("command", []), *engine.get("args", [])]
        for flag in ("--extra_llm_api_options", "--config"):
            for i, arg in enumerate(args):
                if arg == flag and i + 1 < len(args):
                    return args[i + 1]
                if arg.startswith(flag + "="):
                    return arg.split("=", 1)[1]
        raise JourneyError(f"the TensorRT-LLM container's args name no options file: {args}")

    def build_bundle(self) -> Path:
        """What the connector-bundle image holds, built by the Dockerfile's recipe (once per journey)."""
        if self.bundle is None:
            self.bundle = trtllm_image.build_bundle(self.workdir / "bundle")
        return self.bundle

    # --- 5/6. Prometheus ---------------------------------------------------------
    def start_prometheus(self) -> None:
        """A real Prometheus scraping the pod's /metrics, with the chart's alert rules loaded."""
        rendered = subprocess.run(
            [str(self.cluster.bin_dir / "helm"), "template", RELEASE, str(CHART),
             "--set", "metrics.prometheusRule.enabled=true", "--api-versions", "monitoring.coreos.com/v1"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        rule = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "PrometheusRule")
        prom_dir = self.workdir / "prometheus"
        prom_dir.mkdir(parents=True, exist_ok=True)
        (prom_dir / "rules.yaml").write_text(yaml.safe_dump(rule["spec"]))
        pod_name = self.local_pod.pod["metadata"]["name"] if self.local_pod else "pod"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(prom_dir / "rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": "kvoffload-pods",
                    "static_configs": [
                        {
                            "targets": [f"127.0.0.1:{self.sidecar_port}"],
                            "labels": {"namespace": self.namespace, "pod": pod_name},
                        }
                    ],
                }
            ],
        }
        (prom_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.prometheus_port = free_port()
        log = open(prom_dir / "prometheus.log", "wb")  # noqa: SIM115
        self.prometheus = subprocess.Popen(
            ["prometheus", f"--config.file={prom_dir / 'prometheus.yml'}", f"--storage.tsdb.path={prom_dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.prometheus_port}", "--log.level=warn"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        wait_until(lambda: http_get(self.prom_url("/-/ready"))[0] == 200, 60, "Prometheus ready")
        self.say(f"Prometheus scraping 127.0.0.1:{self.sidecar_port}/metrics at {self.prom_url('')}")

    def prom_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.prometheus_port}{path}"

    def promql(self, query: str) -> float | None:
        """The single value of an instant query, or None when it returns nothing."""
        result = self.promql_vector(query)
        return result[0][1] if result else None

    def promql_vector(self, query: str) -> list[tuple[dict[str, str], float]]:
        """Every (labels, value) of an instant query."""
        status, body = http_get(self.prom_url("/api/v1/query?" + urllib.parse.urlencode({"query": query})))
        if status != 200:
            raise JourneyError(f"PromQL {query!r} failed: {body[:300]}")
        return [(r["metric"], float(r["value"][1])) for r in json.loads(body)["data"]["result"]]

    def token_sources(self) -> dict[tuple[str, str], float]:
        """Prompt tokens by (source, reason), as Prometheus scraped the connector's counter."""
        query = f"sum by (source, reason) ({contract.M_PROMPT_TOKENS}_total)"
        return {(m["source"], m["reason"]): v for m, v in self.promql_vector(query) if v > 0}

    def loaded_alert_rules(self) -> set[str]:
        _, body = http_get(self.prom_url("/api/v1/rules"))
        groups = json.loads(body)["data"]["groups"]
        return {r["name"] for g in groups for r in g["rules"]}

    def rule_groups(self) -> dict[str, Any]:
        """The chart's rule groups as this Prometheus loaded them (the file it was given)."""
        return yaml.safe_load((self.workdir / "prometheus" / "rules.yaml").read_text())  # type: ignore[no-any-return]

    # --- 7. remove the annotation -------------------------------------------------
    def remove_annotation(self) -> dict[str, Any]:
        self.kubectl("annotate", "deployment", self.workload, "-n", self.namespace, f"{contract.ANN_ENABLED}-")
        self.say(f"kubectl annotate deployment {self.workload} {contract.ANN_ENABLED}-")
        wait_until(
            lambda: self.running_pods(injected=False) and not self.running_pods(injected=True),
            120,
            "pods without the sidecar",
        )
        template = self.deployment()["spec"]["template"]
        self.say("pods rolled back; the pod template equals the one before annotation")
        return template  # type: ignore[no-any-return]

    # --- 8. helm uninstall ---------------------------------------------------------
    def uninstall(self) -> str:
        self.stop_operator()
        self.helm("uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait")
        self.installed = False
        leftovers = self.kubectl(
            "get", "deployment,service,configmap,serviceaccount,clusterrole,clusterrolebinding", "-A",
            "-l", f"app.kubernetes.io/instance={RELEASE}", "-o", "name",
        ).stdout.strip()  # fmt: skip
        self.say("helm uninstall: operator, RBAC and config removed; the KVCachePolicy CRD stays (Helm keeps CRDs)")
        return leftovers

    def stop_operator(self) -> None:
        if self.operator and self.operator.poll() is None:
            os.killpg(self.operator.pid, signal.SIGTERM)
            self.operator.wait(timeout=30)

    def close(self) -> None:
        """Stop every process this journey started."""
        if self.local_pod:
            self.local_pod.stop()
        self.stop_operator()
        if self.prometheus and self.prometheus.poll() is None:
            os.killpg(self.prometheus.pid, signal.SIGTERM)
            self.prometheus.wait(timeout=30)
        if self.installed:
            with contextlib.suppress(JourneyError):
                self.helm("uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait")
            self.installed = False


def strip_server_fields(template: dict[str, Any]) -> dict[str, Any]:
    """A pod template without the fields the apiserver or controllers fill in."""
    clean = json.loads(json.dumps(template))
    for key in APISERVER_MANAGED:
        clean.get("metadata", {}).pop(key, None)
    return clean  # type: ignore[no-any-return]


@contextlib.contextmanager
def journey_workdir() -> Iterator[Path]:
    """A temporary folder for one journey's files, removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="kvoffload-journey-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
