"""Reuse across replicas: where prompt tokens come from with 4 replicas, by cache setup and routing.

Four stand-in TensorRT-LLM replicas (``tests/support/trtllm_executor``), each with a real LMCache
server started from the sidecar's own command line, serve one multi-turn workload: conversations
that share a few system prompts, each turn the previous prompt plus a reply and a new question,
conversations interleaved. Between requests other traffic takes the device's reusable blocks
(``evict_device_cache``), as under load, so reuse comes from kvoffload's cache or not at all.
Setups, same workload, same run:

* ``round_robin_l1``: round-robin, each replica its own cache server (L1 only);
* ``round_robin_redis_l2``: round-robin, the four servers share one Redis L2 (``redis-server``);
* ``node_mode``: round-robin, the four replicas share one cache server (a node's cache pod);
* ``routed_by_indexer``: each request goes to the replica Dynamo's indexer (subscribed to the four
  servers' KV events) ranks first for its tokens (host tier); ties and misses go round-robin. Own
  caches, L1 only. Overlap alone: requests run one at a time, so there is no load to weigh (a real
  router trades overlap against load; ``requests_per_replica`` shows the spread).

Each cache server's L1 is ``--l1`` (default the policy's floor, 64 MiB), and the stand-in model's KV
(``--layers``, ``--kv-heads``, ``--head-dim``; float16) is sized so that the workload's distinct
whole chunks (its working set) do not fit in it: LMCache evicts (LRU), as a cache under real
traffic does, and what a setup loses to eviction shows in its counts. The results say the working
set's and the L1's bytes.

Counts prompt tokens by source from the connector's ``kvoffload_connector_prompt_tokens_total``
(``device``, ``cache``, ``computed``), summed over the replicas, and checks them against what the
stand-in engine did. Times every lookup that found chunks (LOOKUP: the server also prefetches them
from an L2 tier into L1, and the connector waits for that) and every load as the connector times it
for its cost guard (the engine's ``LoadCosts``): securing (PREPARE_RETRIEVE: the server hands out and
locks the chunks' L1 slots) and the copy into the pool. Asserts nothing about the numbers
(benchmarks are not tests).

    python -m benchmarks.replica_reuse [--conversations 16] [--system-prompts 2] [--turns 4] [--l1 64Mi]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import env_set, machine_info, percentile, versions

REPLICAS = 4
SETUPS = ("round_robin_l1", "round_robin_redis_l2", "node_mode", "routed_by_indexer")
SYSTEM_TOKENS = 4 * 64 + 20
"""Four whole 64-token chunks of system prompt, and a tail (each conversation's first turn adds more)."""
QUESTION_TOKENS = 70
REPLY_TOKENS = 8
KV_BYTES_PER_VALUE = 2  # float16, the stand-in's default KV dtype


@dataclass(frozen=True)
class CacheShape:
    """The stand-in model's KV geometry and each cache server's L1."""

    layers: int
    kv_heads: int
    head_dim: int
    l1: str

    def chunk_bytes(self, chunk_tokens: int) -> int:
        """One chunk's KV bytes: keys and values of every layer."""
        return chunk_tokens * self.layers * 2 * self.kv_heads * self.head_dim * KV_BYTES_PER_VALUE


def distinct_chunks(prompts: Iterable[list[int]], chunk_tokens: int) -> int:
    """Whole chunks the prompts store, each prefix once (a chunk's key covers every token before it)."""
    seen: set[tuple[int, ...]] = set()
    for prompt in prompts:
        for end in range(chunk_tokens, len(prompt) + 1, chunk_tokens):
            seen.add(tuple(prompt[:end]))
    return len(seen)


def workload(conversations: int, system_prompts: int, turns: int) -> Iterator[tuple[int, list[int]]]:
    """(conversation, prompt) in arrival order: turn by turn, the conversations in a shuffled order
    each turn (seeded: the same in every setup; a fixed order would make round-robin send each
    conversation to the same replica every turn); a turn's prompt is the previous one plus its
    reply (made up here, not the engine's) and a question."""
    from tests.support.trtllm_executor import make_prompt

    arrivals = random.Random(35)
    systems = [make_prompt(10 + s, SYSTEM_TOKENS) for s in range(system_prompts)]
    prompts = [systems[c % system_prompts] + make_prompt(1000 + c, QUESTION_TOKENS) for c in range(conversations)]
    for turn in range(turns):
        for c in arrivals.sample(range(conversations), conversations):
            yield c, prompts[c]
            reply, question = make_prompt(50_000 + 100 * c + turn, REPLY_TOKENS), make_prompt(90_000 + 100 * c + turn,
                                                                                               QUESTION_TOKENS)  # fmt: skip
            prompts[c] = prompts[c] + reply + question


def connector_counts(executor: Any) -> tuple[Counter[str], int]:
    """The connector's ``kvoffload_connector_prompt_tokens_total`` by source, and its stored tokens
    (``kvoffload_connector_store_tokens_total``), for this executor's model (replicas of one model in
    one process share the counters: the fleet's totals)."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvoffload import contract

    metrics = executor.scheduler.metrics
    metrics.flush()
    found: Counter[str] = Counter()
    stored = 0
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for sample in family.samples:
            if sample.name == contract.M_PROMPT_TOKENS + "_total":
                found[sample.labels["source"]] += int(sample.value)
            elif sample.name == contract.M_STORE_TOKENS + "_total":
                stored += int(sample.value)
    return found, stored


def l1_held(server: Any) -> dict[str, int]:
    """What the server's L1 holds now (LMCache's ``/status``): chunks and bytes."""
    l1 = server.status()["storage_manager"]["l1_manager"]
    return {"chunks": int(l1["total_object_count"]), "bytes": int(l1["memory_used_bytes"])}


@contextmanager
def redis_server(log_dir: Path) -> Iterator[str]:
    """A throwaway ``redis-server`` on a free loopback port, no persistence; its URL."""
    from hack.ports import free_port

    port = free_port()
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (the Debian package redis-server)")
    with (log_dir / "redis.log").open("wb") as log:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                                stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != (
            "PONG"
        ):
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"redis-server did not start: {(log_dir / 'redis.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _servers(stack: ExitStack, log_dir: Path, count: int, l1: str, extra_env: dict[str, str]) -> list[tuple[Any, str]]:
    """``count`` cache servers on the sidecar's command line, KV events on; each with its events endpoint."""
    from hack.ports import free_port
    from kvoffload import contract
    from tests.support.lmcache_server import sidecar_events_server
    from tests.support.trtllm_executor import CHUNK

    made = []
    for i in range(count):
        events_port = free_port()
        env = {contract.ENV_PROMETHEUS_MULTIPROC_DIR: str(log_dir / f"metrics-{i}"), **extra_env}
        server = sidecar_events_server(log_dir / f"server-{i}", CHUNK, l1, events_port, f"replica-{i}-{events_port}",
                                       env)  # fmt: skip
        server.start()
        stack.callback(server.stop)
        made.append((server, f"tcp://127.0.0.1:{events_port}"))
    return made


class LoadTimes:
    """Every lookup that found chunks (``record_lookup``), and every securing and copy the replicas'
    connectors time for their cost guard (``LoadCosts``), all kept (the guard keeps a recent window)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[int, float]]] = {"lookup_hit": [], "securing": [], "copy": []}
        self._watched: set[int] = set()

    def watch(self, scheduler: Any) -> None:
        """Record what one engine's scheduler measures from now on, and pass it on."""
        costs, metrics = scheduler.load_costs, scheduler.metrics
        for target, method, step in ((costs, "secured", "securing"), (costs, "copied", "copy")):
            if id(target) not in self._watched:
                setattr(target, method, self._recorder(getattr(target, method), step))
        if id(metrics) not in self._watched:
            record_lookup, hits = metrics.record_lookup, self.samples["lookup_hit"]

            def on_lookup(seconds: float, queried_tokens: int, hit_tokens: int) -> None:
                if hit_tokens:
                    hits.append((hit_tokens, seconds))
                record_lookup(seconds, queried_tokens, hit_tokens)

            metrics.record_lookup = on_lookup
        self._watched.update((id(costs), id(metrics)))

    def _recorder(self, passed_on: Callable[[int, float], None], step: str) -> Callable[[int, float], None]:
        samples = self.samples[step]

        def record(tokens: int, seconds: float) -> None:
            samples.append((tokens, seconds))
            passed_on(tokens, seconds)

        return record

    def summary(self, bytes_per_token: int) -> dict[str, Any]:
        """Per step (``lookup_hit``, ``securing``, ``copy``): how many, tokens, p50/p99/mean
        milliseconds; and the copies' GB/s."""
        out: dict[str, Any] = {}
        for step, samples in self.samples.items():
            ms = [seconds * 1e3 for _, seconds in samples]
            tokens = sum(n for n, _ in samples)
            out[step] = {"count": len(samples), "tokens": tokens,
                         "p50_ms": round(percentile(ms, 50), 3) if ms else None,
                         "p99_ms": round(percentile(ms, 99), 3) if ms else None,
                         "mean_ms": round(sum(ms) / len(ms), 3) if ms else None}  # fmt: skip
        copy_s = sum(seconds for _, seconds in self.samples["copy"])
        out["copy"]["gb_per_s"] = round(out["copy"]["tokens"] * bytes_per_token / copy_s / 1e9, 3) if copy_s else None
        return out


def run_setup(
    setup: str, conversations: int, system_prompts: int, turns: int, shape: CacheShape, log_dir: Path
) -> dict[str, Any]:
    from kvoffload import contract
    from tests.support.cache_keys import policy_keys
    from tests.support.kv_router import DynamoIndexer
    from tests.support.trtllm_executor import (
        BLOCK,
        CHUNK,
        PromptRequest,
        StandinExecutor,
        connector_llm_args,
        settle_commits,
    )

    os.environ[contract.ENV_KV_EVENTS] = "true" if setup == "routed_by_indexer" else "false"
    model = f"replica-reuse-{setup}"
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with ExitStack() as stack:
        extra: dict[str, str] = {}
        if setup == "round_robin_redis_l2":
            extra[contract.ENV_L2_REDIS_URL] = stack.enter_context(redis_server(log_dir))
        if setup == "node_mode":
            # One server bound on all addresses with the policy's CURVE keys, as the operator starts a
            # node's cache pod; four distinct URLs to it (one per replica, as each engine pod dials it),
            # so each replica's connector is its own; the engines hold the policy's client keys.
            server_keys, engine_keys = policy_keys(log_dir / "keys", "replica-reuse")
            servers = _servers(stack, log_dir, 1, shape.l1, {contract.ENV_REQUEST_HOST: "0.0.0.0",
                                                             contract.ENV_CACHE_KEYS_DIR: str(server_keys)})  # fmt: skip
            stack.enter_context(env_set(**{contract.ENV_CACHE_KEYS_DIR: str(engine_keys)}))
            urls = [f"tcp://127.0.0.{i + 1}:{servers[0][0].port}" for i in range(REPLICAS)]
        else:
            servers = _servers(stack, log_dir, REPLICAS, shape.l1, extra)
            urls = [server.url for server, _ in servers]
        indexer = None
        if setup == "routed_by_indexer":
            indexer = DynamoIndexer({i + 1: events for i, (_, events) in enumerate(servers)}, BLOCK,
                                    log_dir / "indexer.log")  # fmt: skip
            indexer.start()
            stack.callback(indexer.stop)
        replicas = []
        loads = LoadTimes()
        for url in urls:
            ex = StandinExecutor(connector_llm_args(model, url), num_blocks=256, num_layers=shape.layers,
                                 num_kv_heads=shape.kv_heads, head_dim=shape.head_dim)  # fmt: skip
            stack.callback(ex.close)
            replicas.append(ex)
            loads.watch(ex.scheduler)
        time.sleep(1.0)  # the indexer's subscriptions (and their snapshots) settle before the first request
        round_robin, ties = itertools.cycle(range(REPLICAS)), itertools.count()
        choose: Callable[[list[int]], int]
        if indexer is None:
            choose = lambda _tokens: next(round_robin)  # noqa: E731
        else:
            routed = indexer

            def choose(tokens: list[int]) -> int:
                matches = routed.host_tier_matches(tokens)
                best = max(matches.values(), default=0)
                if best == 0:
                    return next(round_robin)
                tied = sorted(wid - 1 for wid, held in matches.items() if held == best)
                return tied[next(ties) % len(tied)]

        engine = Counter[str]()
        per_replica = Counter[int]()
        for rid, (_conversation, prompt) in enumerate(workload(conversations, system_prompts, turns), start=1):
            target = choose(prompt)
            per_replica[target] += 1
            (result,) = replicas[target].run([PromptRequest(rid, prompt, 2)])
            if result.failed:
                raise RuntimeError(f"{setup}: request {rid} failed: {result.error}")
            engine.update(device=result.device_reused_tokens, cache=result.connector_matched_tokens,
                          computed=result.computed_prompt_tokens)  # fmt: skip
            settle_commits()
            for ex in replicas:
                ex.evict_device_cache()
        sources, stored_tokens = connector_counts(replicas[0])
        total = sum(sources.values())
        return {
            "setup": setup,
            "requests": sum(per_replica.values()),
            "requests_per_replica": [per_replica[i] for i in range(REPLICAS)],
            "prompt_tokens": total,
            "by_source": dict(sources),
            "from_cache_pct": round(100.0 * sources["cache"] / total, 1) if total else 0.0,
            "engine_agrees": all(engine[k] == sources[k] for k in ("device", "cache", "computed")),
            "kv_mismatches": sum(ex.kv_mismatches for ex in replicas),
            "chunks_stored": stored_tokens // CHUNK,
            "l1_held_at_end": [l1_held(server) for server, _ in servers],
            "loads": loads.summary(shape.chunk_bytes(CHUNK) // CHUNK),
            "duration_s": round(time.monotonic() - started, 1),
        }


def build_parser() -> argparse.ArgumentParser:
    """The command line; its defaults are the documented run (a working set larger than each L1)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--system-prompts", type=int, default=2)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--setups", default=",".join(SETUPS), help="comma-separated, of " + ", ".join(SETUPS))
    parser.add_argument(
        "--l1", default="64Mi", help="each cache server's L1 (the policy's cache.l1Size, 64Mi at least)"
    )
    parser.add_argument("--layers", type=int, default=16, help="the stand-in model's layers")
    parser.add_argument("--kv-heads", type=int, default=8, help="its KV heads")
    parser.add_argument("--head-dim", type=int, default=64, help="its head dimension (float16: 32 KiB per token)")
    return parser


def shape_of(args: argparse.Namespace) -> CacheShape:
    """The KV geometry and L1 the command line asks for."""
    return CacheShape(args.layers, args.kv_heads, args.head_dim, args.l1)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvoffload import contract
    from kvoffload.quantity import parse_bytes
    from tests.support.connector_env import SHARED_CORES_LOOKUP_TIMEOUT_MS
    from tests.support.trtllm_executor import BLOCK, CHUNK, STANDIN_PATH

    if STANDIN_PATH not in sys.path:
        sys.path.insert(0, STANDIN_PATH)
    os.environ.update({contract.ENV_PYTHONHASHSEED: "0", contract.ENV_BACKEND: contract.BACKEND_SIDECAR,
                       contract.ENV_LOOKUP_TIMEOUT_MS: str(SHARED_CORES_LOOKUP_TIMEOUT_MS),
                       contract.ENV_METRICS_ENABLED: "true"})  # fmt: skip
    for name in (
        contract.ENV_SERVER_URL,
        contract.ENV_CHUNK_SIZE,
        contract.ENV_MODEL_NAME,
        contract.ENV_CACHE_KEYS_DIR,
        contract.ENV_RECOMPUTE_TOKENS_PER_S,
    ):
        os.environ.pop(name, None)
    shape = shape_of(args)
    chunks = distinct_chunks((prompt for _, prompt in workload(args.conversations, args.system_prompts, args.turns)),
                             CHUNK)  # fmt: skip
    working_set, l1_bytes = chunks * shape.chunk_bytes(CHUNK), parse_bytes(args.l1, "--l1")
    print(f"working set {chunks} chunks, {working_set / 2**20:.0f} MiB; L1 {l1_bytes / 2**20:.0f} MiB per server"
          + ("" if working_set > l1_bytes else " (it fits: nothing is evicted)"), file=sys.stderr, flush=True)  # fmt: skip
    log_dir = Path(tempfile.mkdtemp(prefix="kvo-replica-reuse-"))
    started = time.monotonic()
    results = []
    for setup in args.setups.split(","):
        results.append(run_setup(setup, args.conversations, args.system_prompts, args.turns, shape, log_dir / setup))
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
    print(json.dumps({
        "command": " ".join(["python", "-m", "benchmarks.replica_reuse", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(),
        "versions": versions(),
        "workload": {"replicas": REPLICAS, "conversations": args.conversations, "system_prompts": args.system_prompts,
                     "turns": args.turns, "system_prompt_tokens": SYSTEM_TOKENS, "question_tokens": QUESTION_TOKENS,
                     "reply_tokens": REPLY_TOKENS, "chunk_tokens": CHUNK, "tokens_per_block": BLOCK,
                     "router": "ai-dynamo-runtime (dynamo.indexer), pinned in hack/kv-router/requirements.txt"},
        "cache": {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "dtype": "float16",
                  "chunk_bytes": shape.chunk_bytes(CHUNK), "working_set_chunks": chunks,
                  "working_set_bytes": working_set, "l1": args.l1, "l1_bytes_per_server": l1_bytes,
                  "eviction_policy": "LRU"},
        "duration_s": round(time.monotonic() - started, 1),
        "results": results,
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
