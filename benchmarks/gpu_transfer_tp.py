"""Tensor parallelism: per-rank store/retrieve GB/s through one sidecar, all ranks at once.

With ``tensor_parallel_size=N`` every TensorRT-LLM rank holds ``KV heads / N`` of each block and
runs its own connector worker against the pod's one sidecar. This starts that sidecar and one
process per GPU (rank r on ``cuda:r``), each with a Llama-3-8B-shaped pool of its share of the
heads (32 layers, 8/N KV heads, head_dim 128, bf16, 32 tokens/block), and for each size has all
ranks store at once, rank 0's scheduler look up (the hit needs every rank's chunks), and all
ranks retrieve at once into other blocks, checked bit-exact. Baseline, same run: each rank's raw
pinned copy of the same bytes, all ranks at once.

    python -m benchmarks.gpu_transfer_tp --world-size 2 --tokens 4096 16384 32768
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_transfer as gt


def _rank_main(rank: int, args: argparse.Namespace, url: str, workdir: str, barrier: Any, out: Any) -> None:
    gt.DEVICE = args.device  # "cuda" is this rank's GPU after set_device
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    from kvoffload.connector.runtime import engine_process
    from kvoffload.connector.wire import TransferOp

    heads = gt.KV_HEADS // args.world_size
    bytes_per_token = gt.BYTES_PER_TOKEN // args.world_size
    max_tokens = max(args.tokens)
    pool = torch.empty(
        (2 * max_tokens // gt.TOKENS_PER_BLOCK + 8, gt.LAYERS, 2, heads * gt.TOKENS_PER_BLOCK * gt.HEAD_DIM),
        dtype=torch.bfloat16,
        device=gt.DEVICE,
    )
    wd = Path(workdir)
    backend = gt.make_backend(url, pool, fast=True, workdir=wd, world_size=args.world_size, rank=rank)
    scheduler = None
    if rank == 0:
        scheduler = gt.make_backend(url, None, fast=True, workdir=wd, role="scheduler", world_size=args.world_size)
    for tokens in args.tokens:
        nbytes = tokens * bytes_per_token
        barrier.wait()
        raw = gt.raw_copy_baseline(nbytes)
        nblocks = tokens // gt.TOKENS_PER_BLOCK
        stores, retrieves, exact, hits = [], [], True, []
        for rep in range(args.reps + 1):
            src, dst = gt.request_block_ids(nblocks, args.block_order, seed=1000 * rep + tokens + rank)
            src_idx, dst_idx = torch.tensor(src, device=gt.DEVICE), torch.tensor(dst, device=gt.DEVICE)
            gen = torch.Generator().manual_seed(1000 * rep + tokens)  # same tokens on every rank
            token_ids = tuple(int(t) for t in torch.randint(1, 120000, (tokens,), generator=gen))
            pool[: 2 * nblocks].copy_(torch.randn(pool[: 2 * nblocks].shape, device=gt.DEVICE).to(pool.dtype))
            pool.index_fill_(0, dst_idx, float("nan"))
            gt.sync()
            barrier.wait()
            t0 = time.perf_counter()
            backend.copies.store(TransferOp(0, f"s{rep}-{tokens}", token_ids, 0, tokens, src, 0, "tp"))
            gt.sync()
            t_store = time.perf_counter() - t0
            # COMMITs are sent by each rank's committer thread after the copy; rank 0's lookup waits
            # only for its own process's, so every rank waits for its own before the barrier.
            if not engine_process().pending.wait_idle(60.0):
                raise RuntimeError(f"rank {rank}: store COMMIT not answered within 60 s")
            barrier.wait()  # every rank's chunks are in before the lookup
            if scheduler is not None:
                hits.append(scheduler.lookup(f"r{rep}-{tokens}", token_ids, tokens, "tp"))
            barrier.wait()
            t0 = time.perf_counter()
            backend.copies.retrieve(TransferOp(0, f"r{rep}-{tokens}", token_ids, 0, tokens, dst, 0, "tp"))
            gt.sync()
            t_retrieve = time.perf_counter() - t0
            exact &= bool(torch.equal(pool[src_idx].view(torch.int16), pool[dst_idx].view(torch.int16)))
            if scheduler is not None:
                scheduler.end_session(f"r{rep}-{tokens}")
            if rep:
                stores.append(t_store)
                retrieves.append(t_retrieve)
        store_s, retrieve_s = statistics.median(stores), statistics.median(retrieves)
        out.put({
            "rank": rank, "tokens": tokens, "bytes": nbytes, "raw": raw,
            "store_gbps": nbytes / store_s / 1e9, "store_ms": store_s * 1e3,
            "retrieve_gbps": nbytes / retrieve_s / 1e9, "retrieve_ms": retrieve_s * 1e3,
            "bit_exact": exact, "all_hit": all(h == tokens for h in hits) if hits else None,
        })  # fmt: skip
    backend.close()
    if scheduler is not None:
        scheduler.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--l1", default="48Gi")
    parser.add_argument("--block-order", default="scattered", choices=["scattered", "contiguous"])
    parser.add_argument("--out", default="-")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        assert torch.cuda.device_count() >= args.world_size, f"needs {args.world_size} GPUs"
    import lmcache

    env = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(args.world_size)] if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "lmcache": getattr(lmcache, "__version__", "0.5.6"),
        "python": platform.python_version(),
        "command": " ".join([sys.executable, "-m", "benchmarks.gpu_transfer_tp", *(argv or sys.argv[1:])]),
    }
    print(json.dumps(env), flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvo-gpubench-tp-"))
    sidecar, url, _ = gt.start_sidecar(args.l1, workdir)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(args.world_size), ctx.Queue()
    rows: list[dict[str, Any]] = []
    try:
        procs = [ctx.Process(target=_rank_main, args=(r, args, url, str(workdir), barrier, out))
                 for r in range(args.world_size)]  # fmt: skip
        for p in procs:
            p.start()
        expected = args.world_size * len(args.tokens)
        while len(rows) < expected:
            if not any(p.is_alive() for p in procs) and out.empty():
                raise RuntimeError(f"a rank exited early: {[p.exitcode for p in procs]}")
            try:
                rows.append(out.get(timeout=5))
                print(json.dumps(rows[-1]), flush=True)
            except Exception:  # queue.Empty: keep waiting while ranks run
                continue
        for p in procs:
            p.join(timeout=120)
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=60)
    print("\n| rank | tokens | bytes per rank | raw H2D / D2H | store | retrieve | bit-exact | lookup hit |")
    print("|---|---|---|---|---|---|---|---|")
    for row in sorted(rows, key=lambda r: (r["tokens"], r["rank"])):
        raw = row["raw"]
        print(
            f"| {row['rank']} | {row['tokens']} | {row['bytes'] / 2**20:.0f} MiB "
            f"| {raw['h2d_gbps']:.1f} / {raw['d2h_gbps']:.1f} GB/s | {row['store_gbps']:.1f} GB/s ({row['store_ms']:.0f} ms) "
            f"| {row['retrieve_gbps']:.1f} GB/s ({row['retrieve_ms']:.0f} ms) | {row['bit_exact']} | {row['all_hit']} |"
        )
    gt.write_json({"env": env, "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
