"""Layer groups (KVCacheManagerV2's VSWA layouts) as the connector moves them: which layouts are
served, which chunks may be stored, and how one chunk holds every group's pages (pure, CPU)."""

from __future__ import annotations

import pytest
import torch

from kvoffload.connector import planning
from kvoffload.connector.backends.blockcopy import GroupedPages, page_runs
from kvoffload.connector.layout import PoolLayoutError, describe_layer_groups, page_key

pytestmark = pytest.mark.connector


def test_the_full_attention_group_anchors_the_chunk_and_the_tag_names_every_groups_geometry() -> None:
    layout = describe_layer_groups([(0, 128, 12, [4096], [1] * 24), (1, None, 12, [4096], [1] * 24)])
    assert layout.group_ids == (1, 0)
    assert layout.block_bytes == 8192
    assert layout.tag() == "lg-fullx12x4096-128x12x4096"


@pytest.mark.parametrize(
    ("groups", "refused_for"),
    [
        ([(0, 128, 2, [64], [1, 1]), (1, 512, 2, [64], [1, 1])], "sliding attention window (128, 512 tokens)"),
        ([(0, None, 2, [64, 8], [1, 1])], "2 regions per page"),
        ([(0, None, 2, [64], [1, 2])], "page expansion factor of 2"),
    ],
)
def test_layouts_the_chunks_cannot_hold_are_refused_naming_why(groups: list, refused_for: str) -> None:
    with pytest.raises(PoolLayoutError, match=refused_for.replace("(", r"\(").replace(")", r"\)")):
        describe_layer_groups(groups)


@pytest.mark.parametrize(
    ("history", "window", "first_live"),
    [(0, 128, 0), (127, 128, 0), (128, 128, 0), (143, 128, 1), (1000, None, 0), (511, 128, 24), (512, 128, 24)],
)
def test_a_sliding_group_holds_pages_from_its_windows_first_block_on(
    history: int, window: int | None, first_live: int
) -> None:
    """V2's stale range: blocks before ``(history + 1 - W) // B`` are gone (B = 16)."""
    assert planning.first_live_block(history, window, 16) == first_live


def test_a_chunk_is_stored_only_while_every_group_holds_each_of_its_blocks() -> None:
    """Chunks of 4 blocks (64 tokens, 16 per block); the sliding group's pages from ordinal 4 on."""
    live_all = list(range(100, 112))
    assert planning.grouped_save_end(0, 192, [live_all], [0], 16, 64) == 192
    assert planning.grouped_save_end(0, 192, [live_all], [4], 16, 64) == 0  # the first chunk's pages are gone
    assert planning.grouped_save_end(64, 192, [live_all], [4], 16, 64) == 192
    holed = [*live_all[:6], -1, *live_all[7:]]
    assert planning.grouped_save_end(0, 192, [holed], [0], 16, 64) == 64  # nothing after a chunk it lacks
    assert planning.grouped_save_end(0, 192, [live_all[:10]], [0], 16, 64) == 128  # not yet allocated


def test_runs_of_pages_leave_out_blocks_without_one() -> None:
    assert list(page_runs([-1, 0, 1, 5, -1, -1, 6, 7])) == [(1, 0, 2), (3, 5, 1), (6, 6, 2)]
    assert page_key(0, 7) == 7 and page_key(2, 7) == 2 * (1 << 32) + 7


def test_one_chunk_holds_every_groups_pages_and_a_load_writes_only_pages_the_group_has() -> None:
    """Store the full group's and the sliding group's pages of two blocks into one chunk; load it into
    other pages where the sliding group has a page for the second block only: the first block's
    sliding page (-1) is left alone, every other page comes back bit-exact."""
    full = torch.arange(6 * 32, dtype=torch.int16).view(6, 32).view(torch.uint8)  # 64 bytes a page
    sliding = (1000 + torch.arange(6 * 16, dtype=torch.int16)).view(6, 16).view(torch.uint8)  # 32 bytes a page
    pages = GroupedPages([full, sliding])
    assert pages.block_bytes == 96
    chunk = torch.zeros(2 * 96, dtype=torch.uint8)
    pages.gather([0, 1], [[2, 3]], [chunk], [0], 2)
    with pytest.raises(ValueError, match="no page"):
        pages.gather([0, 1], [[-1, 3]], [torch.zeros_like(chunk)], [0], 2)
    before = sliding[4].clone()
    pages.scatter([4, 5], [[-1, 5]], [chunk], 0, 2)
    assert torch.equal(full[4:6], full[0:2])
    assert torch.equal(sliding[5], sliding[3]) and torch.equal(sliding[4], before)
