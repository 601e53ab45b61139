"""Key scope and chunk layout: what, besides the tokens, puts a chunk under another key (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.chunk_report import LoraScope
from kvoffload.connector.keys import (
    ChunkLayout,
    cache_model_name,
    chunk_layout,
    key_salt,
    lora_scope,
    normalize_salt,
    salt_of,
)

pytestmark = pytest.mark.connector

IMAGE_A = [1, -2, 3, -4, 5, -6, 7, -8]
IMAGE_B = [1, -2, 3, -4, 5, -6, 7, -9]


@dataclass
class Request:
    """The attributes TensorRT-LLM's ``LlmRequest`` exposes for a key scope (None when absent)."""

    cache_salt: str | None = None
    cache_salt_id: int | None = None
    lora_task_id: int | None = None
    multimodal_hashes: list[list[int]] | None = None
    multimodal_positions: list[int] | None = None
    multimodal_lengths: list[int] | None = None
    input_token_extra_ids: list[int] | None = None


def image(digest: list[int], at: int = 10, length: int = 64) -> dict[str, Any]:
    return {"multimodal_hashes": [digest], "multimodal_positions": [at], "multimodal_lengths": [length]}


@pytest.mark.parametrize(
    "request_",
    [Request(), Request(cache_salt="tenant"), Request(cache_salt_id=42), Request(multimodal_hashes=[])],
    ids=["no-salt", "salt", "salt-id", "empty-multimodal"],
)
def test_a_plain_request_keeps_the_salt_it_always_had(request_: Request) -> None:
    assert key_salt(request_) == salt_of(request_)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (Request(lora_task_id=1), Request()),
        (Request(lora_task_id=1), Request(lora_task_id=2)),
        (Request(lora_task_id=0), Request()),
        (Request(cache_salt="t1", lora_task_id=1), Request(cache_salt="t2", lora_task_id=1)),
        (Request(**image(IMAGE_A)), Request()),
        (Request(**image(IMAGE_A)), Request(**image(IMAGE_B))),
        (Request(**image(IMAGE_A, at=10)), Request(**image(IMAGE_A, at=11))),
        (Request(**image(IMAGE_A, length=64)), Request(**image(IMAGE_A, length=32))),
        (Request(**image(IMAGE_A), lora_task_id=1), Request(**image(IMAGE_A))),
        (Request(input_token_extra_ids=[0, 1, 1]), Request()),
        (Request(input_token_extra_ids=[0, 1, 1]), Request(input_token_extra_ids=[0, 2, 2])),
    ],
    ids=[
        "adapter-vs-base",
        "two-adapters",
        "adapter-0-vs-base",
        "two-tenants-one-adapter",
        "image-vs-text",
        "two-images",
        "image-moved",
        "image-shorter",
        "adapter-and-image",
        "extra-ids-vs-none",
        "two-extra-id-tables",
    ],
)
def test_what_changes_the_kv_changes_the_salt(a: Request, b: Request) -> None:
    assert key_salt(a) != key_salt(b)


@pytest.mark.parametrize(
    "request_",
    [
        Request(lora_task_id=3),
        Request(cache_salt="t", **image(IMAGE_A)),
        Request(input_token_extra_ids=[0, 5]),
    ],
    ids=["adapter", "image", "extra-ids"],
)
def test_the_same_scope_gives_the_same_salt(request_: Request) -> None:
    twin = Request(**vars(request_))
    assert key_salt(request_) == key_salt(twin) is not None


@pytest.mark.parametrize(
    "request_",
    [
        Request(multimodal_positions=[10], multimodal_lengths=[64]),
        Request(multimodal_positions=[10]),
        Request(multimodal_lengths=[64], lora_task_id=1),
        Request(multimodal_hashes=[], multimodal_positions=[10], multimodal_lengths=[64]),
    ],
    ids=["positions-and-lengths", "positions", "lengths", "empty-hashes"],
)
def test_a_multimodal_request_without_content_hashes_is_not_cacheable(request_: Request) -> None:
    assert key_salt(request_) is None


@given(
    salt=st.one_of(st.none(), st.text(max_size=300)),
    lora=st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    digests=st.lists(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=8, max_size=8), max_size=3),
    extra=st.one_of(st.none(), st.lists(st.integers(0, 2**31), max_size=20)),
)
def test_a_scoped_salt_is_lmcache_safe_and_of_fixed_length(
    salt: str | None, lora: int | None, digests: list[list[int]], extra: list[int] | None
) -> None:
    positions = [10 * i for i in range(len(digests))]
    request = Request(salt, None, lora, digests, positions, [8] * len(digests), extra)
    scoped = key_salt(request)
    assert scoped is not None
    assert len(scoped) <= 128 and not set(scoped) & set("@/\\\x00")
    if lora is not None or digests or extra:
        assert len(scoped) == 33 and scoped.startswith("k")
    else:
        assert scoped == normalize_salt(salt)


def test_an_extra_id_tensor_is_read_as_its_values() -> None:
    class Table(list[int]):
        def tolist(self) -> list[int]:
            return list(self)

    assert key_salt(Request(input_token_extra_ids=Table([0, 1]))) == key_salt(Request(input_token_extra_ids=[0, 1]))


BF16 = chunk_layout("torch.bfloat16", 32, 4 * 2**20)


@pytest.mark.parametrize(
    "other",
    [
        chunk_layout("torch.float8_e4m3fn", 32, 4 * 2**20),
        chunk_layout("torch.bfloat16", 16, 4 * 2**20),
        chunk_layout("torch.bfloat16", 32, 2 * 2**20),
    ],
    ids=["fp8-kv", "tokens-per-block", "block-bytes"],
)
def test_a_chunk_layout_that_changes_the_bytes_changes_the_model_name(other: ChunkLayout) -> None:
    assert cache_model_name("m", other) != cache_model_name("m", BF16)


def test_a_layout_is_named_by_the_pools_dtype() -> None:
    import torch

    assert chunk_layout(torch.float8_e4m3fn, 16, 1024) == ChunkLayout("float8_e4m3fn", 16, 1024)
    assert chunk_layout(torch.bfloat16, 16, 1024) == chunk_layout("bfloat16", 16, 1024)


def test_another_adapter_under_the_same_task_id_is_another_scope() -> None:
    assert key_salt(Request(lora_task_id=1), adapter=b"adapter-a") != key_salt(
        Request(lora_task_id=1), adapter=b"adapter-b"
    )


def test_an_adapter_that_cannot_be_identified_is_not_cacheable() -> None:
    assert key_salt(Request(lora_task_id=1), adapter=None) is None


def test_two_prompt_tables_behind_the_same_virtual_tokens_are_two_scopes() -> None:
    one, two = key_salt(Request(), prompt_table=b"table-1"), key_salt(Request(), prompt_table=b"table-2")
    assert one != two and one != key_salt(Request()) and None not in (one, two)


@dataclass
class EmbeddedImage(Request):
    py_multimodal_data: dict[str, Any] | None = None


def test_multimodal_embeddings_passed_without_content_hashes_are_not_cacheable() -> None:
    assert key_salt(EmbeddedImage(py_multimodal_data={"multimodal_embedding": [0.5, 0.25]})) is None
    assert key_salt(EmbeddedImage(py_multimodal_data={})) == key_salt(Request())
    with_hash = EmbeddedImage(py_multimodal_data={"multimodal_embedding": [0.5]}, **image(IMAGE_A))
    assert key_salt(with_hash) == key_salt(Request(**image(IMAGE_A)))


def test_other_weights_under_one_model_name_are_another_model_in_keys() -> None:
    assert cache_model_name("/models/llama", BF16, "wabc") != cache_model_name("/models/llama", BF16, "wdef")
    assert cache_model_name("/models/llama", BF16, "") == cache_model_name("/models/llama", BF16)


# Router scope (issue 45 item 4): which chunks a router can match, and under which adapter.


@dataclass
class AdapterRequest(Request):
    py_lora_path: str | None = None


@pytest.mark.parametrize(
    ("request_", "prompt_table", "scope"),
    [
        (AdapterRequest(lora_task_id=7, py_lora_path="/adapters/sql-lora"), b"", LoraScope(7, "sql-lora")),
        (AdapterRequest(lora_task_id=7, py_lora_path="/adapters/sql-lora/"), b"", LoraScope(7, "sql-lora")),
        (AdapterRequest(lora_task_id=0, py_lora_path="hub/org/chat-lora"), b"", LoraScope(0, "chat-lora")),
        (AdapterRequest(), b"", None),
        (AdapterRequest(cache_salt="tenant"), b"", None),
        (AdapterRequest(lora_task_id=7), b"", None),
        (AdapterRequest(lora_task_id=7, py_lora_path="/"), b"", None),
        (AdapterRequest(lora_task_id=7, py_lora_path="/a/x", cache_salt="tenant"), b"", None),
        (AdapterRequest(lora_task_id=7, py_lora_path="/a/x", cache_salt_id=3), b"", None),
        (AdapterRequest(lora_task_id=7, py_lora_path="/a/x", **image(IMAGE_A)), b"", None),
        (AdapterRequest(lora_task_id=7, py_lora_path="/a/x", multimodal_positions=[3]), b"", None),
        (AdapterRequest(lora_task_id=7, py_lora_path="/a/x", input_token_extra_ids=[0, 1]), b"", None),
        (AdapterRequest(lora_task_id=7, py_lora_path="/a/x"), b"table-digest", None),
    ],
    ids=[
        "adapter",
        "trailing-slash",
        "relative-path",
        "no-adapter",
        "salt-only",
        "no-path",
        "root-path",
        "adapter+salt",
        "adapter+salt-id",
        "adapter+image",
        "adapter+placeholders",
        "adapter+extra-ids",
        "adapter+prompt-table",
    ],
)
def test_a_router_can_match_only_a_chunk_whose_adapter_alone_scopes_it_named_by_its_checkpoint(
    request_: AdapterRequest, prompt_table: bytes, scope: LoraScope | None
) -> None:
    """Dynamo and llm-d key a chunk by ``lora_name`` and nothing else a TensorRT-LLM request scopes it by
    (docs/routing.md, "Tenants"): a LoRA scope only where the adapter is the whole key scope."""
    assert lora_scope(request_, prompt_table) == scope
