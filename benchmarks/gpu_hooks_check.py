"""The connector's TensorRT-LLM hooks on a CUDA pool, end to end through the real sidecar (a check, not a benchmark).

CI has no GPU, so the hook path with CUDA streams (the forward pass's event, the async saver on its
private stream, the backend's transfer stream) only runs here, on the lent GPU machine:

1. ``register_kv_caches`` with a Llama-3-8B-shaped bf16 pool on ``cuda:0``;
2. the "forward pass": big matmuls queued on the engine's stream, then the KV written into the
   source blocks on that same stream, so the KV lands tens of ms after ``wait_for_save`` returns;
3. ``wait_for_save(stream)`` (async save: the saver waits on the stream's event; with
   ``--sync-save`` it copies before it returns) and ``get_finished`` until the request's save is
   reported (its COMMITs answered);
4. the scheduler's ``get_num_new_matched_tokens`` for the same prompt (which secures the load: the
   server hands out and locks its chunks in the shared L1 segment), then ``start_load_kv(stream)``
   into other (scattered) blocks, which the engine's stream clears (NaN) after more busy work: the
   copies must follow that on the device (with ``--async-load`` the request is parked and the
   loader thread issues them; ``get_finished`` reports the load); checked bit-exact against the
   source blocks; ``get_finished`` then releases the chunks.

With ``--cancel-during-load`` (implies ``--async-load``) the parked request is cancelled while its load
runs and its retry reuses the blocks on the device: the next ``start_load_kv`` is told those blocks are
read (``ConnectorMetadata.reused_blocks``), and the retry's "forward" on the engine's stream reads them
right after it; what it read must be bit-exact (the load landed before it, however far the loader
thread had got).

With ``--kv-cache-manager-v2`` the pool is registered as KVCacheManagerV2 does
(``register_kv_cache_layout``), and the load goes through the scheduler's ``build_connector_meta`` with
the request honoured for half the offer (``py_num_connector_matched_tokens``, as a grow that failed
leaves it) and pages only up to one block past that: the honoured blocks must be bit-exact and the
next page untouched.

With ``--pool deepseek-v3`` the pool is DeepSeek-V3's multi-head latent attention (61 layers of a
576-wide bf16 latent, no value half: ``[blocks, 61, 1, 32 * 576]``) instead of Llama-3-8B's K/V.
Each round also copies the same blocks pool -> pinned host -> pool by hand (``raw_d2h_gbps``,
``raw_h2d_gbps``) in the same process, and reports the hooks' store and load rates over those
bytes (``--busy 0`` leaves out the "forward pass" work that the save and load otherwise wait for).

With ``--cost-guard`` each round's "forward pass" (the busy work and the KV write) is a prefill of
``--tokens`` prompt tokens as the worker sees one (``ConnectorMetadata.computed_prompt_tokens``,
``start_load_kv`` before it, ``wait_for_save`` after it), so the worker times it with CUDA events for
the cost guard: from the second round the guard's prefill rate must match the check's own
CUDA-event time of that work (within 10%; the process's first prefill is no sample, so round 0's
guard has none), and each lookup must load exactly when the guard's measured costs say loading pays
(with ``--busy 1`` the prefill is cheaper than the load, and from the second round the hit is
computed, ``slower_to_load``).

With ``--kill-before-last-load`` the cache server (the sidecar and its LMCache child) is SIGKILLed
between the last round's lookup and its load: the secured load must still arrive bit-exact.
A saver that copied before the forward pass wrote the KV would store stale blocks and fail the
check. Prints one JSON line per round and exits 1 on any mismatch or miss.

    python -m benchmarks.gpu_hooks_check --tokens 4096 --rounds 3 [--kill-before-last-load]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks import gpu_transfer as gt
from benchmarks.common import env_set, scattered_block_ids, standin_on_path


def _kill_tree(pid: int) -> None:
    """SIGKILL a process and its children (the sidecar and its LMCache server)."""
    import signal

    import psutil

    parent = psutil.Process(pid)
    for proc in [*parent.children(recursive=True), parent]:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(signal.SIGKILL)


POOLS = {
    "llama-3-8b": ("meta-llama/Llama-3.1-8B-Instruct", gt.LAYERS, 2, gt.KV_HEADS * gt.HEAD_DIM),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", 61, 1, 512 + 64),
}
"""Pool shapes: (model, layers, kv_factor, elements per token, layer and plane)."""


@contextlib.contextmanager
def connector_hooks(
    l1: str, nblocks: int, device: str, env: dict[str, str], layout: bool = False, pool_kind: str = "llama-3-8b"
) -> Iterator[tuple[subprocess.Popen[bytes], Any, Any, torch.Tensor, Callable[[dict[str, str]], Any]]]:
    """The real sidecar, and the connector's scheduler and worker over it with a Llama-3-8B-shaped
    bf16 pool of ``2 * nblocks + 8`` blocks registered: ``(sidecar, scheduler, worker, pool,
    another_scheduler)``; ``another_scheduler(env)`` is a scheduler of the same engine started with
    ``env`` laid over the first one's (closed on exit)."""
    standin_on_path()
    from kvoffload import contract
    from tests.support.trtllm_executor import connector_llm_args

    workdir = Path(tempfile.mkdtemp(prefix="kvo-hooks-"))
    sidecar, url, _ = gt.start_sidecar(l1, workdir, chunk_size=256)
    os.environ.update({
        contract.ENV_BACKEND: contract.BACKEND_SIDECAR, "PROMETHEUS_MULTIPROC_DIR": str(workdir / "metrics"), **env,
    })  # fmt: skip
    try:
        from kvoffload.connector.trtllm import KvoffloadConnectorScheduler, KvoffloadConnectorWorker

        model, layers, kv_factor, width = POOLS[pool_kind]
        llm_args = connector_llm_args(model, url, block=gt.TOKENS_PER_BLOCK)
        scheduler = KvoffloadConnectorScheduler(llm_args)
        worker = KvoffloadConnectorWorker(llm_args)
        pool = torch.zeros(
            (2 * nblocks + 8, layers, kv_factor, gt.TOKENS_PER_BLOCK * width),
            dtype=torch.bfloat16,
            device=device,
        )
        schedulers = [scheduler]

        def another_scheduler(overrides: dict[str, str]) -> Any:
            with env_set(**overrides):
                schedulers.append(KvoffloadConnectorScheduler(llm_args))
            return schedulers[-1]

        if layout:  # KVCacheManagerV2: one layer group, handed over as a layout
            from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout import describe_pool

            worker.register_kv_cache_layout(describe_pool(pool, gt.TOKENS_PER_BLOCK))
        else:
            worker.register_kv_caches(pool)
        yield sidecar, scheduler, worker, pool, another_scheduler
        worker.shutdown()
        for each in schedulers:
            each.backend.close()
    finally:
        if sidecar.poll() is None:
            sidecar.terminate()
        sidecar.wait(timeout=60)


def round_parser(description: str) -> argparse.ArgumentParser:
    """The options every hooks check takes: prompt size, rounds, the server's L1, the device, a kill."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--l1", default="16Gi")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a dry run of the script")
    parser.add_argument("--kill-before-last-load", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = round_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--sync-save", action="store_true", help="KVOFFLOAD_ASYNC_SAVE=false: wait_for_save copies")
    parser.add_argument("--async-load", action="store_true", help="loads answered (n, True): the loader thread copies")
    parser.add_argument(
        "--cancel-during-load", action="store_true", help="the parked request is cancelled; its retry reads the blocks"
    )
    parser.add_argument(
        "--kv-cache-manager-v2", action="store_true", help="layout registration; the load honoured for half the offer"
    )
    parser.add_argument("--pool", default="llama-3-8b", choices=sorted(POOLS))
    parser.add_argument("--busy", type=int, default=20, help="matmuls of the 'forward pass' before each write/clear")
    parser.add_argument(
        "--cost-guard", action="store_true", help="the forward is a timed prefill; loads follow the measured costs"
    )
    args = parser.parse_args(argv)
    args.async_load = args.async_load or args.cancel_during_load
    dev = args.device
    assert dev == "cpu" or torch.cuda.is_available(), "needs a CUDA device"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    from kvoffload import contract
    from kvoffload.connector.wire import ConnectorMetadata, TransferOp
    from tests.support.trtllm_executor import PromptRequest, StandinLlmRequest

    def scheduler_load(
        scheduler: Any, request: Any, matched: int, honoured: int, pages: list[int], parked: bool
    ) -> Any:
        """The load as the engine gets it from the scheduler: the request allocated ``pages`` (KVCacheManagerV2
        honoured ``honoured`` of ``matched``, V1 all of it), then ``build_connector_meta`` from its first
        report, or, parked, from nothing."""
        from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData, SchedulerOutput

        if honoured < matched:
            request.py_num_connector_matched_tokens = honoured  # commit_new_matched_tokens
        scheduler.update_state_after_alloc(request, pages)
        first = RequestData(request.request_id, list(request.tokens), pages, 0, len(request.tokens) - honoured)
        return scheduler.build_connector_meta(SchedulerOutput(new_requests=[] if parked else [first]))

    failures = 0
    nblocks = args.tokens // gt.TOKENS_PER_BLOCK
    env = {  # loads and saves as asked
        contract.ENV_ASYNC_SAVE: "false" if args.sync_save else "true",
        contract.ENV_ASYNC_LOAD_MIN_TOKENS: "1" if args.async_load else "0",
    }
    hooks = connector_hooks(args.l1, nblocks, dev, env, args.kv_cache_manager_v2, args.pool)
    with hooks as (sidecar, scheduler, worker, pool, _):
        engine = torch.cuda.Stream() if dev == "cuda" else None
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16) if dev == "cuda" else None
        for rnd in range(args.rounds):
            rid = 100 + rnd
            src, dst = scattered_block_ids(nblocks, seed=rnd)
            src_idx, dst_idx = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
            prompt = [(rnd * 7919 + i * 31) % 30000 + 1 for i in range(args.tokens + 1)]
            fresh = torch.randn((nblocks, *pool.shape[1:]), device=dev).to(pool.dtype)
            sync()
            if args.cost_guard:  # the forward pass below is a prefill the worker times for the guard
                worker.bind_connector_meta(ConnectorMetadata(computed_prompt_tokens=args.tokens))
                worker.start_load_kv(engine)
                worker._clear_connector_meta()
            forward = timed_on(engine) if engine is not None else None
            with torch.cuda.stream(engine) if engine is not None else contextlib.nullcontext():
                for _ in range(args.busy if a is not None else 0):  # the forward pass: busy, then it writes the KV
                    a @ a
                pool.index_copy_(0, src_idx, fresh)
            forward_ms = forward() if forward is not None else None
            save = TransferOp(rid, f"hooks-save-{rnd}", tuple(prompt[: args.tokens]), 0, args.tokens, src, 0, "")
            returned_ms, saved_ms, done = save_and_wait(worker, save, engine)
            deadline = time.monotonic() + 60
            request = StandinLlmRequest(PromptRequest(rid + 1000, prompt))
            guard = worker.load_costs
            pays = guard.load_pays(args.tokens)
            guard_rate = guard.recompute_tokens_per_s()
            t_lookup = time.perf_counter()
            matched, is_async = scheduler.get_num_new_matched_tokens(request, 0)  # lookup + secure
            lookup_ms = (time.perf_counter() - t_lookup) * 1e3
            if args.cost_guard:
                guard_forward_ms = args.tokens / guard_rate * 1e3 if guard_rate else None
                # the process's first prefill (a cold device) is no sample: round 0's guard has none
                agrees = (
                    guard_forward_ms is None
                    if rnd == 0
                    else guard_forward_ms is not None
                    and forward_ms is not None
                    and abs(guard_forward_ms - forward_ms) <= 0.1 * forward_ms
                )
                follows = matched == (args.tokens if pays else 0)
                failures += 0 if agrees and follows and rid in done else 1
                print(json.dumps({
                    "round": rnd, "tokens": args.tokens, "busy_matmuls": args.busy,
                    "forward_ms_check": round(forward_ms, 3) if forward_ms is not None else None,
                    "forward_ms_guard": round(guard_forward_ms, 3) if guard_forward_ms is not None else None,
                    "guard_agrees_within_10pct": agrees, "load_pays": pays, "matched": matched,
                    "lookup_follows_guard": follows,
                }), flush=True)  # fmt: skip
                if not matched:
                    scheduler.request_finished(request, [])
                    continue
            sync()
            with torch.cuda.stream(engine) if engine is not None else contextlib.nullcontext():
                for _ in range(
                    args.busy if a is not None else 0
                ):  # the engine's earlier work, then it clears the blocks
                    a @ a
                pool.index_fill_(0, dst_idx, float("nan"))
            killed = args.kill_before_last_load and rnd == args.rounds - 1
            if killed:
                _kill_tree(sidecar.pid)
            if args.kv_cache_manager_v2:  # half the offer honoured, pages up to one block past it
                honoured = matched // 2
                pages = dst[: honoured // gt.TOKENS_PER_BLOCK + 1]
            else:  # every block of the prompt, the last token's too
                honoured, pages = matched, [*dst, 2 * nblocks + 1]
            meta = scheduler_load(scheduler, request, matched, honoured, pages, is_async)
            (load,) = meta.async_loads if is_async else meta.loads
            worker.bind_connector_meta(ConnectorMetadata(loads=meta.loads, async_loads=meta.async_loads))
            t1 = time.perf_counter()
            worker.start_load_kv(engine)  # its copies must follow the clearing on that stream
            worker._clear_connector_meta()
            retry_exact = None
            if args.cancel_during_load:  # cancelled while parked; the retry device-reuses its blocks
                worker.bind_connector_meta(ConnectorMetadata(reused_blocks=frozenset(load.block_ids)))
                worker.start_load_kv(engine)
                worker._clear_connector_meta()
                with torch.cuda.stream(engine) if engine is not None else contextlib.nullcontext():
                    read_by_retry = pool[dst_idx].clone()  # the retry's forward reads the blocks
                sync()
                retry_exact = bool(torch.equal(read_by_retry.view(torch.int16), fresh.view(torch.int16)))
            if is_async:  # parked: get_finished reports it once its KV is in the pool
                started, loaded = [rid + 1000], []
                while rid + 1000 not in loaded and time.monotonic() < deadline + 60:
                    loaded = worker.get_finished([], started)[1]
                    started = []
                    time.sleep(0.001)
            load_ms = (time.perf_counter() - t1) * 1e3
            worker.get_finished([], [])  # rank 0 releases the loaded chunks after the iteration
            scheduler.request_finished(request, [])
            sync()
            nbytes = nblocks * pool[0].numel() * pool.element_size()
            raw_d2h, raw_h2d = raw_copy_s(pool, src_idx, dst_idx, sync)
            # blocks the load wrote; V2: the next page stays as the engine left it
            got = honoured // gt.TOKENS_PER_BLOCK
            exact = matched == args.tokens and bool(
                torch.equal(pool[dst_idx[:got]].view(torch.int16), fresh[:got].view(torch.int16))
            )
            if args.kv_cache_manager_v2:
                exact = exact and bool(torch.isnan(pool[dst_idx[got]].float()).all())
            failures += 0 if exact and rid in done and is_async == args.async_load and retry_exact is not False else 1
            print(json.dumps({
                "round": rnd, "tokens": args.tokens, "save_reported": rid in done, "matched": matched,
                "wait_for_save_returned_ms": round(returned_ms, 2), "save_done_ms": round(saved_ms, 2),
                "lookup_ms": round(lookup_ms, 2), "load_done_incl_engine_work_ms": round(load_ms, 2), "bit_exact": exact,
                "server_killed_before_load": killed, "async_save": not args.sync_save, "async_load": is_async,
                "retry_read_bit_exact": retry_exact, "honoured": honoured, "pool": args.pool,
                "pool_shape": list(pool.shape), "bytes": nbytes, "busy_matmuls": args.busy,
                "store_gbps": round(nbytes / saved_ms / 1e6, 2), "load_gbps": round(nbytes / load_ms / 1e6, 2),
                "raw_d2h_gbps": round(nbytes / raw_d2h / 1e9, 2), "raw_h2d_gbps": round(nbytes / raw_h2d / 1e9, 2),
            }), flush=True)  # fmt: skip
    print(json.dumps({"rounds": args.rounds, "failures": failures}), flush=True)
    return 1 if failures else 0


def timed_on(stream: Any) -> Callable[[], float]:
    """Start timing ``stream``'s work with CUDA events; the returned call ends it and gives the ms."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)

    def done() -> float:
        end.record(stream)
        end.synchronize()
        return float(start.elapsed_time(end))

    return done


def save_and_wait(worker: Any, save: Any, engine: Any) -> tuple[float, float, list[int]]:
    """``wait_for_save`` of one store op on the engine's stream, then ``get_finished`` until the worker
    reports its request (at most 60 s): ms until the hook returned, ms until reported, the ids reported."""
    from kvoffload.connector.wire import ConnectorMetadata

    worker.bind_connector_meta(ConnectorMetadata(saves=(save,)))
    t0 = time.perf_counter()
    worker.wait_for_save(engine)
    returned_ms = (time.perf_counter() - t0) * 1e3
    worker._clear_connector_meta()
    done: list[int] = []
    deadline = time.monotonic() + 60
    while save.request_id not in done and time.monotonic() < deadline:
        done, _ = worker.get_finished([save.request_id], [])
        time.sleep(0.001)
    return returned_ms, (time.perf_counter() - t0) * 1e3, list(done)


def raw_copy_s(
    pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, sync: Callable[[], None]
) -> tuple[float, float]:
    """Seconds to copy the ``src`` blocks to pinned host memory and that back into the ``dst`` blocks'
    place (a scratch tensor), by hand: the copy the hooks' rates compare with."""
    host = torch.empty((len(src), *pool.shape[1:]), dtype=pool.dtype, pin_memory=pool.is_cuda)
    gathered = pool[src]
    sync()
    t0 = time.perf_counter()
    host.copy_(gathered, non_blocking=True)
    sync()
    t1 = time.perf_counter()
    gathered.copy_(host, non_blocking=True)
    sync()
    return t1 - t0, time.perf_counter() - t1


if __name__ == "__main__":
    sys.exit(main())
