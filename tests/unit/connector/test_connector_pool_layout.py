"""Pool layouts: what a registered pool holds, how its chunks are keyed, and who stores them (pure)."""

from __future__ import annotations

import pytest

from kvoffload.connector.keys import cache_model_name, chunk_layout
from kvoffload.connector.layout import KeyRanks, PoolLayoutError, describe_pool, key_ranks, transfer_shape

pytestmark = pytest.mark.connector

DEEPSEEK_V3_LATENT = 512 + 64
"""``kv_lora_rank + qk_rope_head_dim`` of DeepSeek-V3/R1 and Kimi K2 (their config.json)."""


@pytest.mark.parametrize(
    ("name", "layers", "tokens_per_block"),
    [("deepseek-v3", 61, 32), ("kimi-k2", 61, 64), ("deepseek-v2-lite", 27, 32)],
)
def test_a_pool_without_a_value_half_is_multi_head_latent_attention_with_its_geometry(
    name: str, layers: int, tokens_per_block: int
) -> None:
    layout = describe_pool((100, layers, 1, tokens_per_block * DEEPSEEK_V3_LATENT), tokens_per_block)
    assert (layout.kind, layout.num_layers, layout.token_width) == ("mla", layers, DEEPSEEK_V3_LATENT)
    assert layout.replicated
    assert layout.tag() == f"mla-l{layers}-w576"


def test_a_key_value_pool_adds_nothing_to_the_key_and_is_not_replicated() -> None:
    layout = describe_pool((64, 32, 2, 8 * 32 * 128), 32)
    assert (layout.kind, layout.replicated, layout.tag()) == ("kv", False, "")


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ((64, 32, 3, 4096), "kv_factor=3"),
        ((64, 32, 2, 100), "not a multiple of tokens_per_block=32"),
        ((64, 32, 4096), "expected [num_blocks, num_layers, kv_factor, block_elems]"),
    ],
)
def test_a_pool_the_connector_cannot_move_is_refused_naming_what_was_seen(shape: tuple[int, ...], message: str) -> None:
    with pytest.raises(PoolLayoutError, match=message.replace("[", r"\[").replace("]", r"\]")):
        describe_pool(shape, 32)


def test_lmcache_is_shown_an_mla_pool_as_two_planes_of_the_same_bytes() -> None:
    shape = (10, 61, 1, 32 * 576)
    layout = describe_pool(shape, 32)
    shown = transfer_shape(shape, layout)
    assert shown == (10, 61, 2, 32 * 288)
    assert shown[1] * shown[2] * shown[3] == shape[1] * shape[2] * shape[3]
    kv = (10, 4, 2, 256)
    assert transfer_shape(kv, describe_pool(kv, 32)) == kv


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_a_latent_is_keyed_as_one_ranks_chunks_stored_by_rank_0_and_read_by_every_rank(world_size: int) -> None:
    layout = describe_pool((10, 61, 1, 32 * 576), 32)
    ranks = [key_ranks(layout, world_size, r) for r in range(world_size)]
    assert ranks[0] == KeyRanks(1, 0, True)
    assert all(r.world_size == 1 and r.rank == 0 and not r.stores for r in ranks[1:])


def test_key_value_chunks_are_keyed_and_stored_by_every_rank_for_its_heads() -> None:
    layout = describe_pool((10, 4, 2, 256), 32)
    assert [key_ranks(layout, 2, r) for r in (0, 1)] == [KeyRanks(2, 0, True), KeyRanks(2, 1, True)]


def test_the_cache_model_name_says_mla_and_its_geometry_so_no_other_layout_reads_its_chunks() -> None:
    mla = describe_pool((10, 61, 1, 32 * 576), 32)
    kv_same_bytes = describe_pool((10, 61, 2, 32 * 288), 32)
    block_bytes = 61 * 32 * 576 * 2
    mla_name = cache_model_name("deepseek-ai/DeepSeek-V3", chunk_layout("bfloat16", 32, block_bytes, mla.tag()))
    kv_name = cache_model_name(
        "deepseek-ai/DeepSeek-V3", chunk_layout("bfloat16", 32, block_bytes, kv_same_bytes.tag())
    )
    assert mla_name.endswith("-mla-l61-w576") and mla_name != kv_name
    other_width = describe_pool((10, 61, 1, 32 * 512), 32)
    assert cache_model_name("m", chunk_layout("bfloat16", 32, block_bytes, other_width.tag())) != cache_model_name(
        "m", chunk_layout("bfloat16", 32, block_bytes, mla.tag())
    )
