"""A fleet opted in at once, the operator SIGKILLed half-way: writes per workload from the audit log.

Issue 46, item 5. On the real local control plane (``hack/localcluster.py``) with the admission-mode
operator as in ``operator_bench`` (its ServiceAccount bound to the chart's rules, the webhook
registered as the chart does), the driver creates N Deployments already opted in (replicas 0 by
default, as the fleet phase does), from a few threads at once. When half of them carry the
operator's record (``kvoffload.io/injection-record``) it SIGKILLs the operator, starts it again and
waits until every one does and the operator has been quiet for a while. Everything it counts comes
from the apiserver's audit log: every write request the operator's ServiceAccount sent (verb,
resource, answer), per workload, the conflicts (409) among them, and the evictions anyone asked for.

    python -m benchmarks.operator_scale --fleet 1000 --kill-operator-halfway [--out FILE]

Prints one JSON document (and writes it to ``--out``). Asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.common import machine_info, versions

NAMESPACE = "scale"


def _creator(api: Any, replicas: int) -> Any:
    from hack.workloads import trtllm_deployment
    from kvoffload import contract as c

    def create(name: str) -> float:
        body = trtllm_deployment(name, NAMESPACE, replicas=replicas, annotations={c.ANN_ENABLED: "true"})
        for attempt in range(5):  # the apiserver on 2 shared cores may time out a request
            try:
                api.request("POST", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments", body)
                return time.monotonic()
            except RuntimeError as exc:
                if "409" in str(exc) or attempt == 4:  # AlreadyExists: an earlier try landed
                    return time.monotonic()
                time.sleep(1)
        return time.monotonic()

    return create


class Converged:
    """Names of the Deployments that carry the operator's record, fed by a watch."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.cond = threading.Condition()

    def on_deployment(self, _type: str, obj: dict[str, Any], _now: float) -> None:
        from kvoffload import contract as c

        if c.ANN_INJECTION_RECORD in ((obj["metadata"].get("annotations")) or {}):
            with self.cond:
                self.names.add(obj["metadata"]["name"])
                self.cond.notify_all()

    def wait_for(self, count: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while len(self.names) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 1.0))
        return True


def _wait_quiet(audit: Any, user: str, quiet_s: float, timeout: float) -> float:
    """Wait until ``user`` has sent no write for ``quiet_s`` (leader-election Lease renewals aside)."""
    t0 = time.monotonic()
    seen = -1
    last_change = time.monotonic()
    while time.monotonic() - t0 < timeout:
        count = len([w for w in audit.writes(user) if w.resource != "leases"])
        if count != seen:
            seen, last_change = count, time.monotonic()
        elif time.monotonic() - last_change >= quiet_s:
            break
        time.sleep(1.0)
    return time.monotonic() - t0


def summarize_writes(writes: list[Any], operator_user: str, n: int) -> dict[str, Any]:
    """Operator writes in the fleet's namespace, per workload; conflicts; evictions (anyone's)."""
    ours = [w for w in writes if w.user == operator_user and w.namespace == NAMESPACE]
    by_kind = Counter(f"{w.verb} {w.resource} {w.code}" for w in ours)
    per_workload = Counter(w.name for w in ours if w.resource == "deployments")
    histogram = Counter(per_workload.get(f"w-{i:04d}", 0) for i in range(n))
    elsewhere = Counter(
        f"{w.verb} {w.resource} {w.code}" for w in writes if w.user == operator_user and w.namespace != NAMESPACE
    )
    evictions = [w for w in writes if w.resource == "pods/eviction" and w.namespace == NAMESPACE]
    workload_writes = sum(per_workload.values())
    return {
        "operator_writes": dict(sorted(by_kind.items())),
        "operator_writes_total": len(ours),
        "operator_writes_per_workload": len(ours) / n,
        "operator_workload_writes_per_workload": workload_writes / n,
        "operator_event_writes_per_workload": sum(1 for w in ours if w.resource == "events") / n,
        "workloads_by_operator_writes_on_them": {str(k): v for k, v in sorted(histogram.items())},
        "conflicts_409": sum(1 for w in ours if w.code == 409),
        "evictions": len(evictions),
        "operator_writes_outside_the_namespace": dict(sorted(elsewhere.items())),
    }


def _pods_injected(api: Any, wanted: int, t0: float, timeout: float) -> dict[str, Any]:
    """Wait until the fleet's ``wanted`` pods all run with the injection (pods admitted while the
    operator was down are caught up by evictions); when that was, and how many were left without it."""
    from kvoffload import contract as c

    deadline = time.monotonic() + timeout
    while True:
        pods = api.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods")["items"]
        live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
        plain = [p for p in live if p["metadata"].get("labels", {}).get(c.LABEL_INJECTED) != "true"]
        if (len(live) >= wanted and not plain) or time.monotonic() > deadline:
            print(f"[scale] {len(live) - len(plain)}/{wanted} pods injected", flush=True)
            return {"pods_injected_s": time.monotonic() - t0, "pods_left_uninjected": len(plain),
                    "pods_live": len(live)}  # fmt: skip
        time.sleep(1.0)


def scale_benchmark(
    n: int, replicas: int, kill_halfway: bool, threads: int, quiet_s: float, keep_audit: Path | None = None
) -> dict[str, Any]:
    """One fresh control plane; see the module docstring."""
    from benchmarks.operator_bench import _namespace, _operator_cluster
    from hack.localcluster import BIN_DIR
    from tests.support.audit import OPERATOR_USER, AuditWindow

    workdir = Path(tempfile.mkdtemp(prefix="kvo-opscale-"))
    gpu_nodes = max(2, -(-n * replicas // 8) + 1)
    result: dict[str, Any] = {"fleet": n, "replicas": replicas, "kill_operator_halfway": kill_halfway,
                              "create_threads": threads, "gpu_nodes": gpu_nodes,
                              "machine": machine_info(), "versions": versions(BIN_DIR)}  # fmt: skip
    stop = threading.Event()
    try:
        with _operator_cluster(workdir, gpu_nodes, "admission") as (cluster, operator, api):
            _namespace(api, NAMESPACE)
            converged = Converged()
            api.watch(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments", converged.on_deployment, stop)
            audit = AuditWindow(cluster.audit_log).mark()
            create = _creator(api, replicas)
            t0 = time.monotonic()
            with ThreadPoolExecutor(threads) as pool:
                futures = [pool.submit(create, f"w-{i:04d}") for i in range(n)]
                if kill_halfway:
                    if not converged.wait_for(n // 2, timeout=1800):
                        raise TimeoutError(f"{n // 2} workloads not converged in 1800 s")
                    operator.kill()
                    result["killed_at_s"] = time.monotonic() - t0
                    result["converged_when_killed"] = len(converged.names)
                    result["created_when_killed"] = sum(1 for f in futures if f.done())
                    print(f"[scale] killed the operator at {len(converged.names)}/{n} converged, "
                          f"{result['created_when_killed']} created", flush=True)  # fmt: skip
                    operator.start()
                    result["restarted_at_s"] = time.monotonic() - t0
                done = [f.result() for f in futures]
            result["create_all_s"] = max(done) - t0
            print(f"[scale] {n} created in {result['create_all_s']:.1f} s", flush=True)
            if not converged.wait_for(n, timeout=1800):
                raise TimeoutError(f"only {len(converged.names)}/{n} converged in 1800 s")
            result["converged_s"] = time.monotonic() - t0
            print(f"[scale] all {n} converged after {result['converged_s']:.1f} s", flush=True)
            if replicas:
                result.update(_pods_injected(api, n * replicas, t0, timeout=600))
            result["quiet_wait_s"] = _wait_quiet(audit, OPERATOR_USER, quiet_s, timeout=600)
            result.update(summarize_writes(audit.writes(), OPERATOR_USER, n))
            result["operator_reconciles"] = {
                f"{name}{dict(labels)}": value for (name, labels), value in operator.metrics().items()
                if name.startswith("kvoffload_operator_reconciles") and name.endswith("_total") and value
            }  # fmt: skip
            if keep_audit is not None:
                shutil.copyfile(cluster.audit_log, keep_audit)
    finally:
        stop.set()
        shutil.rmtree(workdir, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", type=int, default=1000, help="Deployments created opted in at once")
    parser.add_argument("--replicas", type=int, default=0, help="replicas of each (kwok pods when > 0)")
    parser.add_argument(
        "--kill-operator-halfway",
        action="store_true",
        help="SIGKILL the operator when half the fleet carries its record, then restart it",
    )
    parser.add_argument("--threads", type=int, default=8, help="concurrent creates")
    parser.add_argument("--quiet-s", type=float, default=10.0, help="operator silence that ends the run")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--keep-audit", type=Path, help="copy the apiserver's audit log here")
    args = parser.parse_args(argv)
    result = scale_benchmark(
        args.fleet, args.replicas, args.kill_operator_halfway, args.threads, args.quiet_s, args.keep_audit
    )
    result["command"] = "python -m benchmarks.operator_scale " + " ".join(argv if argv is not None else sys.argv[1:])
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
