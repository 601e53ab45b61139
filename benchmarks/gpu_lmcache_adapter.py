"""LMCache 0.5.6's own in-process TensorRT-LLM adapter, unchanged, on the same pool shape (GPU).

``lmcache.integration.tensorrt_llm.tensorrt_adapter`` (``LMCacheKvConnectorScheduler`` /
``LMCacheKvConnectorWorker``) driven through its hooks as TensorRT-LLM would: ``register_kv_caches``
with a Llama-3-8B-shaped bf16 pool, a store through ``wait_for_save`` (its metadata as its own
``build_connector_meta`` makes it), a lookup through ``get_num_new_matched_tokens`` and a load through
``start_load_kv`` into other, scattered blocks, checked bit-exact. TensorRT-LLM's modules it imports
are the stand-in's (``tests/standin``); where ``transformers`` is missing, ``AutoConfig`` reads the
model's config.json (the only thing the adapter asks of it). The same-run baseline is the raw pinned
copy. One JSON line per size.

    python -m benchmarks.gpu_lmcache_adapter --tokens 4096 16384 --reps 3 --l1-gib 24
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from benchmarks import gpu_transfer as gt
from benchmarks.common import scattered_block_ids, standin_on_path

LLAMA_8B = {
    "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": gt.KV_HEADS, "head_dim": gt.HEAD_DIM,
    "num_hidden_layers": gt.LAYERS, "model_type": "llama",
}  # fmt: skip


def _model_dir() -> str:
    path = Path(tempfile.mkdtemp(prefix="llama8b-config-"))
    (path / "config.json").write_text(json.dumps(LLAMA_8B))
    try:
        import transformers  # noqa: F401
    except ImportError:
        auto = types.SimpleNamespace(
            from_pretrained=lambda p, **_: types.SimpleNamespace(**json.loads((Path(p) / "config.json").read_text()))
        )
        sys.modules["transformers"] = types.SimpleNamespace(AutoConfig=auto)  # type: ignore[assignment]
    return str(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--l1-gib", type=int, default=24)
    args = parser.parse_args(argv)
    assert torch.cuda.is_available(), "needs a CUDA device"
    standin_on_path()
    os.environ.update({
        "LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "True", "LMCACHE_MAX_LOCAL_CPU_SIZE": str(args.l1_gib),
        "LMCACHE_TRACK_USAGE": "false",
    })  # fmt: skip
    from lmcache.integration.tensorrt_llm import tensorrt_adapter as adapter
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData, SchedulerOutput
    from tensorrt_llm.bindings.internal.batch_manager import LlmRequest
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, TorchLlmArgs

    llm_args = TorchLlmArgs(model=_model_dir(), kv_cache_config=KvCacheConfig(tokens_per_block=gt.TOKENS_PER_BLOCK))
    scheduler = adapter.LMCacheKvConnectorScheduler(llm_args)
    worker = adapter.LMCacheKvConnectorWorker(llm_args)
    most = max(args.tokens) // gt.TOKENS_PER_BLOCK
    pool = torch.zeros(
        (2 * most + 8, gt.LAYERS, 2, gt.KV_HEADS * gt.TOKENS_PER_BLOCK * gt.HEAD_DIM),
        dtype=torch.bfloat16,
        device="cuda",
    )
    worker.register_kv_caches(pool)
    stream = torch.cuda.current_stream()
    print(json.dumps({"torch": torch.__version__, "device": torch.cuda.get_device_name(0)}), flush=True)
    failures = 0
    rid = 0
    for tokens in args.tokens:
        nblocks = tokens // gt.TOKENS_PER_BLOCK
        nbytes = tokens * gt.BYTES_PER_TOKEN
        raw = gt.raw_copy_baseline(nbytes)
        stores, loads, exact_all = [], [], True
        for rep in range(args.reps):
            rid += 1
            src, dst = scattered_block_ids(nblocks, seed=100 * rep + tokens)
            prompt = [(rid * 7919 + i * 31) % 30000 + 1 for i in range(tokens + 1)]
            source = torch.randn((nblocks, *pool.shape[1:]), device="cuda").to(pool.dtype)
            pool.index_copy_(0, torch.tensor(src, device="cuda"), source)
            torch.cuda.synchronize()
            spec = adapter._BlockSpec(tokens=prompt[:tokens], block_ids=list(src))
            worker.bind_connector_meta(adapter.LMCacheConnectorMetadata(saves={rid: spec}))
            t0 = time.perf_counter()
            worker.wait_for_save(stream)
            torch.cuda.synchronize()
            stores.append(time.perf_counter() - t0)
            worker._clear_connector_meta()
            request = LlmRequest(rid + 10_000, prompt)
            matched, _ = scheduler.get_num_new_matched_tokens(request, 0)
            dst_idx = torch.tensor(dst, device="cuda")
            pool.index_fill_(0, dst_idx, float("nan"))
            meta = scheduler.build_connector_meta(SchedulerOutput(new_requests=[
                RequestData(rid + 10_000, prompt, [*dst, 2 * most + 1], 0, len(prompt) - matched)
            ]))  # fmt: skip
            meta.saves.clear()  # time the load alone
            worker.bind_connector_meta(meta)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            worker.start_load_kv(stream)
            torch.cuda.synchronize()
            loads.append(time.perf_counter() - t1)
            worker._clear_connector_meta()
            exact = matched >= tokens and bool(torch.equal(pool[dst_idx].view(torch.int16), source.view(torch.int16)))
            exact_all = exact_all and exact
        failures += 0 if exact_all else 1
        store_s, load_s = statistics.median(stores), statistics.median(loads)
        print(json.dumps({
            "tokens": tokens, "reps": args.reps, "bytes": nbytes, "bit_exact": exact_all,
            "lmcache_adapter_store_gbps": round(nbytes / store_s / 1e9, 1), "lmcache_adapter_store_ms": round(store_s * 1e3, 2),
            "lmcache_adapter_retrieve_gbps": round(nbytes / load_s / 1e9, 1),
            "lmcache_adapter_retrieve_ms": round(load_s * 1e3, 2), "raw": raw,
        }), flush=True)  # fmt: skip
    adapter.destroy_engine()
    print(json.dumps({"failures": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
