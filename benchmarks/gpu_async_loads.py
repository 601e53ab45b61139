"""What a hit's load costs the other requests of the batch: synchronous vs asynchronous loads (GPU).

A stand-in engine on the GPU runs decode-only iterations for concurrent requests (matmuls and a
memory-bound pass on the engine's stream, then the host waits, as sampling does). At iteration 5 a
request arrives whose prompt LMCache holds (stored through the connector first). The connector's real
hooks serve it (``get_num_new_matched_tokens``, ``build_connector_meta``, ``start_load_kv``,
``get_finished``) against the real sidecar, in three modes, each measured in the same run:

- ``none``: no hit arrives (the baseline iteration time);
- ``sync``: the load is copied in ``start_load_kv``, before that iteration's forward;
- ``async``: ``(n, True)``: the request is parked, its load runs beside the decode iterations, and
  ``get_finished`` reports it once its KV is in the pool.

Each mode runs under both of TensorRT-LLM's executor loops (``--loops``): ``plain``
(``_executor_loop``: an iteration schedules, enqueues its forward and waits for its sampling) and
``overlap`` (``_executor_loop_overlap``, TensorRT-LLM's default: iteration k schedules and enqueues
while the GPU still runs k-1, then waits for k-1's sampling; so a hit's lookup and securing in k's
scheduling overlap k-1's forward). Both run under TensorRT-LLM's gen-0 GC threshold (20,000, its
``garbage_collection_gen0_threshold`` default; ``--gc-gen0-threshold``).

Per size, loop and mode it prints one JSON line: iteration times (mean and max over the iterations
while the load was in flight, and of the baseline), the hit's lookup and securing (each timed where
the scheduler hook calls them: ``secured_lookup_ms``, both in one server call, on a server that has
secured lookups as the sidecar's does, ``secured_lookup_server_ms`` of it in the server; else
``lookup_ms`` and ``secure_ms``), the hit's time from arrival to its KV in the pool (to being
schedulable), and whether the loaded blocks are bit-exact.

    python -m benchmarks.gpu_async_loads --tokens 4096 8192 16384 32768 --l1 24Gi
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from typing import Any

import torch

from benchmarks import gpu_transfer as gt
from benchmarks.common import scattered_block_ids
from benchmarks.gpu_hooks_check import connector_hooks

WARM_ITERATIONS = 5
AFTER_ITERATIONS = 30


GC_GEN0_THRESHOLD = 20000
"""TensorRT-LLM's default ``TorchLlmArgs.garbage_collection_gen0_threshold``: its executor loop runs
under ``customized_gc_thresholds(20000)`` (``_utils.py``, ``py_executor.py``), Python's gen-0
threshold raised from 2,000."""


@contextlib.contextmanager
def gc_gen0_threshold(threshold: int) -> Any:
    """Python's gen-0 GC threshold set to ``threshold`` (0: left alone) while the block runs."""
    before = gc.get_threshold()
    if threshold:
        gc.set_threshold(threshold)
    try:
        yield
    finally:
        gc.set_threshold(*before)


def decode_step(weights: torch.Tensor, acts: torch.Tensor, big: torch.Tensor) -> None:
    """One decode iteration of the concurrent requests: matmuls, and memory-bound passes (a decode
    step mostly reads weights from HBM, which the load's DMA also uses)."""
    for _ in range(4):
        acts.copy_(acts @ weights)
    for _ in range(3):
        big.mul_(1.0)


def _on(stream: Any) -> Any:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


@contextlib.contextmanager
def timed_calls(client: Any, names: tuple[str, ...], spent: dict[str, float]) -> Any:
    """Time ``client``'s calls ``names`` (milliseconds summed into ``spent``) while the block runs."""
    originals = {name: getattr(client, name) for name in names}

    def timing(name: str, call: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                result = call(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
            server_s = getattr(result, "server_s", None)  # a secured lookup's time in the server
            if server_s is not None:
                spent[f"{name}_server"] = spent.get(f"{name}_server", 0.0) + server_s * 1e3
            return result

        return run

    for name, call in originals.items():
        setattr(client, name, timing(name, call))
    try:
        yield
    finally:
        for name in originals:
            delattr(client, name)  # the bound methods again


def run_mode(mode: str, tokens: int, hooks: dict[str, Any], prompt: list[int], rid: int, overlap: bool = False
             ) -> dict[str, Any]:  # fmt: skip
    """Decode iterations with (or without) one hit arriving at iteration ``WARM_ITERATIONS``; with
    ``overlap`` each iteration waits for the previous iteration's forward instead of its own."""
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData, SchedulerOutput

    from tests.support.trtllm_executor import PromptRequest, StandinLlmRequest

    scheduler = hooks["sync_scheduler"] if mode == "sync" else hooks["scheduler"]
    worker, pool, engine = hooks["worker"], hooks["pool"], hooks["engine"]
    weights, acts, big = hooks["weights"], hooks["acts"], hooks["big"]
    dst = hooks["dst"]
    dst_idx = torch.tensor(dst[:-1], device=pool.device)
    pool.index_fill_(0, dst_idx, float("nan"))
    hooks["sync"]()
    times: list[float] = []
    arrived = loaded_at = None
    lookup_ms = 0.0
    spent: dict[str, float] = {}
    in_flight: list[int] = []
    request = None
    previous: Any = None  # the previous iteration's forward (overlap loop)
    sync_hit_forward: Any = None
    # Built before it arrives, as TensorRT-LLM builds an LlmRequest when it fetches the request, hit
    # or not: the stand-in's request hashes its prompt's block chains in Python (1.5 / 5.9 / 12 ms at
    # 4k / 16k / 32k tokens), no part of a hit's cost.
    arriving = StandinLlmRequest(PromptRequest(rid, prompt)) if mode != "none" else None
    for it in range(WARM_ITERATIONS + AFTER_ITERATIONS):
        t0 = time.perf_counter()
        output = SchedulerOutput()
        started_loading: list[int] = []
        if it == WARM_ITERATIONS and arriving is not None:
            arrived = t0
            request = arriving
            with timed_calls(scheduler.backend, ("lookup_and_secure", "lookup", "secure"), spent):
                matched, is_async = scheduler.get_num_new_matched_tokens(request, 0)
            lookup_ms = (time.perf_counter() - t0) * 1e3
            assert matched == tokens and is_async == (mode == "async"), (matched, is_async)
            scheduler.update_state_after_alloc(request, list(dst))
            if is_async:
                started_loading = [rid]
            else:
                output.new_requests.append(RequestData(rid, list(prompt), list(dst), 0, len(prompt) - matched))
        meta = scheduler.build_connector_meta(output)
        worker.bind_connector_meta(meta)
        with _on(engine):
            worker.start_load_kv(engine)
            decode_step(weights, acts, big)
            worker.wait_for_save(engine)
        worker._clear_connector_meta()
        forward = torch.cuda.Event() if engine is not None else None
        if forward is not None:
            forward.record(engine)
        # Sampling reads the logits (the engine's stream, not the loads'): this iteration's, or with
        # the overlap loop the previous one's, while this one's forward runs on.
        waited, previous = (previous, forward) if overlap else (forward, None)
        if waited is not None:
            waited.synchronize()
        _, done_loading = worker.get_finished([], started_loading)
        if mode == "sync" and it == WARM_ITERATIONS:
            sync_hit_forward = forward
            in_flight.append(it)
            if not overlap or forward is None:
                loaded_at = time.perf_counter()
        elif mode == "sync" and sync_hit_forward is not None and loaded_at is None:
            in_flight.append(it)  # overlap loop: the hit's forward is waited for one iteration later
            loaded_at = time.perf_counter()
        elif mode == "async" and arrived is not None and loaded_at is None:
            in_flight.append(it)
            if rid in done_loading:
                loaded_at = time.perf_counter()
        times.append((time.perf_counter() - t0) * 1e3)
    if previous is not None:
        previous.synchronize()
    deadline = time.monotonic() + 60
    while mode == "async" and loaded_at is None and time.monotonic() < deadline:  # landed after the window
        if rid in worker.get_finished([], [])[1]:
            loaded_at = time.perf_counter()
        time.sleep(0.001)
    if request is not None:
        scheduler.request_finished(request, list(dst))
    exact = mode == "none" or bool(torch.equal(pool[dst_idx].view(torch.int16), hooks["source"].view(torch.int16)))
    window = [times[i] for i in in_flight] or times[WARM_ITERATIONS:]
    return {
        "loop": "overlap" if overlap else "plain",
        "mode": mode,
        "iteration_ms_mean": round(statistics.fmean(window), 2),
        "iteration_ms_max": round(max(window), 2),
        "iterations_in_window": len(window),
        "steady_iteration_ms": round(statistics.median(times[WARM_ITERATIONS + 10 :]), 2),
        "arrival_to_loaded_ms": round((loaded_at - arrived) * 1e3, 2) if loaded_at and arrived else None,
        "lookup_and_secure_ms": round(lookup_ms, 2),
        "secured_lookup_ms": round(spent.get("lookup_and_secure", 0.0), 2),
        "secured_lookup_server_ms": round(spent.get("lookup_and_secure_server", 0.0), 2),
        "lookup_ms": round(spent.get("lookup", 0.0), 2),
        "secure_ms": round(spent.get("secure", 0.0), 2),
        "bit_exact": exact,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--l1", default="24Gi")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--loops", nargs="+", default=["plain", "overlap"], choices=["plain", "overlap"],
                        help="TensorRT-LLM's executor loops to model (overlap is its default)")  # fmt: skip
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    parser.add_argument("--gc-gen0-threshold", type=int, default=GC_GEN0_THRESHOLD,
                        help="Python's gen-0 GC threshold while the iterations run, as TensorRT-LLM's executor "
                             "loop sets it (0: Python's own)")  # fmt: skip
    args = parser.parse_args(argv)
    dev = args.device
    assert dev == "cpu" or torch.cuda.is_available(), "needs a CUDA device"
    from kvoffload import contract
    from kvoffload.connector.wire import ConnectorMetadata, TransferOp

    failures = 0
    most = max(args.tokens) // gt.TOKENS_PER_BLOCK
    env = {contract.ENV_ASYNC_SAVE: "true", contract.ENV_ASYNC_LOAD_MIN_TOKENS: "1"}  # every hit loads async
    with connector_hooks(args.l1, most, dev, env) as (_, scheduler, worker, pool, another_scheduler):
        small = dev == "cpu"
        hooks: dict[str, Any] = {
            "scheduler": scheduler, "worker": worker, "pool": pool,
            "sync_scheduler": another_scheduler({contract.ENV_ASYNC_LOAD_MIN_TOKENS: "0"}),  # never async
            "engine": torch.cuda.Stream() if dev == "cuda" else None,
            "sync": torch.cuda.synchronize if dev == "cuda" else (lambda: None),
            "weights": torch.randn(256 if small else 8192, 256 if small else 8192, device=dev, dtype=torch.bfloat16) / 90,
            "acts": torch.randn(64 if small else 2048, 256 if small else 8192, device=dev, dtype=torch.bfloat16),
            "big": torch.ones(1 << (16 if small else 30), device=dev, dtype=torch.bfloat16),
        }  # fmt: skip
        device_name = torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"
        print(json.dumps({"torch": torch.__version__, "device": device_name}), flush=True)
        for n, tokens in enumerate(args.tokens):
            nblocks = tokens // gt.TOKENS_PER_BLOCK
            src, dst = scattered_block_ids(nblocks, seed=1000 + n)
            hooks["dst"] = [*dst, 2 * most + 1]  # and a block for the prompt's last token
            src_idx = torch.tensor(src, device=dev)
            source = torch.randn((nblocks, *pool.shape[1:]), device=dev).to(pool.dtype)
            pool.index_copy_(0, src_idx, source)
            hooks["source"] = source
            prompt = [(n * 7919 + i * 31) % 30000 + 1 for i in range(tokens + 1)]
            save = TransferOp(10 + n, f"async-save-{n}", tuple(prompt[:tokens]), 0, tokens, src, 0, "")
            hooks["sync"]()
            worker.bind_connector_meta(ConnectorMetadata(saves=(save,)))
            worker.wait_for_save(torch.cuda.current_stream() if dev == "cuda" else None)
            worker._clear_connector_meta()
            deadline = time.monotonic() + 120
            while 10 + n not in worker.get_finished([10 + n], [])[0] and time.monotonic() < deadline:
                time.sleep(0.002)
            for rep in range(args.reps):
                for loop_index, loop in enumerate(args.loops):
                    for mode in ("none", "sync", "async"):
                        rid = 100_000 * (n + 1) + 100 * rep + 10 * loop_index + len(mode)
                        with gc_gen0_threshold(args.gc_gen0_threshold):
                            result = run_mode(mode, tokens, hooks, prompt, rid=rid, overlap=loop == "overlap")
                        failures += 0 if result["bit_exact"] else 1
                        print(json.dumps({"tokens": tokens, "rep": rep, **result}), flush=True)
    print(json.dumps({"failures": failures}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
