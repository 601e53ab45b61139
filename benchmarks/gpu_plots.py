"""PNG plots of the GPU runs kept in ``docs/results/`` (the device machine returns JSON, plots are drawn here).

python -m benchmarks.gpu_plots            # writes benchmarks/results/gpu-*.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import REPO

RESULTS = REPO / "docs" / "results"
OUT = REPO / "benchmarks" / "results"


def transfer_series(runs: dict[str, dict[str, Any]]) -> dict[str, list[tuple[int, float, float]]]:
    """``{label: [(tokens, store GB/s, retrieve GB/s)]}`` from gpu_transfer result files, plus the raw ceiling."""
    series: dict[str, list[tuple[int, float, float]]] = {}
    for run_label, run in runs.items():
        for row in run.get("sizes", []):
            order = f", {row['block_order']} ids" if "block_order" in row else ""
            label = f"{row.get('backend', 'sidecar')}, chunk {row.get('chunk_size', 256)}{order}, {run_label}"
            k = row["kvoffload"]
            series.setdefault(label, []).append((row["tokens"], k["store_gbps"], k["retrieve_gbps"]))
            raw = row["raw"]
            series.setdefault("raw pinned copy (ceiling)", []).append((row["tokens"], raw["d2h_gbps"], raw["h2d_gbps"]))
    ceiling = {t: (s, r) for t, s, r in series.get("raw pinned copy (ceiling)", [])}  # one point per size
    series["raw pinned copy (ceiling)"] = sorted((t, s, r) for t, (s, r) in ceiling.items())
    return {label: sorted(points) for label, points in series.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for name, label in (("gpu-transfer/earlier/store-load-deferred-commit.json", "permuting copies"),
                        ("gpu-transfer/store-load-by-chunk-size-and-block-order-h200.json", "block-native, own stream")):  # fmt: skip
        path = args.results / name
        if path.exists():
            runs[label] = json.loads(path.read_text())
    args.out.mkdir(parents=True, exist_ok=True)
    if runs:
        series = transfer_series(runs)
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
        for ax, index, op in ((axes[0], 1, "store (GPU -> L1)"), (axes[1], 2, "retrieve (L1 -> GPU)")):
            for label, points in series.items():
                style = "k--" if label.startswith("raw") else "o-"
                ax.plot([p[0] for p in points], [p[index] for p in points], style, label=label)
                if label.startswith("raw"):
                    ax.plot([p[0] for p in points], [0.8 * p[index] for p in points], "k:", label="80% of the ceiling")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens per operation (128 KiB each)")
            ax.set_title(op)
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("GB/s")
        axes[1].legend(fontsize=7)
        env = next(iter(runs.values()))["env"]
        fig.suptitle(f"KV transfer through the sidecar, {env['gpu']}, torch {env['torch']}, lmcache {env['lmcache']}")
        fig.tight_layout()
        fig.savefig(args.out / "gpu-transfer.png", dpi=110)
        plt.close(fig)
        print(args.out / "gpu-transfer.png")
    recompute = args.results / "recompute-vs-load" / "earlier" / "recompute-vs-load-before-async-loads.json"
    if recompute.exists():
        data = json.loads(recompute.read_text())
        rows = data["rows"]
        fig, ax = plt.subplots(figsize=(7, 4))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["prefill_ms"] for r in rows], 0.4, label="prefill (recompute)")
        ax.bar([x + 0.2 for x in xs], [r["retrieve_ms"] for r in rows], 0.4, label="retrieve (load)")
        for x, r in zip(xs, rows, strict=True):
            ax.annotate(f"{r['speedup']:.1f}x", (x, r["prefill_ms"]), ha="center", va="bottom")
        ax.set_xticks(list(xs), [f"{r['tokens']} tokens" for r in rows])
        ax.set_ylabel("ms")
        ax.set_title(f"Llama-3-8B-shaped: recompute vs load, {data['env']['gpu']}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out / "gpu-recompute-vs-load.png", dpi=110)
        plt.close(fig)
        print(args.out / "gpu-recompute-vs-load.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
