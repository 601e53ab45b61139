"""Layer-wise loads through the stand-in executor and the real cache server: a synchronous hit is
copied span of layers by span once the engine was seen waiting for every layer, bit-exact; a layer
that runs without its hook during such a load fails the batch, and loads are whole from then on."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload import contract
from kvoffload.connector.backends.base import BackendError, LoadResult
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import CHUNK, PromptRequest, make_prompt

pytestmark = pytest.mark.connector


def _copies_by_path(backend: Any) -> dict[str, int]:
    """Count the loads the worker's copies (``WorkerBackend.copies``) move whole and layer-wise (wrapping both entry points)."""
    counts = {"whole": 0, "layerwise": 0}
    whole, by_layer = backend.load_secured, backend.load_secured_by_layer

    def counted(path: str, copy: Any) -> Any:
        def copying(ops: Any) -> Any:
            result = copy(ops)
            if result is not None:
                counts[path] += len(ops)
            return result

        return copying

    backend.load_secured, backend.load_secured_by_layer = counted("whole", whole), counted("layerwise", by_layer)
    return counts


def _hit(n: int) -> int:
    return n // CHUNK * CHUNK


@pytest.mark.parametrize("layerwise", ["true", "false"])
def test_a_synchronous_hit_is_copied_layer_wise_once_the_engine_waited_for_every_layer(
    lmcache_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch, layerwise: str
) -> None:
    monkeypatch.setenv(contract.ENV_LAYERWISE_LOADS, layerwise)
    monkeypatch.setenv(contract.ENV_LOAD_COST_GUARD, "false")
    ex = executor_factory(f"layerwise-{layerwise}-model", lmcache_server.url)
    copies = _copies_by_path(ex.rank0.worker.backend.copies)
    prompts = [make_prompt(70 + i, 300 + 40 * i) for i in range(2)]
    first = ex.run([PromptRequest(1 + i, p, 3) for i, p in enumerate(prompts)])
    ex.evict_device_cache()
    again = ex.run([PromptRequest(10 + i, p, 3) for i, p in enumerate(prompts)])
    for before, after, prompt in zip(first, again, prompts, strict=True):
        assert not after.failed and after.connector_matched_tokens == _hit(len(prompt))
        assert after.output_tokens == before.output_tokens
    assert ex.kv_mismatches == 0
    loads = len(prompts)
    assert copies == ({"whole": 0, "layerwise": loads} if layerwise == "true" else {"whole": loads, "layerwise": 0})


def test_a_layer_run_without_its_hook_during_a_layer_wise_load_fails_the_batch_then_loads_are_whole(
    lmcache_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(contract.ENV_LOAD_COST_GUARD, "false")
    ex = executor_factory("layerwise-unhooked-model", lmcache_server.url)
    copies = _copies_by_path(ex.rank0.worker.backend.copies)
    p, q = make_prompt(80, 300), make_prompt(81, 300)
    ex.run([PromptRequest(1, p, 2), PromptRequest(2, q, 2)])  # every layer's hook seen: layer-wise from now on
    ex.evict_device_cache()
    ex.rank0.layers_without_hook = frozenset({1})
    (skipped,) = ex.run([PromptRequest(3, p, 2)])
    assert skipped.failed and "ran without wait_for_layer_load" in skipped.error
    assert copies == {"whole": 0, "layerwise": 1}
    ex.evict_device_cache()
    ex.rank0.layers_without_hook = frozenset()
    (whole,) = ex.run([PromptRequest(4, q, 2)])
    assert not whole.failed and whole.connector_matched_tokens == _hit(len(q))
    assert copies == {"whole": 1, "layerwise": 1}
    assert ex.kv_mismatches == 0


def test_a_layer_wise_load_that_failed_leaves_nothing_for_the_next_iteration(
    lmcache_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer-wise load whose copy failed fails its batch in the first layer's hook, before
    ``wait_for_save``; the engine's next iterations (no load, then a hit) run as usual."""
    monkeypatch.setenv(contract.ENV_LOAD_COST_GUARD, "false")
    ex = executor_factory("layerwise-failed-model", lmcache_server.url)
    backend = ex.rank0.worker.backend.copies
    original = backend.load_secured_by_layer

    def failing(ops: Any) -> Any:
        layerwise = original(ops)
        layerwise.results[:] = [LoadResult(0, 0.0, BackendError("retrieve", "error", "injected")) for _ in ops]
        return layerwise

    p, q = make_prompt(90, 300), make_prompt(91, 300)
    ex.run([PromptRequest(1, p, 2)])
    ex.evict_device_cache()
    backend.load_secured_by_layer = failing
    (failed,) = ex.run([PromptRequest(2, p, 2)])
    assert failed.failed and "KV load failed" in failed.error
    backend.load_secured_by_layer = original
    (computed,) = ex.run([PromptRequest(3, q, 2)])  # no load in this iteration
    assert not computed.failed and computed.connector_matched_tokens == 0
    ex.evict_device_cache()
    (hit,) = ex.run([PromptRequest(4, p, 2)])
    assert not hit.failed and hit.connector_matched_tokens == _hit(len(p))
    assert ex.kv_mismatches == 0
