"""The connector's hooks with a GPT-OSS-shaped VSWA cache on a CUDA device, through the real sidecar
(a check with rates, not a benchmark).

GPT-OSS-120B: 36 layers alternating a 128-token sliding window and full attention, 8 KV heads of 64,
bf16. KVCacheManagerV2 gives it two layer groups of 18 layers, each its own pages; the pool here is
two tensors, registered with ``register_kv_cache_layout`` as V2 describes them (the sliding group is
layer group 0). Each round:

1. the "forward pass" (busy matmuls, then both groups' KV written into scattered source pages on the
   engine's stream) and ``wait_for_save``: one chunk of every group's pages per 256 tokens, copied
   within the hook (saves of layer groups never run on the saver thread);
2. the scheduler's lookup (and securing) of the same prompt, the engine's stream clearing other
   pages (NaN), then the load as V2 hands it over: the full group pages for the whole offer, the
   sliding group pages only for the blocks inside the window before its end (-1 elsewhere);
3. checked: the full group's pages and the sliding group's given pages bit-exact, the sliding
   group's other pages untouched (still NaN).

With ``--kill-before-last-load`` the sidecar is SIGKILLed between the last lookup and its load (the
load is secured: it must still arrive bit-exact). Each round also copies the same bytes
pool -> pinned host -> pool by hand, for the hooks' rates to compare with.

    python -m benchmarks.gpu_hooks_vswa --tokens 4096 --rounds 3 [--kill-before-last-load]
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import gpu_transfer as gt
from benchmarks.common import scattered_block_ids, standin_on_path
from benchmarks.gpu_hooks_check import _kill_tree, raw_copy_s, round_parser, save_and_wait

MODEL, LAYERS, KV_HEADS, HEAD_DIM, WINDOW = "openai/gpt-oss-120b", 36, 8, 64, 128


def main(argv: list[str] | None = None) -> int:
    parser = round_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--busy", type=int, default=20)
    args = parser.parse_args(argv)
    dev = args.device
    assert dev == "cpu" or torch.cuda.is_available(), "needs a CUDA device"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    standin_on_path()
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData, SchedulerOutput
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout import describe_pools

    from kvoffload import contract
    from kvoffload.connector.trtllm import KvoffloadConnectorScheduler, KvoffloadConnectorWorker
    from kvoffload.connector.wire import ConnectorMetadata, TransferOp
    from tests.support.trtllm_executor import PromptRequest, StandinLlmRequest, connector_llm_args

    block = gt.TOKENS_PER_BLOCK
    nblocks = args.tokens // block
    workdir = Path(tempfile.mkdtemp(prefix="kvo-vswa-"))
    sidecar, url, _ = gt.start_sidecar(args.l1, workdir, chunk_size=256)
    os.environ.update({
        contract.ENV_BACKEND: contract.BACKEND_SIDECAR, "PROMETHEUS_MULTIPROC_DIR": str(workdir / "metrics"),
        contract.ENV_ASYNC_LOAD_MIN_TOKENS: "0",
    })  # fmt: skip
    failures = 0
    try:
        llm_args = connector_llm_args(MODEL, url, block=block, kv_cache_manager_v2=True)
        scheduler = KvoffloadConnectorScheduler(llm_args)
        worker = KvoffloadConnectorWorker(llm_args)
        shape = (2 * nblocks + 8, LAYERS // 2, 2, block * KV_HEADS * HEAD_DIM)
        sliding, full = (torch.zeros(shape, dtype=torch.bfloat16, device=dev) for _ in range(2))
        layers = (tuple(range(0, LAYERS, 2)), tuple(range(1, LAYERS, 2)))
        worker.register_kv_cache_layout(describe_pools([(sliding, layers[0], WINDOW), (full, layers[1], None)], block))
        engine = torch.cuda.Stream() if dev == "cuda" else None
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) if dev == "cuda" else None
        for rnd in range(args.rounds):
            rid = 100 + rnd
            src, dst = scattered_block_ids(nblocks, seed=rnd)
            src_s, _ = scattered_block_ids(nblocks, seed=1000 + rnd)
            prompt = [(rnd * 7919 + i * 31) % 30000 + 1 for i in range(args.tokens + 1)]
            fresh = [torch.randn((nblocks, *shape[1:]), device=dev).to(torch.bfloat16) for _ in range(2)]
            sync()
            with torch.cuda.stream(engine) if engine is not None else contextlib.nullcontext():
                for _ in range(args.busy if a is not None else 0):
                    a @ a
                full.index_copy_(0, torch.tensor(src, device=dev), fresh[1])
                sliding.index_copy_(0, torch.tensor(src_s, device=dev), fresh[0])
            save = TransferOp(rid, f"vswa-save-{rnd}", tuple(prompt[: args.tokens]), 0, args.tokens, src, 0, "",
                              group_block_ids=(src_s,))  # fmt: skip
            saved_ms, _reported_ms, done = save_and_wait(worker, save, engine)
            request = StandinLlmRequest(PromptRequest(rid + 1000, prompt))
            t_lookup = time.perf_counter()
            matched, _is_async = scheduler.get_num_new_matched_tokens(request, 0)
            lookup_ms = (time.perf_counter() - t_lookup) * 1e3
            live = max(0, (matched + 1 - WINDOW) // block)  # V2: sliding pages only inside the window
            dst_s = [-1 if o < live else page for o, page in enumerate(dst)]
            with torch.cuda.stream(engine) if engine is not None else contextlib.nullcontext():
                for _ in range(args.busy if a is not None else 0):
                    a @ a
                full.index_fill_(0, torch.tensor(dst, device=dev), float("nan"))
                sliding.index_fill_(0, torch.tensor(dst, device=dev), float("nan"))
            killed = args.kill_before_last_load and rnd == args.rounds - 1
            if killed:
                _kill_tree(sidecar.pid)
            extra = [2 * nblocks + 1]  # the block of the last prompt token, computed by the engine
            by_group = [dst_s + extra, list(dst) + extra]
            scheduler.update_state_after_alloc_by_layer_group(request, by_group)
            first = RequestData(request.request_id, list(request.tokens), [], 0, len(request.tokens) - matched,
                                new_block_ids_by_layer_group=by_group)  # fmt: skip
            meta = scheduler.build_connector_meta(SchedulerOutput(new_requests=[first]))
            worker.bind_connector_meta(ConnectorMetadata(loads=meta.loads))
            t1 = time.perf_counter()
            worker.start_load_kv(engine)
            sync()
            load_ms = (time.perf_counter() - t1) * 1e3
            worker._clear_connector_meta()
            worker.get_finished([], [])
            scheduler.request_finished_by_layer_group(request, by_group)
            n = matched // block
            d = torch.tensor(dst[:n], device=dev)
            given = [o for o in range(n) if dst_s[o] >= 0]
            exact = (
                matched == args.tokens
                and bool(torch.equal(full[d].view(torch.int16), fresh[1][:n].view(torch.int16)))
                and bool(torch.equal(sliding[d[given]].view(torch.int16), fresh[0][given].view(torch.int16)))
                and bool(torch.isnan(sliding[d[:live]].float()).all())
            )
            failures += 0 if exact and rid in done else 1
            page = full[0].numel() * full.element_size()
            stored, loaded = 2 * nblocks * page, (nblocks + len(given)) * page
            idx = torch.tensor(src, device=dev)
            raw = raw_copy_s(full, idx, idx, sync)
            print(json.dumps({
                "round": rnd, "tokens": args.tokens, "matched": matched, "bit_exact": exact,
                "server_killed_before_load": killed, "save_reported": rid in done, "lookup_ms": round(lookup_ms, 2),
                "save_ms": round(saved_ms, 2), "load_ms": round(load_ms, 2), "sliding_pages_loaded": len(given),
                "bytes_stored": stored, "bytes_loaded": loaded,
                "store_gbps": round(stored / saved_ms / 1e6, 2), "load_gbps": round(loaded / load_ms / 1e6, 2),
                "raw_d2h_gbps": round(nblocks * page / raw[0] / 1e9, 2),
                "raw_h2d_gbps": round(nblocks * page / raw[1] / 1e9, 2), "pool": "gpt-oss-120b",
            }), flush=True)  # fmt: skip
        worker.shutdown()
        scheduler.backend.close()
    finally:
        if sidecar.poll() is None:
            sidecar.terminate()
        sidecar.wait(timeout=60)
    print(json.dumps({"rounds": args.rounds, "failures": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
