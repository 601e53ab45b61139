"""The benchmark runner's pure parts on fake data, so they do not rot (no benchmark runs here)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from typing import Any

from benchmarks import run
from benchmarks.common import interleaved, percentile, scattered_block_ids, summarize
from benchmarks.operator_bench import parse_request_totals, per_workload, write_deltas
from benchmarks.report import (
    GENERATED_START,
    GPU_PLACEHOLDER,
    parse_gpu_log,
    render_markdown,
    results_filename,
    write_results,
)


def _stat(p50: float, p99: float, n: int = 10) -> dict[str, float]:
    return {"n": n, "p50": p50, "p99": p99, "min": p50 / 2, "max": p99, "mean": p50}


def _rate(gbps: float) -> dict[str, float]:
    return {"n": 3, "p50_ms": 10.0, "p99_ms": 12.0, "gbps_p50": gbps, "gbps_at_p99": gbps * 0.8}


def fake_results() -> dict[str, Any]:
    variants = ("raw", "lmcache_copies", "backend", "hook_metrics_off", "hook_metrics_on")
    writes = {"APPLY deployments": 30.0, "POST deployments": 10.0}
    window = {
        "seconds": 120.0,
        "writes": {"PUT leases": 24.0},
        "writes_total": 24.0,
        "writes_per_minute": 12.0,
        "etcd_puts_per_minute": 12.0,
    }
    return {
        "started_utc": "2026-11-30 12:00:00 UTC",
        "command": "python -m benchmarks.run --quick",
        "quick": True,
        "duration_s": 100.0,
        "results_file": "cpu-quick-x.json",
        "machine": {
            "nproc": 2,
            "cpu_model": "Fake CPU",
            "mem_total_gib": 24.0,
            "os": "Linux",
            "loadavg_at_start": [1.0, 1.0, 1.0],
        },
        "versions": {"python": "3.11", "torch": "2.x", "lmcache": "0.5.6", "kube-apiserver": "Kubernetes v1.36.3"},
        "errors": {"transfer": "RuntimeError: boom"},
        "groups": {
            "connector": {
                "shape": "4 layers",
                "payload_bytes": 1 << 20,
                "payload_tokens": 256,
                "reps": 10,
                "warmup": 2,
                "server": "lmcache server",
                "retrieve_bit_exact": True,
                "ops": {op: {v: _stat(0.002, 0.004) for v in variants} for op in ("lookup", "retrieve", "store")},
                "metrics_primitives": {
                    "record_lookup_metrics_on_ns": 160.0,
                    "record_lookup_metrics_off_ns": 90.0,
                    "direct_prometheus_observe_plus_3_inc_ns": 6000.0,
                    "flush_per_recorded_op_ns": 3000.0,
                },
            },
            "operator": {
                "n_fleet": 10,
                "n_latency": 5,
                "n_pods": 2,
                "window_s": 120.0,
                "resync_s": 60,
                "gpu_nodes": 2,
                "latency": {
                    "annotate_request_s": _stat(0.01, 0.02),
                    "annotation_seen_by_watch_s": _stat(0.01, 0.02),
                    "injected_template_seen_s": _stat(0.1, 0.2),
                    "samples_seen_s": [0.01] * 5,
                    "samples_injected_s": [0.1] * 5,
                },
                "pods": {
                    "plain_rollout_to_running_s": _stat(2.0, 3.0),
                    "annotate_to_injected_pod_running_s": _stat(2.5, 3.5),
                    "samples_rollout_s": [2.0, 3.0],
                    "timeline": [{"pod": "p", "created": "t", "to_scheduled_s": 0.0, "to_ready_s": 5.0}],
                    "samples_injected_pod_s": [2.5, 3.5],
                },
                "fleet": {
                    "plain": {
                        "create_all_s": 1.0,
                        "converged_s": None,
                        "writes": {"POST deployments": 10.0},
                        "created_at_s": [0.1 * i for i in range(10)],
                        "injected_at_s": [],
                        "injection_latency_s": _stat(math.nan, math.nan, 0),
                    },
                    "annotated": {
                        "create_all_s": 1.0,
                        "converged_s": 2.0,
                        "writes": writes,
                        "created_at_s": [0.1 * i for i in range(10)],
                        "injected_at_s": [0.2 * i for i in range(10)],
                        "injection_latency_s": _stat(0.5, 0.9),
                    },
                    "operator_writes_per_workload": {"APPLY deployments": 3.0},
                },
                "idle_window": window,
                "steady_window": window,
                "resync_window": window,
                "restart": {"workloads": 17, "all_rechecked_s": 1.5, "writes": {"APPLY deployments": 17.0}},
                "operator_rss_kib": {
                    "idle": {"VmRSS": 80_000, "VmHWM": 80_000},
                    "converged": {"VmRSS": 90_000, "VmHWM": 91_000},
                },
            },
        },
    }


GPU_LOG = "\n".join(
    [
        "[LMCache INFO] noise",
        json.dumps({"gpu": "NVIDIA H200", "torch": "2.11.0", "lmcache": "0.5.6", "python": "3.12", "command": "cmd"}),
        json.dumps(
            {
                "tokens": 4096,
                "bytes": 536870912,
                "raw": {"h2d_gbps": 55.0, "h2d_ms": 9.8, "d2h_gbps": 55.0, "d2h_ms": 9.8},
                "kvoffload": {
                    "store_gbps": 28.0,
                    "store_ms": 19.0,
                    "retrieve_gbps": 30.0,
                    "retrieve_ms": 18.0,
                    "bit_exact": True,
                    "all_hit": True,
                    "rounds": 3,
                },
            }
        ),
        "Traceback (most recent call last):",
        "kvoffload.connector.backends.base.BackendError: store failed (server_error)",
    ]
)


def test_statistics() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == 9.9
    assert math.isnan(percentile([], 50))
    s = summarize([1.0, 2.0, 3.0, 4.0])
    assert s["n"] == 4 and s["p50"] == 2.5 and s["min"] == 1.0 and s["max"] == 4.0


def test_scattered_block_ids_are_two_disjoint_shuffled_halves_fixed_by_the_seed() -> None:
    src, dst = scattered_block_ids(64, seed=3)
    assert len(src) == len(dst) == 64
    assert sorted(src + dst) == list(range(128))
    assert (src, dst) == scattered_block_ids(64, seed=3) != scattered_block_ids(64, seed=4)
    neighbours = sum(b == a + 1 for a, b in itertools.pairwise(src))
    assert neighbours < 8, "shuffled: almost every block is its own copy"


def test_interleaved_discards_warmup_and_rotates() -> None:
    calls: list[str] = []
    samples = interleaved(
        [("a", lambda i: calls.append("a") or 1.0), ("b", lambda i: calls.append("b") or 2.0)], reps=3, warmup=1
    )
    assert samples == {"a": [1.0] * 3, "b": [2.0] * 3}
    assert calls[:4] == ["a", "b", "b", "a"]


def test_write_results_is_strict_json(tmp_path: Path) -> None:
    path = write_results({"x": math.nan, "y": [1.0, math.inf]}, tmp_path, results_filename("20261130T120000Z", True))
    assert path.name == "cpu-quick-20261130T120000Z.json"
    assert json.loads(path.read_text()) == {"x": None, "y": [1.0, None]}


def test_apiserver_write_counting() -> None:
    text = "\n".join(
        [
            "# HELP apiserver_request_total Counter",
            "# TYPE apiserver_request_total counter",
            'apiserver_request_total{code="201",resource="deployments",subresource="",verb="POST"} 5',
            'apiserver_request_total{code="200",resource="deployments",subresource="",verb="APPLY"} 7',
            'apiserver_request_total{code="409",resource="deployments",subresource="",verb="APPLY"} 3',
            'apiserver_request_total{code="200",resource="pods",subresource="",verb="LIST"} 9',
        ]
    )
    after = parse_request_totals(text)
    assert after[("APPLY", "deployments", "")] == 10
    deltas = write_deltas({("POST", "deployments", ""): 1.0}, after)
    assert deltas == {"APPLY deployments": 10.0, "POST deployments": 4.0}
    assert per_workload({"APPLY deployments": 10.0, "POST deployments": 4.0}, {"POST deployments": 4.0}, 5) == {
        "APPLY deployments": 2.0
    }


def test_gpu_log_parsing() -> None:
    gpu = parse_gpu_log(GPU_LOG)
    assert gpu["env"]["gpu"] == "NVIDIA H200"
    assert [r["tokens"] for r in gpu["sizes"]] == [4096]
    assert gpu["failure"].startswith("kvoffload.connector.backends.base.BackendError")


def test_summary_renders_every_group_and_the_gpu_section() -> None:
    text = render_markdown(
        fake_results(), {"latency": "../benchmarks/results/operator-latency.png"}, parse_gpu_log(GPU_LOG)
    )
    assert "## 1. Connector overhead" in text and "## 3. Operator" in text
    assert "Group `transfer` failed" in text
    assert "| lookup | 2.00 / 4.00 |" in text
    assert "28.0 GB/s" in text and "51%" in text  # store / D2H of the fake GPU row
    assert text.startswith(GENERATED_START) and text.rstrip().endswith(GPU_PLACEHOLDER)
    assert "![operator latency](../benchmarks/results/operator-latency.png)" in text
    assert "python -m benchmarks.run --quick" in text
    assert "kwok marked them Ready 5 s" in text


def test_runner_options() -> None:
    args = run.parse_args(["--quick", "--only", "operator"])
    assert args.quick and args.only == ["operator"]
    assert run.QUICK.fleet < run.FULL.fleet == 1000
    assert run.FULL.window_s >= 120


def test_a_rerender_replaces_only_the_generated_part_and_keeps_the_hand_written_page_around_it(tmp_path: Path) -> None:
    docs = tmp_path / "benchmarks.md"
    new = f"{GENERATED_START}\nnew\n{GPU_PLACEHOLDER}\n"
    assert run.keep_hand_written(new, docs) == f"# Benchmarks\n\n{new}"
    docs.write_text(
        f"# Benchmarks\n\n## Bandwidth\n| a |\n\n{GENERATED_START}\nold\n{GPU_PLACEHOLDER}\n## Later\n| b |\n"
    )
    assert run.keep_hand_written(new, docs) == (
        f"# Benchmarks\n\n## Bandwidth\n| a |\n\n{GENERATED_START}\nnew\n{GPU_PLACEHOLDER}\n## Later\n| b |\n")  # fmt: skip
    docs.write_text(f"old\n{GPU_PLACEHOLDER}\n### later H200 run\n| a |\n")  # a page generated down to the placeholder
    assert run.keep_hand_written(new, docs) == f"{GENERATED_START}\nnew\n{GPU_PLACEHOLDER}\n### later H200 run\n| a |\n"


def test_the_page_as_committed_has_one_generated_part_between_its_markers() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md").read_text()
    assert page.count(GENERATED_START) == 1 and page.count(GPU_PLACEHOLDER) == 1
    assert page.index(GENERATED_START) < page.index(GPU_PLACEHOLDER)
    assert "do not edit by hand" not in page.lower()


def test_groups_not_run_come_from_the_newest_results_file_by_its_start_time_not_its_mtime(tmp_path: Path) -> None:
    import os

    newer, older = tmp_path / "cpu-20261201T003932Z.json", tmp_path / "cpu-20261130T121055Z.json"
    newer.write_text(json.dumps({"groups": {"connector": {"which": "newer"}}}))
    older.write_text(json.dumps({"groups": {"connector": {"which": "older"}}}))
    os.utime(older, (newer.stat().st_mtime + 60, newer.stat().st_mtime + 60))  # as a fresh clone may leave them
    assert run.previous_groups(tmp_path, ["connector"]) == {"connector": (newer.name, {"which": "newer"})}


def test_the_replica_workload_grows_each_conversation_by_its_own_prefix_in_a_new_order_each_turn() -> None:
    from benchmarks.replica_reuse import SYSTEM_TOKENS, workload

    arrivals = list(workload(conversations=6, system_prompts=2, turns=3))
    assert len(arrivals) == 18
    orders = [[c for c, _ in arrivals[t * 6 : (t + 1) * 6]] for t in range(3)]
    assert all(sorted(o) == list(range(6)) for o in orders) and orders[0] != orders[1]
    by_conversation: dict[int, list[list[int]]] = {}
    for c, prompt in arrivals:
        by_conversation.setdefault(c, []).append(prompt)
    for c, prompts in by_conversation.items():
        assert all(later[: len(earlier)] == earlier for earlier, later in itertools.pairwise(prompts))
        assert prompts[0][:SYSTEM_TOKENS] == by_conversation[c % 2][0][:SYSTEM_TOKENS]  # the shared system prompt


def test_the_replica_workload_by_default_does_not_fit_in_one_cache_servers_l1() -> None:
    """The documented run evicts: its working set (distinct whole chunks) is larger than each L1."""
    from benchmarks.replica_reuse import build_parser, distinct_chunks, shape_of, workload
    from kvoffload.quantity import parse_bytes
    from tests.support.trtllm_executor import CHUNK

    args = build_parser().parse_args([])
    shape = shape_of(args)
    chunks = distinct_chunks((p for _, p in workload(args.conversations, args.system_prompts, args.turns)), CHUNK)
    assert chunks * shape.chunk_bytes(CHUNK) > 2 * parse_bytes(shape.l1, "l1")


def test_distinct_chunks_counts_each_prefix_once() -> None:
    from benchmarks.replica_reuse import distinct_chunks

    a, b = list(range(10)), [*range(8), 99, 100, 101, 102]
    assert distinct_chunks([a, a, b], 4) == 3  # [:4] and [:8] shared; a has no [:12] (10 tokens), b's is new


def test_the_scale_benchmark_counts_the_operators_writes_per_workload_from_the_audit_log() -> None:
    from benchmarks.operator_scale import NAMESPACE, summarize_writes
    from tests.support.audit import Write

    op, admin = "system:serviceaccount:kvoffload-system:kvoffload-operator", "kubernetes-admin"
    writes = [
        Write(admin, "create", "deployments", NAMESPACE, "w-0000", 201),
        Write(op, "patch", "deployments", NAMESPACE, "w-0000", 409),
        Write(op, "patch", "deployments", NAMESPACE, "w-0000", 200),
        Write(op, "patch", "deployments", NAMESPACE, "w-0001", 200),
        Write(op, "update", "leases", "kvoffload-system", "kvoffload-operator", 200),
        Write(
            "system:serviceaccount:kube-system:disruption-controller", "create", "pods/eviction", NAMESPACE, "p", 201
        ),
    ]
    summary = summarize_writes(writes, op, 2)
    assert summary["operator_writes_per_workload"] == 1.5 and summary["conflicts_409"] == 1
    assert summary["workloads_by_operator_writes_on_them"] == {"1": 1, "2": 1}
    assert summary["evictions"] == 1  # anyone's, in the fleet's namespace
    assert summary["operator_writes_outside_the_namespace"] == {"update leases 200": 1}
