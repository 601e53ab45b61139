"""Results files, plots and the docs/benchmarks.md summary.

``write_results``, ``parse_gpu_log`` and ``render_markdown`` are pure over their inputs (plus the
file they write), so they are unit-tested on fake data; ``make_plots`` needs matplotlib.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

GENERATED_START = "<!-- make-bench:start -->"
"""docs/benchmarks.md: where the part ``make bench`` writes begins (it ends at ``GPU_PLACEHOLDER``)."""
GPU_PLACEHOLDER = "<!-- gpu-update -->"
"""docs/benchmarks.md: where the part ``make bench`` writes ends; the page around it is written by hand."""
LMCACHE_SHIPPED_GPU = (
    "LMCache 0.5.6 as shipped on the same kind of H200 (measured-baselines.md, not this run): "
    "vLLM-style per-layer layout through `lmcache bench server` (server-driven, CUDA IPC) "
    "13-14 GB/s retrieve and 7-10 GB/s store; TensorRT-LLM layout, engine-driven "
    "(pickled through ZMQ) about 0.15 GB/s; raw pinned copy ceiling 55 GB/s."
)


def _jsonable(value: Any) -> Any:
    """NaN/inf become null so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def results_filename(stamp: str, quick: bool) -> str:
    """``cpu-<stamp>.json`` (``cpu-quick-<stamp>.json`` for --quick runs)."""
    return f"cpu-{'quick-' if quick else ''}{stamp}.json"


def write_results(results: dict[str, Any], out_dir: Path, filename: str) -> Path:
    """Write ``results`` as strict, indented JSON under ``out_dir``; returns the path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / filename
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(_jsonable(results), indent=1, sort_keys=False) + "\n")
    tmp.replace(path)
    return path


def parse_gpu_log(text: str) -> dict[str, Any]:
    """The lead's ``gpu_transfer`` log: JSON lines among LMCache's log lines, plus a failure if it ended in one."""
    env: dict[str, Any] = {}
    sizes: list[dict[str, Any]] = []
    shipped: dict[str, Any] | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if "gpu" in obj and "command" in obj:
            env = obj
        elif "kvoffload" in obj:
            sizes.append(obj)
        elif "lmcache_shipped" in obj:
            shipped = obj
    failure = ""
    lines = [x for x in text.splitlines() if x.strip()]
    if lines and "Traceback" in text and not lines[-1].lstrip().startswith(("{", "|")):
        failure = lines[-1].strip()
    return {"env": env, "sizes": sizes, "shipped": shipped, "failure": failure}


# --- formatting helpers -------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and not math.isfinite(seconds)):
        return "n/a"
    ms = seconds * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def _s(seconds: float | None) -> str:
    if seconds is None or (isinstance(seconds, float) and not math.isfinite(seconds)):
        return "n/a"
    return f"{seconds:.2f}" if seconds < 100 else f"{seconds:.0f}"


def _gbps(row: dict[str, Any], key: str) -> str:
    v = row.get(key)
    if not isinstance(v, dict):
        return "-"
    return f"{v['gbps_p50']:.2f} ({v['gbps_at_p99']:.2f})"


def _header(results: dict[str, Any]) -> list[str]:
    m, v = results["machine"], results["versions"]
    vers = ", ".join(f"{k} {val}" for k, val in v.items())
    return [
        f"- **Run**: {results['started_utc']} ({'quick' if results['quick'] else 'full'} mode), "
        f"{results.get('duration_s', 0):.0f} s; results file `benchmarks/results/{results['results_file']}`",
        f"- **Command**: `{results['command']}` (`make bench ARGS='...'` runs the same)",
        f"- **Machine**: {m['nproc']} CPUs ({m['cpu_model']}), {m['mem_total_gib']} GiB RAM, {m['os']}; "
        f"load average at start {', '.join(f'{x:.2f}' for x in m['loadavg_at_start'])} (the cores are shared with "
        "other jobs: compare numbers within a run, not across runs)",
        f"- **Versions**: {vers}",
    ]


def _connector_section(c: dict[str, Any], plots: dict[str, str]) -> list[str]:
    out = [
        "### 1. Connector overhead (CPU)",
        "",
        f"One LMCache chunk per operation ({c['payload_tokens']} tokens, {c['payload_bytes'] // 1024} KiB; pool "
        f"{c['shape']}) against a real `{c['server']}`. All variants interleaved in the same run, "
        f"{c['reps']} timed repetitions each after {c['warmup']} warm-up rounds. Latency in ms, p50 / p99.",
        "",
        "- `raw`: the LMCache client calls the sidecar backend wraps, called directly (lookup: LOOKUP + "
        "WAIT_PREFETCH_STATUS; retrieve/store: PREPARE -> the same block copies -> COMMIT). **The baseline.**",
        "- `LMCache copies`: the same protocol through LMCache's own `submit_retrieve`/`submit_store` (its "
        "gather/scatter), i.e. what LMCache 0.5.6 ships for this layout.",
        "- `backend`: `SchedulerClient.lookup`, `WorkerBackend.copies.retrieve/store` (timeouts, lock, keys, failure handling).",
        "- `hook, metrics off/on`: the TensorRT-LLM hook doing the operation (`get_num_new_matched_tokens`, "
        "`start_load_kv`, synchronous `wait_for_save`) with `KVOFFLOAD_METRICS_ENABLED` false/true "
        "(prometheus_client multiprocess mode, as deployed). The hook's lookup also secures the load (its "
        "PREPARE_RETRIEVE), so its retrieve is the local copy from the secured slots plus the hook.",
        "",
        "| operation | raw (baseline) | LMCache copies | backend | hook, metrics off | hook, metrics on "
        "| backend - raw (p50) | metrics on - off (p50) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for op, variants in c["ops"].items():

        def cell(name: str, variants: dict[str, Any] = variants) -> str:
            v = variants.get(name)
            return f"{_ms(v['p50'])} / {_ms(v['p99'])}" if v else "-"

        def diff(a: str, b: str, variants: dict[str, Any] = variants) -> str:
            if a not in variants or b not in variants:
                return "-"
            return f"{(variants[a]['p50'] - variants[b]['p50']) * 1e6:+.0f} us"

        out.append(
            f"| {op} | {cell('raw')} | {cell('lmcache_copies')} | {cell('backend')} | {cell('hook_metrics_off')} "
            f"| {cell('hook_metrics_on')} | {diff('backend', 'raw')} | {diff('hook_metrics_on', 'hook_metrics_off')} |"
        )
    p = c.get("metrics_primitives") or {}
    if p:
        out += [
            "",
            "Metrics primitives (same run, ns per call, best of 5 batches): what a hook records per operation "
            f"with metrics on `record_lookup` {p['record_lookup_metrics_on_ns']:.0f} ns, off "
            f"{p['record_lookup_metrics_off_ns']:.0f} ns"
            + (
                f", `record_prompt_tokens` (the token-source counter) {p['record_prompt_tokens_metrics_on_ns']:.0f} ns"
                if "record_prompt_tokens_metrics_on_ns" in p
                else ""
            )
            + f"; prometheus_client called directly for the same "
            f"four values (histogram + 3 counters, multiprocess files) {p['direct_prometheus_observe_plus_3_inc_ns']:.0f} ns; "
            f"the background flusher then spends {p['flush_per_recorded_op_ns']:.0f} ns per recorded operation off the hot path.",
        ]
    beside = c.get("lookup_beside_commits")
    if beside:
        lat = beside["latency"]
        out += [
            "",
            f"A scheduler's lookup + secure of one stored chunk right after {beside['queued_commits']} other "
            "prompts' stores, whose COMMITs are still queued, vs with none queued (same run, "
            f"{beside['reps']} interleaved rounds each, ms p50 / p99): queued "
            f"{_ms(lat['queued']['p50'])} / {_ms(lat['queued']['p99'])}, none {_ms(lat['idle']['p50'])} / "
            f"{_ms(lat['idle']['p99'])}. A lookup waits only for COMMITs on its own prompt's chain, and the "
            "committer holds no lock during its round trip.",
        ]
    out += [
        "",
        f"Every retrieve checked bit-exact against the stored blocks: {_exact(c['retrieve_bit_exact'])}. "
        "Differences below the p99 spread are noise on this shared machine.",
    ]
    if "connector" in plots:
        out += ["", f"![connector overhead]({plots['connector']})"]
    return out


def _exact(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items())
    return str(value)


def _transfer_section(t: dict[str, Any], plots: dict[str, str]) -> list[str]:
    out = [
        "### 2. CPU transfer: sidecar shared-memory path vs memcpy",
        "",
        f"TensorRT-LLM-layout CPU pool ({t['shape']}), real `{t['server']}`. Store = pool blocks -> "
        "LMCache L1 (PREPARE_STORE, copy into the server's SHM slots, COMMIT); retrieve = lookup (untimed), "
        "then SHM slots -> other pool blocks, checked bit-exact. New tokens every round (LMCache skips chunks "
        "it holds). GB/s at the median latency, in brackets at the p99 latency.",
        "",
        "- `memcpy`: `torch` `copy_` of the same bytes between the pool and a contiguous buffer (the ceiling "
        "here; **the baseline**).",
        "- `block copies only`: our block-native copies (`blockcopy`: a chunk holds its blocks' bytes, one "
        "copy per run of consecutive block ids) into preallocated chunk buffers, no server. The request's "
        "blocks are scattered over the pool (shuffled ids), so each block is its own copy; `memcpy` moves "
        "the same bytes in one piece.",
        f"- `LMCache copies`: LMCache 0.5.6's own gather/scatter in the same protocol (up to "
        f"{t['shipped_max_tokens']} tokens).",
        "",
        "| tokens | bytes | reps | memcpy store | memcpy retrieve | block copies only (store / retrieve) "
        "| **kvoffload store** | **kvoffload retrieve** | LMCache copies (store / retrieve) | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in t["sizes"]:
        shipped = (
            f"{_gbps(row, 'lmcache_copies_store')} / {_gbps(row, 'lmcache_copies_retrieve')}"
            if "lmcache_copies_store" in row
            else "-"
        )
        out.append(
            f"| {row['tokens']} | {row['bytes'] / 2**20:.0f} MiB | {row['reps']} | {_gbps(row, 'memcpy_store')} "
            f"| {_gbps(row, 'memcpy_retrieve')} | {_gbps(row, 'blockcopy_store')} / {_gbps(row, 'blockcopy_retrieve')} "
            f"| {_gbps(row, 'kvoffload_store')} | {_gbps(row, 'kvoffload_retrieve')} | {shipped} | {row['bit_exact']} |"
        )
    out += [
        "",
        "Store runs slower than retrieve because the server first-touches and registers fresh L1 objects "
        "in PREPARE_STORE (the copies alone run near memcpy: compare the `block copies only` column); "
        "retrieve pays the PREPARE/COMMIT messages on top of the copy.",
    ]
    if "transfer" in plots:
        out += ["", f"![CPU transfer throughput]({plots['transfer']})"]
    return out


def _writes_table(title: str, writes: dict[str, float], fmt: str = "{:.0f}") -> list[str]:
    if not writes:
        return [f"{title}: none."]
    return [
        f"{title}: " + ", ".join(f"`{k}` {fmt.format(v)}" for k, v in sorted(writes.items(), key=lambda kv: -kv[1]))
    ]


def _operator_section(o: dict[str, Any], plots: dict[str, str]) -> list[str]:
    lat, pods, fleet = o["latency"], o["pods"], o["fleet"]
    rss = o["operator_rss_kib"]
    n_total = o["n_fleet"] + o["n_latency"] + o["n_pods"]

    def row(name: str, s: dict[str, Any], unit: str = "ms") -> str:
        f = _ms if unit == "ms" else _s
        return f"| {name} | {s['n']} | {f(s['p50'])} | {f(s['p99'])} | {f(s['max'])} |"

    plain, annotated = fleet["plain"], fleet["annotated"]
    out = [
        "### 3. Operator on the real local control plane",
        "",
        "kube-apiserver, controller-manager and scheduler v1.36.3, etcd 3.6, kwok (fake GPU nodes: "
        f"{o['gpu_nodes']}), the operator as a process with its ServiceAccount bound to the chart's RBAC rules, "
        "chart defaults (resync 600 s) unless stated. The benchmark driver follows objects with its own "
        "watches and stamps each change when the apiserver announces it. "
        + (
            "Injection at admission (`--injection admission`, the chart's default): the apiserver calls the "
            'operator\'s webhook on 127.0.0.1 over TLS; "the injected template" below is the template '
            "carrying the `kvoffload.io/inject` label, and the pods carry the injection."
            if o.get("injection") == "admission"
            else "Injection in the pod template (`--injection template`)."
        ),
        "",
        "#### Latency, one workload at a time",
        "",
        "| measurement | n | p50 | p99 | max |",
        "|---|---|---|---|---|",
        row("annotate request round trip, ms (baseline: the user's own write)", lat["annotate_request_s"]),
        row("annotate -> watch shows the annotation, ms (baseline: watch delivery)", lat["annotation_seen_by_watch_s"]),
        row("**annotate -> watch shows the injected template, ms**", lat["injected_template_seen_s"]),
        row(
            "plain template change by the user -> new pod Running, s (baseline)",
            pods["plain_rollout_to_running_s"],
            "s",
        ),
        row("**annotate -> injected pod Running (kwok), s**", pods["annotate_to_injected_pod_running_s"], "s"),
        "",
        "With n < 100 the p99 is effectively the maximum. Pods: Deployments with 1 replica on kwok nodes, "
        "baseline and measurement on twin Deployments (each rolled out once, alternating). The rollout "
        "(new ReplicaSet, scheduling, kwok marking the pod Running) dominates and is noisy: "
        + _pod_split(pods.get("timeline") or [])
        + _pair_difference(pods)
        + " Compare the two rows, not the absolute seconds; the operator's own share is the template "
        "latency above.",
    ]
    if "latency" in plots:
        out += ["", f"![operator latency]({plots['latency']})"]
    out += [
        "",
        f"#### {o['n_fleet']} annotated Deployments (replicas 0)",
        "",
        'Created back to back by the driver (one POST at a time) with `kvoffload.io/enabled: "true"`, '
        "replicas 0 (no pods: this measures the operator and the API, not kwok). Baseline, same run: the same "
        "number of plain Deployments created the same way.",
        "",
        "| measurement | value |",
        "|---|---|",
        f"| plain Deployments: all {o['n_fleet']} created (baseline) | {_s(plain['create_all_s'])} s |",
        f"| annotated Deployments: all {o['n_fleet']} created | {_s(annotated['create_all_s'])} s |",
        f"| **annotated: first create -> all injected (converged)** | **{_s(annotated['converged_s'])} s** |",
        f"| per workload, create -> injected, p50 / p99 | {_s(annotated['injection_latency_s']['p50'])} / "
        f"{_s(annotated['injection_latency_s']['p99'])} s |",
        f"| **operator writes per workload** (apiserver_request_total, annotated - plain) / N | "
        f"**{sum(v for v in fleet['operator_writes_per_workload'].values()):.2f}** |",
        f"| operator RSS: idle / after {o['n_fleet'] + o['n_latency'] + o['n_pods']} workloads converged / end "
        f"(peak) | {rss['idle'].get('VmRSS', 0) / 1024:.0f} / {rss.get('converged', {}).get('VmRSS', 0) / 1024:.0f} / "
        f"{rss.get('resync_end', rss.get('steady_end', {})).get('VmRSS', 0) / 1024:.0f} "
        f"({max(v.get('VmHWM', 0) for v in rss.values()) / 1024:.0f}) MiB |",
        "",
    ]
    own = sum(
        v for k, v in fleet["operator_writes_per_workload"].items() if k.startswith("APPLY ") or k == "POST events"
    )
    results_by_kind: dict[str, float] = {}
    for key, value in (o.get("operator_reconciles_before_restart") or {}).items():
        result = key.split('"result": "')[-1].split('"')[0]
        results_by_kind[result] = results_by_kind.get(result, 0.0) + value
    out += [
        f"Of these, the operator's own requests (its Server-Side Applies: the Deployment, and in template mode "
        f"the generated ConfigMap; its Events, Warnings only unless `--events all`) are {own:.2f} per workload; the rest is the controllers reacting to the changed template "
        "(a new ReplicaSet, status updates). Operator reconciles over the whole run before the restart: "
        + ", ".join(f"{k} {v:.0f}" for k, v in sorted(results_by_kind.items()))
        + (
            " (`skipped`: the object's spec changed while the pass ran; the next watch event carries it)."
            if results_by_kind.get("skipped")
            else "."
        ),
        "",
    ]
    out += _writes_table(
        "Writes per workload by verb and resource (annotated - plain; includes what the "
        "controllers do because the template changed)",
        fleet["operator_writes_per_workload"],
        "{:.2f}",
    )
    out += [""]
    out += _writes_table("Plain fleet, all writes (baseline)", plain["writes"])
    out += [""]
    out += _writes_table("Annotated fleet, all writes", annotated["writes"])
    if "convergence" in plots:
        out += ["", f"![convergence]({plots['convergence']})"]
    idle, steady, resync, restart = o["idle_window"], o["steady_window"], o["resync_window"], o["restart"]
    out += [
        "",
        "#### Writes in steady state",
        "",
        "API write requests (POST/PUT/PATCH/APPLY/DELETE in `apiserver_request_total`, from `kubectl get --raw "
        "/metrics` before and after) and etcd puts (`etcd_mvcc_put_total`) over each window.",
        "",
        "| window | seconds | API writes/min | etcd puts/min | by verb/resource |",
        "|---|---|---|---|---|",
        f"| idle: operator running, no workloads (baseline) | {idle['seconds']:.0f} | {idle['writes_per_minute']:.1f} "
        f"| {idle['etcd_puts_per_minute']:.1f} | {_inline(idle['writes'])} |",
        f"| **{n_total} injected workloads, converged, resync 600 s (none in the window)** | {steady['seconds']:.0f} "
        f"| **{steady['writes_per_minute']:.1f}** | {steady['etcd_puts_per_minute']:.1f} | {_inline(steady['writes'])} |",
        f"| same, operator restarted with resync every {o['resync_s']} s | {resync['seconds']:.0f} "
        f"| {resync['writes_per_minute']:.1f} | {resync['etcd_puts_per_minute']:.1f} | {_inline(resync['writes'])} |",
        "",
        f"Operator restart: all {restart['workloads']} injected workloads re-checked in "
        f"{_s(restart['all_rechecked_s'])} s with "
        f"{sum(restart['writes'].values()) / max(1, restart['workloads']):.2f} API writes per workload "
        f"({_inline(restart['writes'])})"
        + (
            f"; {restart['fleet_templates_changed']} of the fleet's pod templates changed across the restart "
            "(each one a rollout; first diff in the results file)."
            if restart.get("fleet_templates_changed")
            else "; no pod template changed across the restart."
        ),
        "",
        "Leases and node status come from kwok and the controllers (the idle row). A periodic resync re-checks "
        "every opted-in workload against the live object (and its ConfigMap, in template mode) and applies only where something "
        "drifted (an apply the apiserver would find unchanged still counts as a write request; etcd puts show "
        "whether anything was stored).",
    ]
    return out


def _pair_difference(pods: dict[str, Any]) -> str:
    plain, injected = pods.get("samples_rollout_s") or [], pods.get("samples_injected_pod_s") or []
    diffs = sorted(b - a for a, b in zip(plain, injected, strict=False))
    if not diffs:
        return ""
    return (
        f" Per pair (started together), injected minus plain: median {diffs[len(diffs) // 2]:+.2f} s "
        f"(min {diffs[0]:+.2f}, max {diffs[-1]:+.2f})."
    )


def _pod_split(timeline: list[dict[str, Any]]) -> str:
    """One sentence on where pod start-up time goes, from the pods' own condition timestamps."""
    sched = [r["to_scheduled_s"] for r in timeline if isinstance(r.get("to_scheduled_s"), (int, float))]
    ready = [r["to_ready_s"] for r in timeline if isinstance(r.get("to_ready_s"), (int, float))]
    sched = [x for x in sched if math.isfinite(x)]
    ready = [x for x in ready if math.isfinite(x)]
    if not ready:
        return ""
    ready.sort()
    return (
        f"the {len(ready)} pods left at the end were scheduled within {max(sched, default=0):.0f} s of creation, "
        f"but kwok marked them Ready {ready[len(ready) // 2]:.0f} s (median; min {ready[0]:.0f}, max {ready[-1]:.0f}) "
        "after creation (condition timestamps, 1 s resolution)."
    )


def _inline(writes: dict[str, float]) -> str:
    if not writes:
        return "none"
    return ", ".join(f"{k} {v:.0f}" for k, v in sorted(writes.items(), key=lambda kv: -kv[1]))


def _gpu_section(gpu: dict[str, Any] | None) -> list[str]:
    out = [
        "### GPU: the first table, NVIDIA H200 (measured by the lead on the lent H200, reported here as data)",
        "",
    ]
    if not gpu or not gpu.get("sizes"):
        out += [
            "No GPU results found in `docs/results/gpu-transfer/earlier/store-load-first-table-h200.log`.",
            "",
            GPU_PLACEHOLDER,
        ]
        return out
    env = gpu["env"]
    out += [
        f"Source: `docs/results/gpu-transfer/earlier/store-load-first-table-h200.log` (JSON lines). GPU {env.get('gpu')}, torch {env.get('torch')}, "
        f"lmcache {env.get('lmcache')}, Python {env.get('python')}. Command: `{env.get('command')}`. "
        "Pool shaped like Llama-3-8B (32 layers, 8 KV heads, head_dim 128, bf16, 32 tokens/block, 128 KiB "
        "per token) in TensorRT-LLM's layout, through the real sidecar (LMCache server, pinned SHM L1) and "
        "the connector's sidecar backend; median of the warm rounds; every retrieve lands in other blocks "
        "and is checked bit-exact. Baseline in the same run: raw pinned `copy_` of the same bytes.",
        "",
        "| tokens | bytes | raw H2D (baseline) | raw D2H (baseline) | **kvoffload store** | **kvoffload retrieve** "
        "| store / D2H | retrieve / H2D | bit-exact | rounds |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in gpu["sizes"]:
        raw, k = row["raw"], row["kvoffload"]
        out.append(
            f"| {row['tokens']} | {row['bytes'] / 2**20:.0f} MiB | {raw['h2d_gbps']:.1f} GB/s | {raw['d2h_gbps']:.1f} GB/s "
            f"| **{k['store_gbps']:.1f} GB/s** ({k['store_ms']:.0f} ms) | **{k['retrieve_gbps']:.1f} GB/s** "
            f"({k['retrieve_ms']:.0f} ms) | {k['store_gbps'] / raw['d2h_gbps']:.0%} "
            f"| {k['retrieve_gbps'] / raw['h2d_gbps']:.0%} | {k['bit_exact']} | {k.get('rounds', '?')} |"
        )
    out += ["", f"Baselines to beat: {LMCACHE_SHIPPED_GPU} Target: at least 80% of the copy ceiling."]
    if gpu.get("shipped"):
        s = gpu["shipped"]["lmcache_shipped"]
        out += [
            "",
            f"LMCache's own copies in the same protocol, {gpu['shipped']['tokens']} tokens: store "
            f"{s['store_gbps']:.2f} GB/s, retrieve {s['retrieve_gbps']:.2f} GB/s.",
        ]
    elif gpu.get("failure"):
        out += [
            "",
            "In that run the same-run measurement of LMCache's own copies (`use_fast_copies=False`) did not "
            f"complete: `{gpu['failure']}`.",
        ]
    out += ["", GPU_PLACEHOLDER]
    return out


def render_markdown(results: dict[str, Any], plots: dict[str, str], gpu: dict[str, Any] | None) -> str:
    """docs/benchmarks.md's generated part (``GENERATED_START`` to ``GPU_PLACEHOLDER``) from one run's results
    (any subset of groups), its plots and the GPU log."""
    groups = results.get("groups", {})
    out = [
        GENERATED_START,
        "",
        "## Measured by `make bench`: connector overhead, CPU transfer, the operator (CPU)",
        "",
        "Written by `make bench` (`python -m benchmarks.run`, `benchmarks/report.py`) from its results file, "
        "from the marker above this heading down to the end marker below; the rest of the page is written by "
        "hand and kept. Its GPU table comes from `docs/results/gpu-transfer/earlier/store-load-first-table-h200.log`. "
        "Benchmarks never run in the test suite and assert nothing; every figure sits next to a baseline "
        "measured in the same run.",
        "",
        "```sh",
        "make bench                               # CPU benchmarks, full counts (about 25 min on 2 cores)",
        "make bench ARGS='--quick'                # small counts, 3-4 min (kwok's pod start-up dominates)",
        "make bench ARGS='--only connector'       # one group: connector | transfer | operator",
        "python -m benchmarks.run --render-only benchmarks/results/cpu-<time>.json   # redraw plots + this part",
        "```",
        "",
        "Results: `benchmarks/results/cpu-<UTC time>.json` (every sample and setting) and PNG plots in "
        "`benchmarks/results/`.",
        "",
        "### This run",
        "",
        *_header(results),
        "",
    ]
    sections = (("connector", _connector_section), ("transfer", _transfer_section), ("operator", _operator_section))
    for name, section in sections:
        if name not in groups:
            continue
        lines = section(groups[name], plots)
        if groups[name].get("from_file"):
            lines[1:1] = ["", f"_Not run this time: numbers from `benchmarks/results/{groups[name]['from_file']}`._"]
        out += [*lines, ""]
    for name, error in (results.get("errors") or {}).items():
        out += [f"**Group `{name}` failed in this run**: `{error}`", ""]
    out += [*_gpu_section(gpu), ""]
    return "\n".join(out)


# --- plots ------------------------------------------------------------------------------


def make_plots(results: dict[str, Any], out_dir: Path, link_prefix: str) -> dict[str, str]:
    """PNG plots for the groups present; returns ``{name: link}`` (``link_prefix`` + file name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = results.get("groups", {})
    links: dict[str, str] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    caption = f"{results['machine']['nproc']} CPUs, {results['started_utc']}"

    if "connector" in groups:
        c = groups["connector"]
        ops = list(c["ops"])
        variants = ["raw", "lmcache_copies", "backend", "hook_metrics_off", "hook_metrics_on"]
        fig, ax = plt.subplots(figsize=(8, 4))
        width = 0.16
        for i, v in enumerate(variants):
            p50 = [c["ops"][op].get(v, {}).get("p50", math.nan) * 1e3 for op in ops]
            p99 = [c["ops"][op].get(v, {}).get("p99", math.nan) * 1e3 for op in ops]
            xs = [j + (i - 2) * width for j in range(len(ops))]
            ax.bar(xs, p50, width, label=v)
            ax.scatter(xs, p99, marker="_", color="black", s=60)
        ax.set_xticks(range(len(ops)), ops)
        ax.set_ylabel("ms per operation (bar p50, tick p99)")
        ax.set_title(f"Connector overhead, one {c['payload_bytes'] // 1024} KiB chunk ({caption})")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "cpu-connector-overhead.png", dpi=110)
        plt.close(fig)
        links["connector"] = link_prefix + "cpu-connector-overhead.png"

    if "transfer" in groups:
        t = groups["transfer"]
        mib = [r["bytes"] / 2**20 for r in t["sizes"]]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, direction in zip(axes, ("store", "retrieve"), strict=True):
            for key, label, style in (
                (f"memcpy_{direction}", "memcpy (baseline)", "k--"),
                (f"blockcopy_{direction}", "block copies only", "c:"),
                (f"kvoffload_{direction}", "kvoffload sidecar", "b-o"),
                (f"lmcache_copies_{direction}", "LMCache copies", "r-x"),
            ):
                pts = [(m, r[key]["gbps_p50"]) for m, r in zip(mib, t["sizes"], strict=True) if key in r]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("MiB per operation")
            ax.set_title(direction)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("GB/s (median)")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"CPU transfer through the sidecar SHM path vs memcpy ({caption})")
        fig.tight_layout()
        fig.savefig(out_dir / "cpu-transfer-throughput.png", dpi=110)
        plt.close(fig)
        links["transfer"] = link_prefix + "cpu-transfer-throughput.png"

    if "operator" in groups:
        o = groups["operator"]
        lat = o["latency"]
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        data = [[x * 1e3 for x in lat["samples_seen_s"]], [x * 1e3 for x in lat["samples_injected_s"]]]
        axes[0].hist(data, bins=30, label=["annotation seen (baseline)", "injected template seen"])
        axes[0].set_xlabel("ms after the annotate request")
        axes[0].set_ylabel("workloads")
        axes[0].set_title(f"annotate -> template (n={len(data[1])})")
        axes[0].legend(fontsize=8)
        pods = o["pods"]
        axes[1].boxplot([pods["samples_rollout_s"], pods["samples_injected_pod_s"]])
        axes[1].set_xticks([1, 2], ["plain rollout\n(baseline)", "annotate ->\ninjected pod"])
        axes[1].set_ylabel("s to pod Running (kwok)")
        axes[1].set_title(f"pods Running (n={len(pods['samples_injected_pod_s'])})")
        fig.suptitle(f"Operator latency ({caption})")
        fig.tight_layout()
        fig.savefig(out_dir / "operator-latency.png", dpi=110)
        plt.close(fig)
        links["latency"] = link_prefix + "operator-latency.png"

        fleet = o["fleet"]
        fig, ax = plt.subplots(figsize=(8, 4))
        for series, label, style in (
            (fleet["plain"]["created_at_s"], "plain Deployments created (baseline)", "k--"),
            (fleet["annotated"]["created_at_s"], "annotated Deployments created", "g-"),
            (fleet["annotated"]["injected_at_s"], "annotated Deployments injected", "b-"),
        ):
            ax.plot(sorted(series), range(1, len(series) + 1), style, label=label)
        ax.set_xlabel("s since the first create")
        ax.set_ylabel("Deployments")
        ax.set_title(f"{o['n_fleet']} Deployments: convergence ({caption})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out_dir / "operator-convergence.png", dpi=110)
        plt.close(fig)
        links["convergence"] = link_prefix + "operator-convergence.png"
    return links
