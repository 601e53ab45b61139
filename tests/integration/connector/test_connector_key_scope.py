"""What changes the KV changes the key: LoRA adapters, images, the KV dtype and the block size, on the
stand-in of TensorRT-LLM's executor with a real ``lmcache server``. The stand-in's forward makes KV
depend on the adapter at every position and on an image from its placeholder tokens on; its device
reuse keys blocks as the C++ ``BlockKey`` does (task id and image hashes, not the adapter's weights
or a prompt table), so a chunk read under the wrong key shows as KV mismatches and other output tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from tests.integration.connector.test_connector_token_sources import token_sources
from tests.support.lmcache_server import LMCacheServer
from tests.support.trtllm_executor import (
    BLOCK,
    CHUNK,
    PromptRequest,
    RequestResult,
    StandinExecutor,
    connector_llm_args,
    make_prompt,
    multimodal_hash,
)

pytestmark = pytest.mark.connector

PROMPT = make_prompt(41, 4 * CHUNK + 10)
WHOLE_CHUNKS = 4 * CHUNK
IMAGE_AT, IMAGE_LEN, PLACEHOLDER = 100, 64, 31999
"""An image's placeholder tokens: the same ids whatever the image."""
BEFORE_IMAGE = (IMAGE_AT // BLOCK) * BLOCK
"""Tokens of the whole blocks before the image: what the device reuses across images."""


def with_image(prompt: list[int]) -> list[int]:
    return [*prompt[:IMAGE_AT], *[PLACEHOLDER] * IMAGE_LEN, *prompt[IMAGE_AT + IMAGE_LEN :]]


def image_request(rid: int, content: bytes | None, prompt: list[int] = PROMPT) -> PromptRequest:
    """A request whose prompt holds one image (``content``; None: its hash is missing)."""
    return PromptRequest(
        rid,
        with_image(prompt),
        2,
        multimodal_hashes=None if content is None else [multimodal_hash(content)],
        multimodal_positions=[IMAGE_AT],
        multimodal_lengths=[IMAGE_LEN],
    )


def run_one(ex: Any, request: PromptRequest) -> RequestResult:
    (result,) = ex.run([request])
    assert not result.failed, result.error
    return result


def test_the_same_prompt_under_two_lora_adapters_never_shares_kv(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """Adapter 7's KV is neither device-reused nor loaded for adapter 8, nor 8's for 7; each adapter
    loads its own once the device evicted it, bit-exact."""
    ex = executor_factory("keys-lora-model", lmcache_server.url)
    first = run_one(ex, PromptRequest(1, PROMPT, 2, lora_task_id=7))
    other = run_one(ex, PromptRequest(2, PROMPT, 2, lora_task_id=8))  # 7's blocks still on the device
    assert other.device_reused_tokens == 0 and other.connector_matched_tokens == 0
    assert other.output_tokens != first.output_tokens, "the stand-in's KV does not depend on the adapter"
    ex.evict_device_cache()
    base = run_one(ex, PromptRequest(3, PROMPT, 2))
    assert base.connector_matched_tokens == 0, "the base model loaded an adapter's KV"
    ex.evict_device_cache()
    again = run_one(ex, PromptRequest(4, PROMPT, 2, lora_task_id=7))
    other_again = run_one(ex, PromptRequest(5, PROMPT, 2, lora_task_id=8))
    assert again.connector_matched_tokens == other_again.connector_matched_tokens == WHOLE_CHUNKS
    assert (again.output_tokens, other_again.output_tokens) == (first.output_tokens, other.output_tokens)
    assert ex.kv_mismatches == 0


def test_the_same_text_with_two_images_never_shares_kv(lmcache_server: LMCacheServer, executor_factory: Any) -> None:
    """Image B's request device-reuses only the blocks before the image (as TensorRT-LLM does) and
    loads nothing of image A's; each image loads its own once the device evicted it, bit-exact."""
    ex = executor_factory("keys-image-model", lmcache_server.url)
    first = run_one(ex, image_request(1, b"image A"))
    other = run_one(ex, image_request(2, b"image B"))
    assert (other.device_reused_tokens, other.connector_matched_tokens) == (BEFORE_IMAGE, 0)
    assert other.output_tokens != first.output_tokens, "the stand-in's KV does not depend on the image"
    ex.evict_device_cache()
    again = run_one(ex, image_request(3, b"image A"))
    other_again = run_one(ex, image_request(4, b"image B"))  # the text before the image: on the device again
    assert again.connector_matched_tokens == WHOLE_CHUNKS
    assert (other_again.device_reused_tokens, other_again.connector_matched_tokens) == (
        BEFORE_IMAGE,
        WHOLE_CHUNKS - BEFORE_IMAGE,
    )
    assert (again.output_tokens, other_again.output_tokens) == (first.output_tokens, other.output_tokens)
    assert ex.kv_mismatches == 0


def test_a_multimodal_request_without_hashes_is_neither_looked_up_nor_saved(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """Its placeholder tokens do not say which image they stand for: no lookup, no save (a text
    request with the same tokens finds nothing), its whole chunks counted as computed, ``uncacheable``."""
    ex = executor_factory("keys-unhashed-model", lmcache_server.url)
    run_one(ex, image_request(1, None))
    ex.evict_device_cache()
    unhashed = run_one(ex, image_request(2, None))
    ex.evict_device_cache()
    same_tokens = run_one(ex, PromptRequest(3, with_image(PROMPT), 2))
    assert unhashed.connector_matched_tokens == same_tokens.connector_matched_tokens == 0
    assert token_sources(ex)["computed", "uncacheable"] == 2 * WHOLE_CHUNKS
    assert ex.kv_mismatches == 0


def first_run(model: str, url: str, request: PromptRequest, **llm_args: Any) -> tuple[RequestResult, int]:
    """``request`` on a fresh engine of ``model``: its result and the engine's KV mismatches. One
    engine at a time: in one process a scheduler keys as the worker registered last for its server."""
    ex = StandinExecutor(connector_llm_args(model, url, **llm_args))
    try:
        return run_one(ex, request), ex.kv_mismatches
    finally:
        ex.close()


@pytest.mark.parametrize(
    ("model", "ours", "theirs"),
    [
        ("keys-dtype-model", {"kv_dtype": "bfloat16"}, {"kv_dtype": "fp8"}),
        ("keys-block-model", {"block": 16}, {"block": 32}),
    ],
    ids=["bf16-vs-fp8-kv", "16-vs-32-tokens-per-block"],
)
def test_engines_of_one_model_with_other_chunk_bytes_never_read_each_others_chunks(
    lmcache_server: LMCacheServer,
    connector_env: dict[str, str],
    model: str,
    ours: dict[str, Any],
    theirs: dict[str, Any],
) -> None:
    """Two deployments of one model sharing one server, differing only in the KV dtype or the block
    size: neither loads the other's chunks; each loads its own, bit-exact."""
    url = lmcache_server.url
    stored, bad = first_run(model, url, PromptRequest(1, PROMPT, 2), **ours)
    assert stored.connector_matched_tokens == 0 and bad == 0
    cross, bad = first_run(model, url, PromptRequest(2, PROMPT, 2), **theirs)
    assert cross.connector_matched_tokens == 0 and bad == 0
    own, bad = first_run(model, url, PromptRequest(3, PROMPT, 2), **theirs)
    assert own.connector_matched_tokens == WHOLE_CHUNKS and own.output_tokens == cross.output_tokens and bad == 0
    back, bad = first_run(model, url, PromptRequest(4, PROMPT, 2), **ours)
    assert back.connector_matched_tokens == WHOLE_CHUNKS and back.output_tokens == stored.output_tokens and bad == 0


SYSTEM = make_prompt(43, 2 * BLOCK)
"""A shared system prompt of two blocks: a device prefix that ends inside a chunk."""


def test_a_parked_request_whose_skipped_device_blocks_another_request_reuses_keeps_its_adapter(
    lmcache_server: LMCacheServer, executor_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """P (adapter 1) parks on an asynchronous load from chunk 0 whose first two blocks are the
    device's shared system prompt (skipped, never written); Q (adapter 1) reuses those blocks while
    P's load runs. P is alive: it keeps its state and its adapter's key scope, so what it saves stays
    adapter 1's, and a base-model request with P's prompt loads none of it. 0 wrong KV."""
    from kvoffload import contract
    from tests.integration.connector.test_connector_cancel_during_load import slow_async_loads

    monkeypatch.setenv(contract.ENV_ASYNC_LOAD_MIN_TOKENS, str(CHUNK))
    slow_async_loads(monkeypatch, 0.05)
    ex = executor_factory("keys-parked-scope-model", lmcache_server.url, num_blocks=128)
    body = make_prompt(44, 4 * CHUNK)
    prompt = [*SYSTEM, *body]
    run_one(ex, PromptRequest(1, prompt, 1, lora_task_id=1))  # P's prefix stored under adapter 1
    ex.evict_device_cache()
    run_one(ex, PromptRequest(2, [*SYSTEM, *make_prompt(45, 40)], 1, lora_task_id=1))  # the system prompt on the device
    parked, reuser = ex.run([
        PromptRequest(3, [*prompt, *make_prompt(46, 3 * CHUNK)], 2, lora_task_id=1),
        PromptRequest(4, [*SYSTEM, *make_prompt(47, 40)], 2, lora_task_id=1, arrive_after=1),
    ])  # fmt: skip
    assert not parked.failed and not reuser.failed
    assert ex.async_loads >= 1 and parked.device_reused_tokens == len(SYSTEM)
    assert reuser.device_reused_tokens == len(SYSTEM)
    ex.evict_device_cache()
    base = run_one(ex, PromptRequest(5, [*prompt, *make_prompt(46, 3 * CHUNK)], 2))
    assert base.connector_matched_tokens == 0, "the base model loaded adapter 1's KV"
    assert ex.kv_mismatches == 0


def adapter_dir(root: Path, weights: bytes) -> str:
    """A LoRA checkpoint directory (config and weights) under ``root``."""
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    (root / "adapter_model.safetensors").write_bytes(weights)
    return str(root)


def test_two_deployments_with_one_task_id_and_two_adapters_never_share_kv(
    lmcache_server: LMCacheServer, connector_env: dict[str, str], tmp_path: Path
) -> None:
    """Task ids are each deployment's own numbering: deployment B's adapter 3 is not A's. B neither
    loads A's chunks nor A B's; a third engine of A's adapter loads A's bit-exact."""
    ours, theirs = adapter_dir(tmp_path / "a", b"\x01" * 4096), adapter_dir(tmp_path / "b", b"\x02" * 4096)
    first, wrong = first_run("keys-deployments-model", lmcache_server.url,
                             PromptRequest(1, PROMPT, 2, lora_task_id=3, lora_path=ours))  # fmt: skip
    other, other_wrong = first_run("keys-deployments-model", lmcache_server.url,
                                   PromptRequest(1, PROMPT, 2, lora_task_id=3, lora_path=theirs))  # fmt: skip
    assert other.connector_matched_tokens == 0, "deployment B loaded deployment A's adapter 3"
    assert other.output_tokens != first.output_tokens, "the stand-in's KV does not depend on the adapter's weights"
    again, again_wrong = first_run("keys-deployments-model", lmcache_server.url,
                                   PromptRequest(1, PROMPT, 2, lora_task_id=3, lora_path=ours))  # fmt: skip
    assert again.connector_matched_tokens == WHOLE_CHUNKS and again.output_tokens == first.output_tokens
    assert wrong == other_wrong == again_wrong == 0


def test_one_model_path_with_other_weights_never_shares_kv(
    lmcache_server: LMCacheServer, connector_env: dict[str, str], tmp_path: Path
) -> None:
    """Two deployments name their model by the same path, with other weights behind it (another
    volume, a new checkpoint in place): the second computes; the same weights again load."""
    model = tmp_path / "models" / "llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"hidden_size": 4096}')
    (model / "model.safetensors").write_bytes(b"\x01" * 8192)
    first, _ = first_run(str(model), lmcache_server.url, PromptRequest(1, PROMPT, 2))
    assert first.connector_matched_tokens == 0
    same, _ = first_run(str(model), lmcache_server.url, PromptRequest(2, PROMPT, 2))
    assert same.connector_matched_tokens == WHOLE_CHUNKS
    (model / "model.safetensors").write_bytes(b"\x02" * 8192)
    other, _ = first_run(str(model), lmcache_server.url, PromptRequest(3, PROMPT, 2))
    assert other.connector_matched_tokens == 0, "other weights behind the same path loaded the first's KV"


def test_two_prompt_tables_behind_the_same_virtual_tokens_never_share_kv(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    ex = executor_factory("keys-prompt-table-model", lmcache_server.url)
    first = run_one(ex, PromptRequest(1, PROMPT, 2, prompt_table=(0.5,) * 16))
    ex.evict_device_cache()
    other = run_one(ex, PromptRequest(2, PROMPT, 2, prompt_table=(0.25,) * 16))
    assert other.connector_matched_tokens == 0, "another prompt-tuning table loaded the first's KV"
    ex.evict_device_cache()
    again = run_one(ex, PromptRequest(3, PROMPT, 2, prompt_table=(0.5,) * 16))
    assert again.connector_matched_tokens == WHOLE_CHUNKS and again.output_tokens == first.output_tokens
    assert ex.kv_mismatches == 0


def test_the_standin_device_shares_blocks_across_prompt_tables_as_upstreams_block_key_does(
    lmcache_server: LMCacheServer, executor_factory: Any
) -> None:
    """Never kinder than TensorRT-LLM: its ``BlockKey`` names neither a prompt table nor the adapter's
    weights, so the device hands one table's blocks to another (the checks count the wrong KV). Why
    the connector's own key must carry them, and why the tests above evict the device in between."""
    ex = executor_factory("keys-prompt-table-device-model", lmcache_server.url)
    run_one(ex, PromptRequest(1, PROMPT, 2, prompt_table=(0.5,) * 16))
    other = run_one(ex, PromptRequest(2, PROMPT, 2, prompt_table=(0.25,) * 16))
    assert other.device_reused_tokens == WHOLE_CHUNKS and other.connector_matched_tokens == 0
    assert ex.kv_mismatches > 0, "the stand-in's KV does not depend on the prompt table"


@pytest.mark.parametrize(
    "request_",
    [
        PromptRequest(1, PROMPT, 2, lora_task_id=4, lora_path_unset=True),
        PromptRequest(1, PROMPT, 2, multimodal_embedding=(0.125, 0.5)),
    ],
    ids=["adapter-known-only-by-its-task-id", "embeddings-without-hashes"],
)
def test_a_request_whose_kv_cannot_be_named_is_computed_and_never_saved(
    lmcache_server: LMCacheServer, executor_factory: Any, request_: PromptRequest
) -> None:
    ex = executor_factory(f"keys-unnamed-{request_.lora_task_id}-model", lmcache_server.url)
    run_one(ex, request_)
    ex.evict_device_cache()
    again = run_one(ex, dataclasses.replace(request_, request_id=2))
    assert again.connector_matched_tokens == 0
    assert token_sources(ex)["computed", "uncacheable"] == 2 * WHOLE_CHUNKS
    assert ex.kv_mismatches == 0
