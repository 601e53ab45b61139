"""Run kvoffload's CPU benchmarks: JSON results and PNG plots in benchmarks/results/, summary in docs/benchmarks.md.

    make bench                                  # full counts
    make bench ARGS='--quick'                   # small counts, 3-4 minutes (kwok's pod start-up dominates)
    make bench ARGS='--only operator'           # one group: connector | transfer | operator

Groups not run this time keep their numbers from the newest results file that has them (the summary
says which file). Benchmarks are never part of the test suite and assert nothing about timings.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import REPO, command_line, machine_info, versions
from benchmarks.report import (
    GENERATED_START,
    GPU_PLACEHOLDER,
    make_plots,
    parse_gpu_log,
    render_markdown,
    results_filename,
    write_results,
)

GROUPS = ("connector", "transfer", "operator")
RESULTS_DIR = REPO / "benchmarks" / "results"
DOCS_FILE = REPO / "docs" / "benchmarks.md"
GPU_LOG = REPO / "docs" / "results" / "gpu-transfer" / "earlier" / "store-load-first-table-h200.log"


@dataclass(frozen=True)
class Counts:
    """How much each group does; ``quick`` keeps the whole run to a few minutes on 2 cores."""

    connector_reps: int
    connector_warmup: int
    transfer_tokens: tuple[int, ...]
    transfer_reps: int
    transfer_shipped_max_tokens: int
    fleet: int
    latency_workloads: int
    pod_workloads: int
    window_s: float
    resync_s: int
    quiet_s: float


FULL = Counts(300, 5, (256, 1024, 4096, 16384), 5, 4096, 1000, 200, 8, 120.0, 60, 4.0)
QUICK = Counts(20, 2, (256, 1024, 4096), 2, 256, 20, 10, 1, 5.0, 5, 2.0)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=GROUPS, action="append", help="run only this group (repeatable)")
    parser.add_argument("--injection", choices=("admission", "template"), default="admission",
                        help="the operator's injection mode (admission: the chart's default)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="small counts (3-4 minutes on 2 shared cores)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR, help="where JSON results and plots go")
    parser.add_argument("--docs", type=Path, default=DOCS_FILE, help="summary file to (re)write")
    parser.add_argument("--no-docs", action="store_true", help="do not rewrite the summary")
    parser.add_argument(
        "--render-only",
        type=Path,
        metavar="RESULTS_JSON",
        help="run nothing: redraw the plots and rewrite the summary from an earlier results file",
    )
    return parser.parse_args(argv)


def run_group(name: str, counts: Counts, injection: str = "admission") -> dict[str, Any]:
    """Run one benchmark group with ``counts``."""
    if name == "connector":
        from benchmarks.connector_bench import connector_overhead

        return connector_overhead(counts.connector_reps, counts.connector_warmup)
    if name == "transfer":
        from benchmarks.connector_bench import cpu_transfer

        return cpu_transfer(list(counts.transfer_tokens), counts.transfer_reps, counts.transfer_shipped_max_tokens)
    if name == "operator":
        from benchmarks.operator_bench import operator_benchmark

        return operator_benchmark(
            counts.fleet,
            counts.latency_workloads,
            counts.pod_workloads,
            counts.window_s,
            counts.resync_s,
            counts.quiet_s,
            injection,
        )
    raise ValueError(f"unknown group {name!r}; allowed: {', '.join(GROUPS)}")


def previous_groups(out_dir: Path, missing: Sequence[str]) -> dict[str, tuple[str, dict[str, Any]]]:
    """For each group in ``missing``: (file name, group results) from the newest results file holding
    it. Newest by the UTC start time in the name: a clone gives every file the same mtime."""
    found: dict[str, tuple[str, dict[str, Any]]] = {}
    for path in sorted(out_dir.glob("cpu-*.json"), key=lambda p: p.name, reverse=True):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        for group in missing:
            if group not in found and group in (data.get("groups") or {}):
                found[group] = (path.name, data["groups"][group])
    return found


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # prometheus_client picks multiprocess mode at first import: the connector runs in that mode.
    os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", tempfile.mkdtemp(prefix="kvo-bench-metrics-"))
    os.environ.setdefault("PYTHONHASHSEED", "0")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from hack.localcluster import BIN_DIR

    if args.render_only:
        render_docs(json.loads(args.render_only.read_text()), args.out_dir, args.docs)
        return 0
    counts = QUICK if args.quick else FULL
    groups = list(dict.fromkeys(args.only or GROUPS))
    started = datetime.datetime.now(datetime.timezone.utc)
    stamp = started.strftime("%Y%m%dT%H%M%SZ")
    results: dict[str, Any] = {
        "started_utc": started.strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": command_line(),
        "quick": args.quick,
        "counts": counts.__dict__,
        "machine": machine_info(),
        "versions": versions(BIN_DIR),
        "groups": {},
        "errors": {},
        "results_file": results_filename(stamp, args.quick),
    }
    t_start = time.monotonic()
    for name in groups:
        print(f"== {name} ({'quick' if args.quick else 'full'})", flush=True)
        t0 = time.monotonic()
        try:
            results["groups"][name] = run_group(name, counts, args.injection)
            results["groups"][name]["duration_s"] = time.monotonic() - t0
        except Exception as exc:  # one broken group must not lose the others' numbers
            traceback.print_exc()
            results["errors"][name] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"== {name} done in {time.monotonic() - t0:.0f} s", flush=True)
    results["duration_s"] = time.monotonic() - t_start
    path = write_results(results, args.out_dir, results["results_file"])
    print(f"results: {path}")
    if args.no_docs:
        return 1 if results["errors"] else 0

    render_docs(results, args.out_dir, args.docs)
    return 1 if results["errors"] else 0


def keep_hand_written(rendered: str, docs: Path) -> str:
    """The page with ``rendered`` (its generated part) in place of the one there: what is written by hand
    before ``GENERATED_START`` and after ``GPU_PLACEHOLDER`` is kept (a page without the start marker
    was generated down to the placeholder). A new page gets a title."""
    if not docs.exists():
        return "# Benchmarks\n\n" + rendered
    old = docs.read_text()
    if GPU_PLACEHOLDER not in rendered or GPU_PLACEHOLDER not in old:
        return rendered
    before = old.partition(GENERATED_START)[0] if GENERATED_START in old else ""
    after = old.partition(GPU_PLACEHOLDER)[2]
    return before + rendered.partition(GPU_PLACEHOLDER)[0] + GPU_PLACEHOLDER + after


def render_docs(results: dict[str, Any], out_dir: Path, docs: Path) -> None:
    """Plots and the summary for ``results``; groups it lacks come from the newest results file holding them."""
    merged = dict(results)
    merged["groups"] = dict(results.get("groups") or {})
    earlier = previous_groups(out_dir, [g for g in GROUPS if g not in merged["groups"]])
    for group, (filename, data) in earlier.items():
        merged["groups"][group] = {**data, "from_file": filename}
    rel = os.path.relpath(out_dir, docs.parent).replace(os.sep, "/") + "/"
    plots = make_plots(merged, out_dir, rel)
    gpu = parse_gpu_log(GPU_LOG.read_text(errors="replace")) if GPU_LOG.exists() else None
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text(keep_hand_written(render_markdown(merged, plots, gpu), docs))
    print(f"summary: {docs}")


if __name__ == "__main__":
    sys.exit(main())
