"""A synchronous hit's time to first token with layer-wise loads, against whole copies (GPU).

One process, the real sidecar, the connector's scheduler and worker over a Llama-3-8B-shaped bf16
pool on ``cuda:0`` (``gpu_hooks_check.connector_hooks``). Each round stores a prompt, then loads it as
a synchronous hit into other blocks (cleared to NaN first) and runs a "forward pass" as TensorRT-LLM
does: ``start_load_kv``, then per layer ``wait_for_layer_load(i)``, that layer's work (matmuls sized
by ``--layer-ms``) which also reads layer ``i`` of the loaded blocks into a checksum, ``wait_for_save``.
The TTFT is from ``start_load_kv`` to the forward's end on the device. Measured in the same run, for
the same prompt and blocks:

- ``layerwise``: ``KVOFFLOAD_LAYERWISE_LOADS=true`` (the engine's hooks seen for every layer first);
- ``whole``: ``KVOFFLOAD_LAYERWISE_LOADS=false`` (the copy waited for in ``start_load_kv``);
- baselines: the load alone (``start_load_kv`` with no forward work) and the forward alone (no load).

Goal (issue 44): layer-wise TTFT within 10% of max(copy, forward); whole copies take their sum. Every
layer's checksum must equal the stored data's (a layer that read before its KV landed reads NaN).
Prints one JSON line per round and mode; exits 1 on a wrong checksum or a miss.

    python -m benchmarks.gpu_layerwise_loads --tokens 16384 --rounds 3 --layer-ms 2.5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import torch

from benchmarks import gpu_transfer as gt
from benchmarks.common import scattered_block_ids
from benchmarks.gpu_hooks_check import connector_hooks, save_and_wait


def _layer_work(size: int, ms: float) -> tuple[torch.Tensor, int]:
    """A matrix and how many of its products take about ``ms`` on the device."""
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):  # warm up first: a cold device times the products slow, and too few are run
        a @ a
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        a @ a
    end.record()
    end.synchronize()
    per = start.elapsed_time(end) / 20
    return a, max(1, round(ms / per)) if ms > 0 else 0


def forward(worker: Any, pool: torch.Tensor, dst: torch.Tensor, a: torch.Tensor, reps: int, sums: torch.Tensor) -> None:
    """TensorRT-LLM's hook order around per-layer work (``reps`` products) that reads each layer's KV
    of ``dst`` into ``sums`` (as ``expected`` is summed: bit-equal when the KV landed first)."""
    stream = torch.cuda.current_stream()
    for layer in range(pool.shape[1]):
        worker.wait_for_layer_load(layer, stream)
        for _ in range(reps):
            a @ a
        sums[layer] = pool[dst, layer].float().sum()
        worker.save_kv_layer(layer, stream)
    worker.wait_for_save(stream)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--layer-ms", type=float, default=2.5, help="device work per layer of the forward")
    parser.add_argument("--l1", default="24Gi")
    parser.add_argument("--scattered", action="store_true", help="shuffled block ids (default: consecutive)")
    parser.add_argument("--max-copy-calls", type=int, default=None,
                        help="copy calls one layer-wise load may issue (default: the connector's MAX_COPY_CALLS)")  # fmt: skip
    args = parser.parse_args(argv)
    from kvoffload import contract
    from kvoffload.connector.backends import layer_copies

    if args.max_copy_calls is not None:
        layer_copies.MAX_COPY_CALLS = args.max_copy_calls
    from kvoffload.connector.wire import ConnectorMetadata, TransferOp
    from tests.support.trtllm_executor import PromptRequest, StandinLlmRequest

    nblocks = args.tokens // gt.TOKENS_PER_BLOCK
    failures = 0
    a, reps = _layer_work(4096, args.layer_ms)  # one calibration: both modes run the same forward work
    for mode in ("layerwise", "whole"):
        env = {contract.ENV_LAYERWISE_LOADS: "true" if mode == "layerwise" else "false",
               contract.ENV_LOAD_COST_GUARD: "false", contract.ENV_ASYNC_LOAD_MIN_TOKENS: "0"}  # fmt: skip
        with connector_hooks(args.l1, nblocks, "cuda", env) as (_sidecar, scheduler, worker, pool, _):
            sums = torch.zeros(pool.shape[1], device="cuda")
            engine = torch.cuda.current_stream()
            for rnd in range(args.rounds):
                if args.scattered:
                    src_ids, dst_ids = scattered_block_ids(nblocks, seed=rnd)
                else:
                    src_ids, dst_ids = tuple(range(nblocks)), tuple(range(nblocks, 2 * nblocks))
                src, dst = torch.tensor(src_ids, device="cuda"), torch.tensor(dst_ids, device="cuda")
                prompt = [(rnd * 7919 + i * 31 + (mode == "whole") * 13) % 30000 + 1 for i in range(args.tokens + 1)]
                fresh = torch.randn((nblocks, *pool.shape[1:]), device="cuda").to(pool.dtype)
                pool.index_copy_(0, src, fresh)
                rid = 100 + rnd
                save = TransferOp(
                    rid, f"lw-save-{mode}-{rnd}", tuple(prompt[: args.tokens]), 0, args.tokens, src_ids, 0, ""
                )
                save_and_wait(worker, save, engine)
                expected = torch.stack([fresh[:, layer].float().sum() for layer in range(pool.shape[1])])
                # forward alone (and the hooks seen for every layer), then the load alone, then both
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                worker.start_load_kv(engine)
                forward(worker, pool, dst, a, reps, sums)
                torch.cuda.synchronize()
                forward_ms = (time.perf_counter() - t0) * 1e3
                timings = {}
                for kind in ("load", "ttft"):
                    pool.index_fill_(0, dst, float("nan"))
                    request = StandinLlmRequest(PromptRequest(rid + 1000 * (1 + (kind == "ttft")), prompt))
                    matched, is_async = scheduler.get_num_new_matched_tokens(request, 0)
                    if matched != args.tokens or is_async:
                        failures += 1
                        print(json.dumps({"mode": mode, "round": rnd, "miss": matched, "async": is_async}), flush=True)
                        break
                    scheduler.update_state_after_alloc(request, [*dst_ids, 2 * nblocks + 1])
                    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import (
                        RequestData,
                        SchedulerOutput,
                    )

                    first = RequestData(request.request_id, list(request.tokens), [*dst_ids, 2 * nblocks + 1], 0, 1)
                    meta = scheduler.build_connector_meta(SchedulerOutput(new_requests=[first]))
                    worker.bind_connector_meta(ConnectorMetadata(loads=meta.loads))
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    worker.start_load_kv(engine)
                    forward(worker, pool, dst, a, reps if kind == "ttft" else 0, sums)  # "load": no work
                    torch.cuda.synchronize()
                    timings[kind] = (time.perf_counter() - t0) * 1e3
                    worker._clear_connector_meta()
                    worker.get_finished([], [])
                    scheduler.request_finished(request, [])
                    exact = bool(torch.equal(sums, expected))
                    failures += 0 if exact else 1
                    timings[f"{kind}_exact"] = exact
                if "ttft" not in timings:
                    continue
                bound = max(timings["load"], forward_ms)
                print(json.dumps({
                    "mode": mode, "round": rnd, "tokens": args.tokens, "scattered": args.scattered,
                    "max_copy_calls": layer_copies.MAX_COPY_CALLS,
                    "layers": int(pool.shape[1]), "layer_ms": args.layer_ms, "forward_ms": round(forward_ms, 2),
                    "load_ms": round(timings["load"], 2), "ttft_ms": round(timings["ttft"], 2),
                    "ttft_over_max": round(timings["ttft"] / bound, 3),
                    "ttft_over_sum": round(timings["ttft"] / (timings["load"] + forward_ms), 3),
                    "load_exact": timings["load_exact"], "ttft_exact": timings["ttft_exact"],
                }), flush=True)  # fmt: skip
    print(json.dumps({"failures": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
