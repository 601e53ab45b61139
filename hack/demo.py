"""The README's main command: kvoffload on a local control plane, narrated.

Starts etcd, kube-apiserver, controllers and kwok; installs the chart; runs the
operator with the chart's ServiceAccount; annotates a TensorRT-LLM Deployment;
runs the injected pod's sidecar and a TensorRT-LLM stand-in as local processes;
sends prompts with shared prefixes; shows the hit rate from a real Prometheus;
removes the annotation and uninstalls. Run with ``make demo``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from hack.journey import Journey, shared_prefix_prompts, strip_server_fields
from hack.localcluster import LocalCluster, missing_binaries
from hack.polling import wait_until
from kvoffload import contract

STEP = 0
T0 = time.monotonic()


def say(message: str) -> None:
    global STEP
    STEP += 1
    print(f"[{time.monotonic() - T0:6.1f}s] {STEP:2d}. {message}", flush=True)


def token_source_lines(sources: dict[tuple[str, str], float], l2_hits: float, lookup_hits: float) -> list[str]:
    """Where the run's prompt tokens came from (device / L1 / L2 / computed by reason), from PromQL."""
    total = sum(sources.values()) or 1.0
    device = sum(v for (s, _), v in sources.items() if s == "device")
    cache = sum(v for (s, _), v in sources.items() if s == "cache")
    from_l2 = cache * (l2_hits / lookup_hits) if lookup_hits else 0.0  # LMCache's per-pod share of L2-served hits
    computed = {r: v for (s, r), v in sources.items() if s == "computed"}
    why = ", ".join(f"{r} {v:.0f}" for r, v in sorted(computed.items(), key=lambda kv: -kv[1]))
    return [
        f"  tokens:     {total:.0f} prompt tokens scheduled (PromQL, {contract.M_PROMPT_TOKENS}_total):",
        f"              device {device:.0f} ({device / total:.0%}), L1 {cache - from_l2:.0f} "
        f"({(cache - from_l2) / total:.0%}), L2 {from_l2:.0f} ({from_l2 / total:.0%}), "
        f"computed {sum(computed.values()):.0f} ({sum(computed.values()) / total:.0%}: {why or 'none'})",
    ]


def walk(journey: Journey, cluster: LocalCluster, workdir: Path, requests: int, keep: bool) -> int:
    """The journey, narrated: install, opt in, serve, measure, opt out, uninstall; 0 when all held."""
    journey.install_chart()
    journey.start_operator()
    journey.create_workload(options_from_configmap=False)
    pod = journey.annotate()
    prefix_tokens, suffix_tokens = 2048, 128
    prompts = shared_prefix_prompts(requests, prefix_tokens, suffix_tokens)
    say(f"sending {requests} prompts sharing a {prefix_tokens}-token prefix (device KV evicted after the first)")
    report = journey.run_pod_locally(pod, prompts)
    results = [r for phase in report["phases"] if "results" in phase for r in phase["results"]]
    later = report["phases"][2]["results"]
    computed = sum(r["computed_prompt_tokens"] for r in later)
    prompt_tokens = len(later) * (prefix_tokens + suffix_tokens)
    failed = sum(r["failed"] for r in results)
    say(
        f"engine done: {len(results)} requests, {failed} failed, {report['kv_mismatches']} KV mismatches; "
        f"later requests computed {computed} of {prompt_tokens} prompt tokens"
    )
    journey.start_prometheus()
    hit = wait_until(lambda: journey.promql("sum(kvoffload_connector_lookup_hit_tokens_total)"), 60, "metrics")
    queried = journey.promql("sum(kvoffload_connector_lookup_queried_tokens_total)") or 0.0
    retrieved = journey.promql("sum(kvoffload_connector_retrieve_bytes_total)") or 0.0
    say(f"PromQL: lookup hit tokens {hit:.0f} of {queried:.0f} queried; retrieved {retrieved / 2**20:.1f} MiB")
    sources = wait_until(journey.token_sources, 30, "prompt-token sources")
    l2 = journey.promql("sum(lmcache_mp_lookup_hit_l2_tokens_total)") or 0.0
    lookup_hits = journey.promql("sum(lmcache_mp_lookup_hit_tokens_total)") or 0.0
    before = journey.original_template
    after = journey.remove_annotation()
    same = strip_server_fields(after) == strip_server_fields(before)
    leftovers = journey.uninstall()
    print("\nSummary")
    print("  injected:   kvoffload-cache (LMCache server, native sidecar), kvoffload-connector-bundle (init),")
    print("              kvoffload-trtllm-options (init: writes the TensorRT-LLM options with kv_connector_config),")
    print("              /dev/shm + metrics volumes, connector env")
    for line in token_source_lines(sources, l2, lookup_hits):
        print(line)
    print(f"  recompute:  later requests computed {computed} of {prompt_tokens} prompt tokens")
    print(
        f"  removal:    template identical to the original: {same}; objects left after uninstall: {leftovers or 'none'}"
    )
    print(f"  logs:       {workdir} (operator.log, pod/sidecar.log, pod/engine.log, prometheus/)")
    if keep:
        print(f"\nPrometheus: {journey.prom_url('/graph')}   kubectl --kubeconfig {cluster.admin_kubeconfig} ...")
        print("Ctrl-C stops everything.")
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    ok = same and not failed and report["kv_mismatches"] == 0 and hit > 0
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(".cache/demo"), help="working folder (logs stay here)")
    parser.add_argument("--keep", action="store_true", help="leave the cluster and Prometheus running until Ctrl-C")
    parser.add_argument("--requests", type=int, default=8)
    args = parser.parse_args(argv)
    missing = missing_binaries()
    if missing:
        print(f"demo: missing {', '.join(missing)}; run hack/setup.sh (make demo does)", file=sys.stderr)
        return 2
    workdir = args.dir.resolve()
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    cluster = LocalCluster(workdir=workdir / "cluster", gpu_nodes=2)
    print("kvoffload demo: KV-cache offload for TensorRT-LLM on a local Kubernetes control plane\n", flush=True)
    cluster.start()
    say(f"control plane up in {cluster.started_in_s:.1f} s (Kubernetes v1.36.3, 2 fake GPU nodes via kwok)")
    journey = Journey(cluster=cluster, workdir=workdir, say=say)
    try:
        return walk(journey, cluster, workdir, args.requests, args.keep)
    finally:
        journey.close()
        cluster.stop()
        print("cleaned up: all processes stopped" + ("" if args.keep else f"; files in {workdir}"), flush=True)


if __name__ == "__main__":
    sys.exit(main())
