"""Recompute vs load: prefill time of a Llama-3-8B-shaped model against retrieving its KV.

A cache hit replaces the prefill of the cached prefix by a retrieve of its KV. This measures
both on one GPU in one run, for the same contexts:

* prefill: a random-weight ``LlamaForCausalLM`` built from a Llama-3-8B config with
  transformers (nothing downloaded; bf16, SDPA attention), one forward pass over N tokens
  that fills the KV cache (the last position's logits only, as an engine computes them);
* load: the connector's retrieve of the same N tokens of KV (Llama-3-8B: 128 KiB per token)
  from the real sidecar's shared-memory L1 into a TensorRT-LLM-shaped pool
  (``benchmarks.gpu_transfer``), bit-exact checked.

The ratio is the speedup in obtaining the prefix's KV, the upper bound of the
time-to-first-token gain (a hit still computes the uncached tail and the first decode step).

    python -m benchmarks.recompute_vs_load --tokens 4096 16384 32768 --out results.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_transfer as gt

LLAMA3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": gt.LAYERS,
    "num_attention_heads": 32,
    "num_key_value_heads": gt.KV_HEADS,
    "head_dim": gt.HEAD_DIM,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
}


def build_model(device: str, layers: int) -> Any:
    """Random-weight Llama-3-8B-shaped model on ``device`` (bf16 on CUDA)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**LLAMA3_8B, "num_hidden_layers": layers}, attn_implementation="sdpa")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval()


def prefill_seconds(model: Any, tokens: int, reps: int, device: str) -> list[float]:
    """Wall time of a prefill forward pass over ``tokens`` random tokens (after one warm-up)."""
    times = []
    for rep in range(reps + 1):
        ids = torch.randint(1, LLAMA3_8B["vocab_size"], (1, tokens), device=device)
        gt.sync()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        gt.sync()
        if rep:
            times.append(time.perf_counter() - t0)
        del out
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--l1", default="48Gi")
    parser.add_argument("--layers", type=int, default=gt.LAYERS, help="fewer for a CPU dry run")
    parser.add_argument("--out", default="-")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    args = parser.parse_args(argv)
    gt.DEVICE = args.device
    assert args.device == "cpu" or torch.cuda.is_available(), "needs a CUDA device"
    import lmcache
    import transformers

    env = {
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lmcache": getattr(lmcache, "__version__", "0.5.6"),
        "python": platform.python_version(),
        "command": " ".join([sys.executable, "-m", "benchmarks.recompute_vs_load", *(argv or sys.argv[1:])]),
    }
    print(json.dumps(env), flush=True)
    results: dict[str, Any] = {"env": env, "rows": []}

    model = build_model(args.device, args.layers)
    prefill = {n: prefill_seconds(model, n, args.reps, args.device) for n in args.tokens}
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()

    workdir = Path(tempfile.mkdtemp(prefix="kvo-recompute-"))
    sidecar, url, _ = gt.start_sidecar(args.l1, workdir)
    try:
        max_tokens = max(args.tokens)
        pool = torch.empty(
            (2 * max_tokens // gt.TOKENS_PER_BLOCK + 8, gt.LAYERS, 2, gt.KV_HEADS * gt.TOKENS_PER_BLOCK * gt.HEAD_DIM),
            dtype=torch.bfloat16,
            device=args.device,
        )
        scheduler = gt.make_backend(url, None, fast=True, workdir=workdir, role="scheduler")
        backend = gt.make_backend(url, pool, fast=True, workdir=workdir)
        for tokens in args.tokens:
            load = gt.measure(backend, scheduler, pool, tokens, args.reps, salt="recompute")
            prefill_ms = statistics.median(prefill[tokens]) * 1e3
            row = {
                "tokens": tokens,
                "kv_bytes": tokens * gt.BYTES_PER_TOKEN,
                "prefill_ms": prefill_ms,
                "prefill_samples_ms": [t * 1e3 for t in prefill[tokens]],
                "retrieve_ms": load["retrieve_ms"],
                "retrieve_gbps": load["retrieve_gbps"],
                "bit_exact": load["bit_exact"],
                "speedup": prefill_ms / load["retrieve_ms"],
            }
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
        backend.close()
        scheduler.close()
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=60)
    print("\n| tokens | KV bytes | prefill (recompute) | retrieve (load) | speedup | bit-exact |")
    print("|---|---|---|---|---|---|")
    for row in results["rows"]:
        print(
            f"| {row['tokens']} | {row['kv_bytes'] / 2**20:.0f} MiB | {row['prefill_ms']:.1f} ms "
            f"| {row['retrieve_ms']:.1f} ms ({row['retrieve_gbps']:.1f} GB/s) | {row['speedup']:.1f}x | {row['bit_exact']} |"
        )
    gt.write_json(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
