"""Operator benchmarks on the real local control plane (``hack/localcluster.py``: etcd, kube-apiserver,
controller-manager, scheduler, kwok).

The operator runs as in the integration tests (``OperatorProcess``: ``python -m kvoffload.operator``
with its ServiceAccount bound to the chart's RBAC rules). The driver talks to the apiserver over
plain HTTPS (admin client certificate) and follows workloads with its own watches, so it stamps
each change when the apiserver announces it, without polling.

Phases, each next to a baseline measured in the same run:

1. idle writes: apiserver write requests and etcd puts over a window with the operator running
   and no workloads (the control plane's own background: leases, node status);
2. latency: annotate one existing Deployment at a time; time until the watch shows the injected
   template (baseline: until the watch shows the annotation itself);
3. pods: annotate a Deployment with one replica; time until an injected pod is Running on a kwok
   node (baseline: a plain template change by the user on the same Deployment, to Running);
4. fleet: N Deployments created annotated (replicas 0); time until all are injected, against
   the time the apiserver took to accept the N creates; API writes per workload as the difference
   of ``apiserver_request_total`` deltas against N plain Deployments created the same way;
5. steady state: writes over a window after convergence with the chart's default resync (600 s,
   none inside the window), against window 1; then the operator is restarted with a short resync
   period: time and writes until it has re-checked every workload, and a window with resyncs
   inside it. Operator RSS throughout.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.common import summarize

WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY", "CREATE", "UPDATE"})
Key = tuple[str, str, str]
"""(verb, resource, subresource) of ``apiserver_request_total``."""


def parse_request_totals(metrics_text: str) -> dict[Key, float]:
    """``apiserver_request_total`` summed by (verb, resource, subresource) from /metrics text."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[Key, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "apiserver_request":
            continue
        for sample in family.samples:
            if sample.name != "apiserver_request_total":
                continue
            lbl = sample.labels
            key = (lbl.get("verb", ""), lbl.get("resource", ""), lbl.get("subresource", ""))
            totals[key] = totals.get(key, 0.0) + sample.value
    return dict(totals)


def write_deltas(before: dict[Key, float], after: dict[Key, float]) -> dict[str, float]:
    """Write requests between two scrapes, as ``"VERB resource[/sub]" -> count`` (nonzero only)."""
    out: dict[str, float] = {}
    for key in sorted(set(before) | set(after)):
        verb, resource, sub = key
        if verb not in WRITE_VERBS:
            continue
        delta = after.get(key, 0.0) - before.get(key, 0.0)
        if delta:
            out[f"{verb} {resource}{'/' + sub if sub else ''}"] = delta
    return out


def per_workload(annotated: dict[str, float], plain: dict[str, float], n: int) -> dict[str, float]:
    """Writes per workload that the operator adds: (annotated fleet - plain fleet) / n, by verb/resource."""
    keys = sorted(set(annotated) | set(plain))
    return {
        k: (annotated.get(k, 0.0) - plain.get(k, 0.0)) / n for k in keys if annotated.get(k, 0.0) != plain.get(k, 0.0)
    }


def _parse_etcd(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in ("etcd_mvcc_put_total", "etcd_mvcc_delete_total", "etcd_mvcc_txn_total"):
            if line.startswith(name + " "):
                out[name] = float(line.split()[1])
    return out


class Api:
    """Minimal HTTPS client for the apiserver with the admin certificate (JSON in, JSON out)."""

    def __init__(self, server: str, pki: Path) -> None:
        import urllib3

        self.server = server
        self.pool = urllib3.PoolManager(
            cert_file=str(pki / "admin.crt"),
            key_file=str(pki / "admin.key"),
            ca_certs=str(pki / "ca.crt"),
            cert_reqs="CERT_REQUIRED",
            maxsize=8,
        )

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = None if body is None else json.dumps(body).encode()
        resp = self.pool.request(
            method, self.server + path, body=data, headers={"Content-Type": content_type}, timeout=60.0
        )
        if resp.status >= 400:
            raise RuntimeError(f"{method} {path}: {resp.status} {resp.data[:300]!r}")
        return json.loads(resp.data or b"{}")

    def watch(
        self, path: str, on_event: Callable[[str, dict[str, Any], float], None], stop: threading.Event
    ) -> threading.Thread:
        """Follow ``path`` from now on a daemon thread; ``on_event(type, object, monotonic time)``."""
        import urllib3

        rv = self.request("GET", path + "?limit=1")["metadata"]["resourceVersion"]
        ready = threading.Event()

        def loop() -> None:
            nonlocal rv
            while not stop.is_set():
                url = f"{self.server}{path}?watch=1&resourceVersion={rv}&allowWatchBookmarks=true&timeoutSeconds=30"
                try:
                    resp = self.pool.request(
                        "GET", url, preload_content=False, timeout=urllib3.Timeout(connect=10, read=60)
                    )
                except Exception:
                    time.sleep(0.2)
                    continue
                ready.set()
                buf = b""
                try:
                    for part in resp.stream(1 << 16):
                        now = time.monotonic()
                        buf += part
                        while b"\n" in buf:
                            line, buf = buf.split(b"\n", 1)
                            if not line.strip():
                                continue
                            event = json.loads(line)
                            obj = event.get("object") or {}
                            rv = (obj.get("metadata") or {}).get("resourceVersion", rv)
                            if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                                on_event(event["type"], obj, now)
                        if stop.is_set():
                            break
                except Exception:
                    time.sleep(0.1)
                finally:
                    resp.release_conn()

        thread = threading.Thread(target=loop, name=f"watch{path}", daemon=True)
        thread.start()
        ready.wait(10)
        return thread


@dataclass
class Tracker:
    """First-seen times (monotonic) of what the benchmark waits for, fed by the watches."""

    annotated_at: dict[str, float] = field(default_factory=dict)
    injected_at: dict[str, float] = field(default_factory=dict)
    pod_running: dict[str, tuple[str, bool, float]] = field(default_factory=dict)
    """pod name -> (app label, injected pod?, first seen Running)."""
    cond: threading.Condition = field(default_factory=threading.Condition)

    def on_deployment(self, _type: str, obj: dict[str, Any], now: float) -> None:
        from kvoffload import contract as c
        from tests.support.operator_support import is_injected

        name = obj["metadata"]["name"]
        labels = ((obj["spec"]["template"].get("metadata") or {}).get("labels")) or {}
        with self.cond:
            if name not in self.annotated_at and (obj["metadata"].get("annotations") or {}).get(c.ANN_ENABLED):
                self.annotated_at[name] = now
            if name not in self.injected_at and (is_injected(obj) or c.LABEL_INJECT in labels):
                self.injected_at[name] = now
            self.cond.notify_all()

    def on_pod(self, _type: str, obj: dict[str, Any], now: float) -> None:
        from kvoffload import contract as c

        name = obj["metadata"]["name"]
        if name in self.pod_running or (obj.get("status") or {}).get("phase") != "Running":
            return
        spec = obj.get("spec") or {}
        names = {x["name"] for x in [*spec.get("initContainers", []), *spec.get("containers", [])]}
        app = (obj["metadata"].get("labels") or {}).get("app", "")
        with self.cond:
            self.pod_running[name] = (app, c.SIDECAR_CONTAINER in names, now)
            self.cond.notify_all()

    def is_injected(self, name: str) -> bool:
        return name in self.injected_at

    def count_injected(self, n: int) -> bool:
        return len(self.injected_at) >= n

    def apps_running(self, n: int) -> bool:
        return len({app for app, _, _ in self.pod_running.values()}) >= n

    def new_pod_running(self, app: str, seen: set[str], injected: bool) -> float | None:
        """When a pod of ``app`` not in ``seen`` (and injected or not, as asked) was first Running."""
        times = [t for p, (a, inj, t) in self.pod_running.items() if a == app and inj == injected and p not in seen]
        return min(times) if times else None

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
                self.cond.wait(min(left, 1.0))


def _rss_kib(pid: int) -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    return out


def _operator_args(injection: str, resync_s: int, webhook_port: int) -> list[str]:
    """The operator's flags: its resync period and, in admission mode, its webhook on 127.0.0.1."""
    from tests.support.operator_support import admission_args

    mode = admission_args(webhook_port) if injection == "admission" else ["--injection", injection]
    return ["--resync-seconds", str(resync_s), "--log-level", "warning", *mode]


@contextlib.contextmanager
def _operator_cluster(workdir: Path, gpu_nodes: int, injection: str = "template") -> Iterator[tuple[Any, Any, Api]]:
    """A local control plane, the CRD, the operator's ServiceAccount with the chart's rules, the operator."""

    from hack.localcluster import LocalCluster
    from hack.ports import free_port
    from tests.support.cluster_operator_fixtures import bind_rules
    from tests.support.operator_support import (
        CRD_FILE,
        LEADER_ELECTION_RULES_FILE,
        NODES_RULES_FILE,
        OPERATOR_NAMESPACE,
        OPERATOR_SA,
        RULES_FILE,
        TEMPLATE_RULES_FILE,
        OperatorProcess,
        admission_rules,
        register_webhook_as_the_chart_does,
    )

    cluster = LocalCluster(workdir=workdir / "cluster", gpu_nodes=gpu_nodes)
    cluster.start()
    operator = None
    try:

        def apply(obj: dict[str, Any]) -> None:
            cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))

        cluster.kubectl("apply", "-f", str(CRD_FILE))
        cluster.kubectl("wait", "--for=condition=Established", "crd/kvcachepolicies.kvoffload.io", "--timeout=60s")
        apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}})
        apply(
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": OPERATOR_SA, "namespace": OPERATOR_NAMESPACE},
            }
        )
        bind_rules(cluster, "kvoffload-operator-bench", RULES_FILE)
        bind_rules(cluster, "kvoffload-operator-bench-nodes", NODES_RULES_FILE)
        bind_rules(cluster, "kvoffload-operator-bench-leader-election", LEADER_ELECTION_RULES_FILE)
        if injection == "template":  # admission mode writes no ConfigMap
            bind_rules(cluster, "kvoffload-operator-bench-template", TEMPLATE_RULES_FILE)
        if injection == "admission":
            for name, rules in admission_rules("kvoffload-operator-bench").items():
                bind_rules(cluster, name, rules)
        kubeconfig = cluster.service_account_kubeconfig(
            OPERATOR_NAMESPACE, OPERATOR_SA, workdir / "operator.kubeconfig"
        )
        (workdir / "operator").mkdir(exist_ok=True)
        webhook_port = free_port()
        if injection == "admission":  # the chart ships the registration; the operator patches its caBundle
            register_webhook_as_the_chart_does(cluster, webhook_port)
        operator = OperatorProcess(
            kubeconfig=kubeconfig,
            workdir=workdir / "operator",
            extra_args=_operator_args(injection, 600, webhook_port),
        )
        operator.start()
        yield cluster, operator, Api(cluster.server, cluster.pki)
    finally:
        if operator is not None:
            operator.stop()
        cluster.stop()


def _namespace(api: Api, name: str) -> str:
    api.request(
        "POST",
        "/api/v1/namespaces",
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": "baseline"}},
        },
    )
    return name


def _create(api: Api, ns: str, name: str, replicas: int, annotated: bool) -> None:
    from hack.workloads import trtllm_deployment
    from kvoffload import contract as c

    body = trtllm_deployment(name, ns, replicas=replicas, annotations={c.ANN_ENABLED: "true"} if annotated else None)
    api.request("POST", f"/apis/apps/v1/namespaces/{ns}/deployments", body)


def _patch(api: Api, ns: str, name: str, patch: dict[str, Any]) -> None:
    api.request(
        "PATCH", f"/apis/apps/v1/namespaces/{ns}/deployments/{name}", patch, content_type="application/merge-patch+json"
    )


def _annotate(api: Api, ns: str, name: str) -> None:
    from kvoffload import contract as c

    _patch(api, ns, name, {"metadata": {"annotations": {c.ANN_ENABLED: "true"}}})


class Scrapes:
    """``kubectl get --raw /metrics`` (apiserver) and etcd's /metrics."""

    def __init__(self, cluster: Any, quiet_s: float = 3.0) -> None:
        self.cluster = cluster
        self.quiet_s = quiet_s

    def requests(self) -> dict[Key, float]:
        return parse_request_totals(self.cluster.kubectl("get", "--raw", "/metrics").stdout)

    def etcd(self) -> dict[str, float]:
        with urllib.request.urlopen(f"{self.cluster.etcd_url}/metrics", timeout=10) as r:
            return _parse_etcd(r.read().decode())

    def window(self, seconds: float) -> dict[str, Any]:
        """Writes (apiserver requests, etcd puts) over ``seconds``."""
        r0, e0 = self.requests(), self.etcd()
        time.sleep(seconds)
        r1, e1 = self.requests(), self.etcd()
        writes = write_deltas(r0, r1)
        total = sum(writes.values())
        return {
            "seconds": seconds,
            "writes": writes,
            "writes_total": total,
            "writes_per_minute": total * 60.0 / seconds,
            "etcd_puts_per_minute": (e1.get("etcd_mvcc_put_total", 0) - e0.get("etcd_mvcc_put_total", 0))
            * 60.0
            / seconds,
        }

    def quiesce(self, timeout: float = 300.0, ignore: tuple[str, ...] = ("leases", "nodes")) -> float:
        """Wait until no writes (except to ``ignore``d resources) happen for ``quiet_s``; returns seconds waited."""
        quiet_s = self.quiet_s
        t0 = time.monotonic()
        last = self.requests()
        while time.monotonic() - t0 < timeout:
            time.sleep(quiet_s)
            now = self.requests()
            moved = {k: v for k, v in write_deltas(last, now).items() if k.split()[1].split("/")[0] not in ignore}
            if not moved:
                return time.monotonic() - t0
            last = now
        return math.inf


def operator_benchmark(
    n_fleet: int,
    n_latency: int,
    n_pods: int,
    window_s: float,
    resync_s: int,
    quiet_s: float = 3.0,
    injection: str = "template",
) -> dict[str, Any]:
    """All operator phases on one fresh control plane; see the module docstring."""
    workdir = Path(tempfile.mkdtemp(prefix="kvo-opbench-"))
    gpu_nodes = max(2, math.ceil(4 * n_pods / 8) + 1)
    result: dict[str, Any] = {
        "n_fleet": n_fleet,
        "n_latency": n_latency,
        "n_pods": n_pods,
        "window_s": window_s,
        "resync_s": resync_s,
        "gpu_nodes": gpu_nodes,
        "injection": injection,
    }
    stop = threading.Event()
    try:
        with _operator_cluster(workdir, gpu_nodes, injection) as (cluster, operator, api):
            pid = operator.popen.pid
            started_operator = time.monotonic()
            scrapes = Scrapes(cluster, quiet_s)
            tracker = Tracker()
            rss: dict[str, dict[str, int]] = {"idle": _rss_kib(pid)}
            print(
                f"[operator] control plane up in {cluster.started_in_s:.1f} s; idle window {window_s:.0f} s", flush=True
            )

            # 1. idle writes
            scrapes.quiesce(timeout=60)
            result["idle_window"] = scrapes.window(window_s)

            # 2. annotate -> injected template, one at a time
            ns = _namespace(api, "bench-latency")
            api.watch(f"/apis/apps/v1/namespaces/{ns}/deployments", tracker.on_deployment, stop)
            for i in range(n_latency):
                _create(api, ns, f"lat-{i:04d}", replicas=0, annotated=False)
            scrapes.quiesce(timeout=120)
            patch_s, seen_s, injected_s = [], [], []
            for i in range(n_latency):
                name = f"lat-{i:04d}"
                t0 = time.monotonic()
                _annotate(api, ns, name)
                t1 = time.monotonic()
                tracker.wait(partial(tracker.is_injected, name), 60, f"{name} injected")
                patch_s.append(t1 - t0)
                seen_s.append(tracker.annotated_at[name] - t0)
                injected_s.append(tracker.injected_at[name] - t0)
            result["latency"] = {
                "annotate_request_s": summarize(patch_s),
                "annotation_seen_by_watch_s": summarize(seen_s),
                "injected_template_seen_s": summarize(injected_s),
                "samples_injected_s": injected_s,
                "samples_seen_s": seen_s,
            }
            rss["after_latency"] = _rss_kib(pid)
            print(f"[operator] annotate->template p50 {summarize(injected_s)['p50'] * 1e3:.0f} ms", flush=True)

            # 3. annotate -> injected pod Running (kwok), vs a plain rollout of the same Deployment
            pns = _namespace(api, "bench-pods")
            api.watch(f"/api/v1/namespaces/{pns}/pods", tracker.on_pod, stop)
            # Separate Deployments for the baseline and the measurement, each rolled out once: kwok takes
            # longer with every further rollout of the same Deployment, which would favour the baseline.
            plain_names = [f"plain-{i:03d}" for i in range(n_pods)]
            annotated_names = [f"annotated-{i:03d}" for i in range(n_pods)]
            for name in [*plain_names, *annotated_names]:
                _create(api, pns, name, replicas=1, annotated=False)
            tracker.wait(partial(tracker.apps_running, 2 * n_pods), 180, "first pods Running")
            scrapes.quiesce(timeout=120)
            rollout_s, injected_pod_s = [], []
            for i in range(n_pods):
                # The pair starts together, so whatever kwok is doing at the time hits both alike.
                seen = set(tracker.pod_running)
                patch = {"spec": {"template": {"metadata": {"annotations": {"bench/rollout": str(i)}}}}}
                t_plain = time.monotonic()
                _patch(api, pns, plain_names[i], patch)
                t_annotated = time.monotonic()
                _annotate(api, pns, annotated_names[i])
                t = tracker.wait(partial(tracker.new_pod_running, plain_names[i], seen, False), 300, "rollout")
                rollout_s.append(t - t_plain)
                t = tracker.wait(partial(tracker.new_pod_running, annotated_names[i], seen, True), 300, "injected pod")
                injected_pod_s.append(t - t_annotated)
            pod_timeline = _pod_timeline(api, pns)
            result["pods"] = {
                "timeline": pod_timeline,
                "plain_rollout_to_running_s": summarize(rollout_s),
                "annotate_to_injected_pod_running_s": summarize(injected_pod_s),
                "samples_rollout_s": rollout_s,
                "samples_injected_pod_s": injected_pod_s,
            }
            print(f"[operator] annotate->pod Running p50 {summarize(injected_pod_s)['p50']:.2f} s", flush=True)

            # 4. fleet: N plain (baseline) then N annotated, replicas 0
            scrapes.quiesce(timeout=180)
            fleet: dict[str, Any] = {}
            for label, annotated in (("plain", False), ("annotated", True)):
                fns = _namespace(api, f"bench-fleet-{label}")
                ftracker = Tracker()
                api.watch(f"/apis/apps/v1/namespaces/{fns}/deployments", ftracker.on_deployment, stop)
                before = scrapes.requests()
                created: list[float] = []
                t0 = time.monotonic()
                for i in range(n_fleet):
                    _create(api, fns, f"w-{i:04d}", replicas=0, annotated=annotated)
                    created.append(time.monotonic() - t0)
                converged = math.nan
                if annotated:
                    ftracker.wait(partial(ftracker.count_injected, n_fleet), 1800, f"{n_fleet} injected")
                    converged = max(ftracker.injected_at.values()) - t0
                    rss["converged"] = _rss_kib(pid)
                waited = scrapes.quiesce(timeout=300)
                deltas = write_deltas(before, scrapes.requests())
                fleet[label] = {
                    "create_all_s": created[-1],
                    "converged_s": converged,
                    "quiesce_wait_s": waited,
                    "writes": deltas,
                    "created_at_s": created,
                    "injected_at_s": sorted(t - t0 for t in ftracker.injected_at.values()),
                    "injection_latency_s": summarize(
                        [ftracker.injected_at[n] - t0 - created[int(n.split("-")[1])] for n in ftracker.injected_at]
                    ),
                }
                print(
                    f"[operator] fleet {label}: {n_fleet} created in {created[-1]:.1f} s"
                    + (f", all injected after {converged:.1f} s" if annotated else ""),
                    flush=True,
                )
            fleet["operator_writes_per_workload"] = per_workload(
                fleet["annotated"]["writes"], fleet["plain"]["writes"], n_fleet
            )
            result["fleet"] = fleet

            # 5a. steady state after convergence, the chart's default resync (600 s): no resync in the window
            result["steady_window"] = scrapes.window(window_s)
            result["steady_window"]["operator_uptime_s"] = time.monotonic() - started_operator
            rss["steady_end"] = _rss_kib(pid)
            print(
                f"[operator] steady writes/min {result['steady_window']['writes_per_minute']:.1f} "
                f"(idle {result['idle_window']['writes_per_minute']:.1f})",
                flush=True,
            )

            # 5b. restart with a short resync period: re-check of every workload, then a window with resyncs
            result["operator_reconciles_before_restart"] = _operator_counters(operator)
            n_total = n_fleet + n_latency + n_pods  # the pods phase annotates n_pods of its 2 * n_pods
            templates_before = _templates(api, "bench-fleet-annotated")
            operator.stop()
            before = scrapes.requests()
            port = (
                operator.extra_args[operator.extra_args.index("--webhook-port") + 1]
                if injection == "admission"
                else "0"
            )
            operator.extra_args = _operator_args(injection, resync_s, int(port))
            t0 = time.monotonic()
            operator.start()
            pid = operator.popen.pid
            recheck = _wait_rechecked(operator, n_total, timeout=600)
            restart_s = time.monotonic() - t0
            restart_writes = write_deltas(before, scrapes.requests())
            time.sleep(2)
            changed = _template_changes(templates_before, _templates(api, "bench-fleet-annotated"))
            result["restart"] = {
                "workloads": n_total,
                "all_rechecked_s": restart_s if recheck else math.nan,
                "writes": restart_writes,
                "writes_per_workload": {k: v / n_total for k, v in restart_writes.items()},
                "fleet_templates_changed": changed["count"],
                "first_template_diff": changed["diff"],
            }
            rss["after_restart"] = _rss_kib(pid)
            result["resync_window"] = scrapes.window(window_s)
            rss["resync_end"] = _rss_kib(pid)
            result["operator_rss_kib"] = rss
            result["operator_reconciles_after_restart"] = _operator_counters(operator)
            print(
                f"[operator] with resync every {resync_s} s: writes/min "
                f"{result['resync_window']['writes_per_minute']:.1f}",
                flush=True,
            )
    finally:
        stop.set()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def _pod_timeline(api: Api, ns: str) -> list[dict[str, Any]]:
    """Per pod: seconds from creation to PodScheduled and to Ready (1 s resolution), to split the pod latency."""
    import datetime

    def ts(value: str | None) -> float:
        if not value:
            return math.nan
        return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc).timestamp()

    rows = []
    for pod in api.request("GET", f"/api/v1/namespaces/{ns}/pods")["items"]:
        conds = {c["type"]: c.get("lastTransitionTime") for c in (pod.get("status") or {}).get("conditions", [])}
        created = ts(pod["metadata"]["creationTimestamp"])
        rows.append(
            {
                "pod": pod["metadata"]["name"],
                "created": pod["metadata"]["creationTimestamp"],
                "to_scheduled_s": ts(conds.get("PodScheduled")) - created,
                "to_ready_s": ts(conds.get("Ready")) - created,
            }
        )
    return sorted(rows, key=lambda r: str(r["created"]))


def _templates(api: Api, ns: str) -> dict[str, Any]:
    items = api.request("GET", f"/apis/apps/v1/namespaces/{ns}/deployments")["items"]
    return {d["metadata"]["name"]: d["spec"]["template"] for d in items}


def _template_changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """How many pod templates differ, and a unified diff of the first one (truncated)."""
    import difflib

    changed = sorted(n for n in before if n in after and before[n] != after[n])
    diff = ""
    if changed:
        a = json.dumps(before[changed[0]], indent=1, sort_keys=True).splitlines()
        b = json.dumps(after[changed[0]], indent=1, sort_keys=True).splitlines()
        diff = "\n".join(list(difflib.unified_diff(a, b, lineterm="", n=1))[:40])
    return {"count": len(changed), "diff": diff}


def _wait_rechecked(operator: Any, n: int, timeout: float) -> bool:
    """Wait until the operator's reconciles (any result but noop) reach ``n`` (its initial listing done)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sum(_operator_counters(operator).values()) >= n:
            return True
        time.sleep(0.5)
    return False


def _operator_counters(operator: Any) -> dict[str, float]:
    from kvoffload import contract as c

    out: dict[str, float] = {}
    with contextlib.suppress(Exception):
        for (name, labels), value in operator.metrics().items():
            if name.startswith(c.M_OPERATOR_RECONCILES) and name.endswith("_total") and value:
                out[name + json.dumps(dict(labels), sort_keys=True)] = value
    return out
