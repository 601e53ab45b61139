"""The connector end to end on CPU: TensorRT-LLM stand-in executor <-> real ``lmcache server``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvoffload import contract
from tests.support.connector_env import SHARED_CORES_LOOKUP_TIMEOUT_MS
from tests.support.lmcache_server import LMCacheServer
from tests.support.server_kills import after_each_lookup
from tests.support.trtllm_executor import (
    BLOCK,
    CHUNK,
    PromptRequest,
    make_prompt,
)

pytestmark = pytest.mark.connector
REPO = Path(__file__).resolve().parents[3]


def chunk_floor(n: int) -> int:
    return (n // CHUNK) * CHUNK


def _metric_samples(directory: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _sum(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _labels), v in samples.items() if n == name)


def test_store_evict_then_prefix_loads_bit_exact_tp2_with_metrics(
    lmcache_server: LMCacheServer, tmp_path: Path
) -> None:
    """Request 1 stores; its device blocks are evicted; request 2 (same prefix, longer) loads it and computes the rest.

    Runs the stand-in as trtllm-serve would: its own process, TP=2 (rank 1 a separate process),
    the options YAML the operator writes, the env it injects, metrics in PROMETHEUS_MULTIPROC_DIR.
    """
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    options = tmp_path / contract.TRTLLM_OPTIONS_FILE
    options.write_text(
        yaml.safe_dump(
            {
                "kv_cache_config": {"enable_block_reuse": True, "tokens_per_block": BLOCK},
                "kv_connector_config": {
                    "connector_module": contract.CONNECTOR_MODULE,
                    "connector_scheduler_class": contract.CONNECTOR_SCHEDULER_CLASS,
                    "connector_worker_class": contract.CONNECTOR_WORKER_CLASS,
                },
            }
        )
    )
    p1 = make_prompt(1, 200)
    p2 = p1 + make_prompt(2, 90)
    phases: list[Any] = [
        [{"request_id": 1, "prompt": p1, "max_new_tokens": 3}],
        "evict",
        [{"request_id": 2, "prompt": p2, "max_new_tokens": 3}],
        "evict",
        [{"request_id": 3, "prompt": p2, "max_new_tokens": 3, "cache_salt": "reference-tenant"}],
    ]
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(phases))
    env = dict(os.environ)
    env.update(
        {
            contract.ENV_SERVER_URL: lmcache_server.url,
            contract.ENV_PYTHONHASHSEED: "0",
            contract.ENV_PROMETHEUS_MULTIPROC_DIR: str(metrics_dir),
            contract.ENV_LOOKUP_TIMEOUT_MS: str(SHARED_CORES_LOOKUP_TIMEOUT_MS),
            contract.ENV_PYTHONPATH: os.pathsep.join([str(REPO), str(REPO / "tests" / "standin")]),
        }
    )
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.trtllm_executor", "--options", str(options), "--model", "tp2-model",
         "--prompts", str(prompts), "--tp", "2", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    report = json.loads(out.read_text())
    r1 = report["phases"][0]["results"][0]
    assert report["phases"][1]["evicted"] > 0
    r2 = report["phases"][2]["results"][0]
    r3 = report["phases"][4]["results"][0]
    assert not (r1["failed"] or r2["failed"] or r3["failed"])
    assert report["kv_mismatches"] == 0
    assert r1["connector_matched_tokens"] == 0
    assert r2["device_reused_tokens"] == 0
    assert r2["connector_matched_tokens"] == chunk_floor(len(p1))
    assert r2["computed_prompt_tokens"] == len(p2) - chunk_floor(len(p1))
    # Another tenant never hits; it computes everything and must produce the same output.
    assert r3["connector_matched_tokens"] == 0 and r3["computed_prompt_tokens"] == len(p2)
    assert r3["output_tokens"] == r2["output_tokens"]

    samples = _metric_samples(metrics_dir)
    assert _sum(samples, contract.M_LOOKUP_REQUESTS + "_total") >= 3
    assert _sum(samples, contract.M_LOOKUP_HIT_TOKENS + "_total") >= chunk_floor(len(p1))
    assert _sum(samples, contract.M_RETRIEVE_TOKENS + "_total") == 2 * chunk_floor(len(p1))  # two ranks
    assert _sum(samples, contract.M_RETRIEVE_BYTES + "_total") > 0
    assert _sum(samples, contract.M_STORE_TOKENS + "_total") > 0
    assert _sum(samples, contract.M_LOOKUP_SECONDS + "_count") >= 3
    assert _sum(samples, contract.M_CONNECTOR_ERRORS + "_total") == 0
    up = [v for (n, labels), v in samples.items() if n == contract.M_BACKEND_UP]
    assert up and min(up) == 1
    labels = {dict(lab).get("model") for (n, lab), _ in samples.items() if n == contract.M_LOOKUP_REQUESTS + "_total"}
    assert labels == {"tp2-model"}


def test_chunked_prefill_saves_later_chunks(lmcache_server: LMCacheServer, executor_factory: Any) -> None:
    """With chunked prefill (32 tokens/iteration) the chunks stored by later iterations are found."""
    ex = executor_factory("chunked-model", lmcache_server.url, context_chunk_size=2 * BLOCK)
    p1 = make_prompt(3, 230)
    (r1,) = ex.run([PromptRequest(1, p1, 2)])
    assert not r1.failed and r1.computed_prompt_tokens == len(p1)
    assert ex.evict_device_cache() > 0
    p2 = p1 + make_prompt(4, 40)
    (r2,) = ex.run([PromptRequest(2, p2, 2)])
    assert r2.connector_matched_tokens == chunk_floor(len(p1))  # chunks 2..3 came from cached_requests
    assert r2.computed_prompt_tokens == len(p2) - chunk_floor(len(p1))
    assert ex.kv_mismatches == 0
    # The data moved through the server's shared-memory L1, never pickled through ZMQ.
    log = lmcache_server.log_text()
    assert "Using shm non-GPU transfer strategy" in log
    assert "Using pickle non-GPU transfer strategy" not in log


def test_tenants_with_different_salts_never_share(lmcache_server: LMCacheServer, executor_factory: Any) -> None:
    """Same prompt, different cache_salt: no hit across tenants; each tenant hits its own KV."""
    ex = executor_factory("salt-model", lmcache_server.url)
    p = make_prompt(5, 200)
    (a1,) = ex.run([PromptRequest(1, p, 2, cache_salt="tenant-a")])
    ex.evict_device_cache()
    (b1,) = ex.run([PromptRequest(2, p, 2, cache_salt="tenant-b")])
    assert b1.connector_matched_tokens == 0 and b1.computed_prompt_tokens == len(p)
    ex.evict_device_cache()
    (a2,) = ex.run([PromptRequest(3, p, 2, cache_salt="tenant-a")])
    assert a2.connector_matched_tokens == chunk_floor(len(p))
    (n1,) = ex.run([PromptRequest(4, p, 2)])  # no salt: a third namespace
    assert n1.connector_matched_tokens == 0
    assert a1.output_tokens == b1.output_tokens == a2.output_tokens
    assert ex.kv_mismatches == 0


def test_synchronous_saves_when_async_disabled(
    lmcache_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVOFFLOAD_ASYNC_SAVE=false: saves are copied inside wait_for_save; the request is held until
    their COMMITs are answered, as with async saves."""
    monkeypatch.setenv(contract.ENV_ASYNC_SAVE, "false")
    ex = executor_factory("sync-save-model", lmcache_server.url)
    p = make_prompt(6, 180)
    (r1,) = ex.run([PromptRequest(1, p, 2)])
    assert not r1.failed
    ex.evict_device_cache()
    (r2,) = ex.run([PromptRequest(2, [*p, 7, 8, 9], 2)])
    assert r2.connector_matched_tokens == chunk_floor(len(p))
    assert ex.kv_mismatches == 0


def test_async_saves_hold_blocks_until_every_rank_saved(lmcache_server: LMCacheServer, executor_factory: Any) -> None:
    """Default async saves: request_finished returns True; blocks are freed only after get_finished."""
    ex = executor_factory("async-save-model", lmcache_server.url)
    p = make_prompt(8, 180)
    finished_flags: list[bool] = []
    original = ex.scheduler.request_finished

    def spy(request: Any, block_ids: list[int]) -> bool:
        finished_flags.append(original(request, block_ids))
        return finished_flags[-1]

    ex.scheduler.request_finished = spy
    (r1,) = ex.run([PromptRequest(1, p, 2)])
    assert not r1.failed
    assert finished_flags == [True] and not ex.saving  # held, then released by get_finished
    ex.evict_device_cache()
    (r2,) = ex.run([PromptRequest(2, [*p, 7, 8, 9], 2)])
    assert r2.connector_matched_tokens == chunk_floor(len(p))
    assert ex.kv_mismatches == 0


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
def test_sidecar_killed_mid_run_requests_keep_completing(
    tmp_path: Path, executor_factory: Any, manager_v2: bool
) -> None:
    """Kill the LMCache server between requests: zero failures, exact output; hits return after restart."""
    server = LMCacheServer(chunk_size=CHUNK, log_dir=tmp_path / "lmcache")
    server.start()
    try:
        ex = executor_factory(f"restart-{manager_v2}-model", server.url, llm_args={"kv_cache_manager_v2": manager_v2})
        base = make_prompt(7, 200)
        (r0,) = ex.run([PromptRequest(1, base, 2)])
        ex.evict_device_cache()
        (r1,) = ex.run([PromptRequest(2, base, 2)])
        assert r1.connector_matched_tokens == chunk_floor(len(base))

        server.kill()
        during = []
        for i in range(4):
            ex.evict_device_cache()
            during += ex.run([PromptRequest(10 + i, base, 2)])
        assert all(not r.failed for r in during)
        assert all(r.output_tokens == r0.output_tokens for r in during)
        assert all(r.connector_matched_tokens == 0 for r in during)

        server.start()  # same port, empty L1, new SHM segment
        after = []
        deadline = time.monotonic() + 60
        rid = 100
        while time.monotonic() < deadline:
            ex.evict_device_cache()
            (res,) = ex.run([PromptRequest(rid, base, 2)])
            rid += 1
            after.append(res)
            if res.connector_matched_tokens > 0:
                break
            time.sleep(0.3)
        assert all(not r.failed for r in after)
        assert after[-1].connector_matched_tokens == chunk_floor(len(base)), "hits never came back"
        assert all(r.output_tokens == r0.output_tokens for r in after)
        assert ex.kv_mismatches == 0
    finally:
        server.stop()


def test_decode_tokens_saved_when_enabled(
    lmcache_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """KVOFFLOAD_SAVE_DECODE_TOKENS: a follow-up turn finds the chunks filled by generated tokens too."""
    monkeypatch.setenv(contract.ENV_SAVE_DECODE_TOKENS, "true")
    ex = executor_factory("decode-model", lmcache_server.url)
    p1 = make_prompt(9, 120)
    (r1,) = ex.run([PromptRequest(1, p1, 20)])
    ex.evict_device_cache()
    turn2 = p1 + r1.output_tokens[:19] + make_prompt(10, 30)  # KV exists for prompt + 19 generated tokens
    (r2,) = ex.run([PromptRequest(2, turn2, 2)])
    assert r2.connector_matched_tokens == chunk_floor(len(p1) + 19) > chunk_floor(len(p1))
    assert ex.kv_mismatches == 0


@pytest.mark.parametrize("manager_v2", [False, True], ids=["v1", "kv-cache-manager-v2"])
@pytest.mark.parametrize("min_async_tokens", ["0", str(CHUNK)], ids=["sync-load", "async-load"])
def test_server_killed_between_lookup_and_load_still_gives_the_promised_kv(
    doomed_server: LMCacheServer,
    executor_factory: Any,
    monkeypatch: pytest.MonkeyPatch,
    min_async_tokens: str,
    manager_v2: bool,
) -> None:
    """The sidecar dies right after the lookup promised KV: the load was secured at lookup (chunks
    handed out in the shared L1 segment), so it is a local copy, synchronous or by the loader
    thread while the request is parked; the request gets the right output and the engine goes on
    (raising in start_load_kv would have stopped TensorRT-LLM's executor)."""
    monkeypatch.setenv(contract.ENV_ASYNC_LOAD_MIN_TOKENS, min_async_tokens)
    ex = executor_factory(f"failed-load-{manager_v2}-model", doomed_server.url,
                          llm_args={"kv_cache_manager_v2": manager_v2})  # fmt: skip
    p = make_prompt(12, 200)
    (r0,) = ex.run([PromptRequest(1, p, 2)])
    ex.evict_device_cache()
    restore = after_each_lookup(ex.scheduler, lambda _answer: doomed_server.kill())
    (r1,) = ex.run([PromptRequest(2, p, 2)])
    assert r1.connector_matched_tokens == chunk_floor(len(p)) and not r1.failed
    assert r1.output_tokens == r0.output_tokens and r1.computed_prompt_tokens == len(p) - chunk_floor(len(p))
    restore()
    ex.evict_device_cache()
    (r2,) = ex.run([PromptRequest(3, p, 2)])  # server gone: a plain recompute
    assert not r2.failed and r2.connector_matched_tokens == 0 and r2.output_tokens == r0.output_tokens
    assert ex.kv_mismatches == 0
    assert ex.async_loads == (0 if min_async_tokens == "0" else 1)


def test_several_hits_in_one_iteration_load_together_bit_exact(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """Three requests whose prefixes are stored arrive together: their loads go to the backend as one
    batch (pipelined: one load's copies overlap the next one's PREPARE) and every block is exact."""
    ex = executor_factory("batched-loads-model", lmcache_server.url)
    prompts = [make_prompt(40 + i, 200 + 30 * i) for i in range(3)]
    first = ex.run([PromptRequest(1 + i, p, 2) for i, p in enumerate(prompts)])
    ex.evict_device_cache()
    backend = ex.rank0.worker.backend.copies
    batches: list[int] = []
    whole, by_layer = backend.load_secured, backend.load_secured_by_layer

    def recording(copy: Any) -> Any:
        def recorded(ops: Any) -> Any:
            batches.append(len(ops))
            return copy(ops)

        return recorded

    backend.load_secured, backend.load_secured_by_layer = recording(whole), recording(by_layer)
    again = ex.run([PromptRequest(10 + i, p, 2) for i, p in enumerate(prompts)])
    assert batches == [3]
    for before, after, prompt in zip(first, again, prompts, strict=True):
        assert not after.failed and after.connector_matched_tokens == chunk_floor(len(prompt))
        assert after.output_tokens == before.output_tokens
    assert ex.kv_mismatches == 0


def test_server_gone_after_a_batch_of_lookups_still_loads_each_of_them(
    doomed_server: LMCacheServer, executor_factory: Any
) -> None:
    """The sidecar dies after the iteration's lookups promised KV to three requests: all three get
    their secured KV, bit-exact, with the outputs of the first run."""
    ex = executor_factory("failed-batch-model", doomed_server.url)
    prompts = [make_prompt(60 + i, 200) for i in range(3)]
    first = ex.run([PromptRequest(1 + i, p, 2) for i, p in enumerate(prompts)])
    ex.evict_device_cache()
    looked_up: list[int] = []

    def crash_after_the_last_lookup(answer: tuple[int, bool]) -> None:
        looked_up.append(answer[0])
        if len(looked_up) == len(prompts):
            doomed_server.kill()

    after_each_lookup(ex.scheduler, crash_after_the_last_lookup)
    results = ex.run([PromptRequest(10 + i, p, 2) for i, p in enumerate(prompts)])
    assert all(n > 0 for n in looked_up)
    for before, r in zip(first, results, strict=True):
        assert not r.failed and r.output_tokens == before.output_tokens
    assert ex.kv_mismatches == 0
