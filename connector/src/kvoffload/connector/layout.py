"""What a registered KV pool holds, and what that decides about its chunks (pure, no torch).

TensorRT-LLM hands the worker one pool ``[num_blocks, num_layers, kv_factor, block_elems]`` (V1's
``register_kv_caches``, or KVCacheManagerV2's one-group layout through ``as_single_pool_tensor``):

- ``kv_factor`` 2: a key and a value half per layer, this rank's share of the KV heads (tensor
  parallelism splits heads, so every rank stores its own chunks).
- ``kv_factor`` 1: multi-head latent attention (DeepSeek V2/V3/R1, Kimi K2): one latent vector per
  token and layer (``kv_lora_rank + qk_rope_head_dim``, 576 wide for DeepSeek-V3), V1's ``SELFKONLY``
  pool, V2's layout group with one ``key`` buffer per layer and no ``value``
  (``connectors/kv_cache_layout.py`` @ae7a7216: "a pool simply has no VALUE buffer"). The latent is
  computed before attention splits heads, so it is the same on every tensor-parallel rank: one copy
  serves the whole TP group (rank 0 stores it, every rank loads it), and under attention DP every
  rank keys it alike too.

LMCache 0.5.6's engine-driven transfer sizes chunk slots for two planes from its TensorRT-LLM
detector (``NB_NL_TWO_NH_BS_HS``), whatever the pool's ``kv_factor``. Chunks here are block-native
bytes (``backends.blockcopy``), so an MLA pool is registered as its two-plane view
(:func:`transfer_shape`): the same bytes, halves of each layer's latent block as "K" and "V".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

PoolKind = Literal["kv", "mla"]


class PoolLayoutError(ValueError):
    """A pool the connector cannot move; the message names what was seen and what is served."""


@dataclass(frozen=True)
class PoolLayout:
    """One registered pool: what each block holds and whom its chunks belong to."""

    kind: PoolKind
    num_layers: int
    kv_factor: int
    tokens_per_block: int
    token_width: int
    """Elements per token, layer and plane on this rank (KV: this rank's heads * head_dim; MLA: the latent)."""

    @property
    def replicated(self) -> bool:
        """Whether every tensor-parallel rank holds the same bytes (MLA's latent): stored once for the group."""
        return self.kind == "mla"

    def tag(self) -> str:
        """What the cache key's model name adds for this layout ("" for key/value pools, whose key
        already names dtype, tokens per block and block bytes): the kind and its geometry."""
        if self.kind == "kv":
            return ""
        return f"mla-l{self.num_layers}-w{self.token_width}"


def describe_pool(shape: Sequence[int], tokens_per_block: int) -> PoolLayout:
    """The layout of a pool of ``shape`` (``[num_blocks, num_layers, kv_factor, block_elems]``), or
    ``PoolLayoutError`` naming why it cannot be moved."""
    if len(shape) != 4:
        raise PoolLayoutError(
            f"KV pool of shape {tuple(shape)}: expected [num_blocks, num_layers, kv_factor, block_elems]"
        )
    _blocks, layers, kv_factor, block_elems = (int(d) for d in shape)
    if kv_factor not in (1, 2):
        raise PoolLayoutError(
            f"KV pool with kv_factor={kv_factor}: served are 2 (key and value) and 1 (multi-head latent attention)"
        )
    if block_elems % tokens_per_block != 0:
        raise PoolLayoutError(
            f"KV pool block of {block_elems} elements per layer is not a multiple of tokens_per_block={tokens_per_block}"
        )
    width = block_elems // tokens_per_block
    if kv_factor == 1 and block_elems % 2 != 0:
        raise PoolLayoutError(
            f"multi-head latent attention pool of {block_elems} elements per layer block: an odd count cannot be "
            "registered as LMCache's two planes"
        )
    return PoolLayout("mla" if kv_factor == 1 else "kv", layers, kv_factor, tokens_per_block, width)


def transfer_shape(shape: Sequence[int], layout: PoolLayout) -> tuple[int, int, int, int]:
    """The shape LMCache is shown for a pool of ``shape``: two planes per layer, the same bytes."""
    blocks, layers, kv_factor, block_elems = (int(d) for d in shape)
    if layout.kv_factor == 2:
        return (blocks, layers, kv_factor, block_elems)
    return (blocks, layers, 2, block_elems // 2)


@dataclass(frozen=True)
class KeyRanks:
    """How one rank names and writes its chunks: the world size and rank in its keys, and whether it stores."""

    world_size: int
    rank: int
    stores: bool


def key_ranks(layout: PoolLayout, world_size: int, rank: int) -> KeyRanks:
    """Key world and rank of ``rank`` of ``world_size`` for a pool of ``layout``: a replicated pool
    is one rank's worth (rank 0 stores it, every rank reads rank 0's chunks); else each rank its own."""
    if layout.replicated:
        return KeyRanks(1, 0, rank == 0)
    return KeyRanks(world_size, rank, True)


# --- several layer groups (KVCacheManagerV2) ------------------------------------------------------


@dataclass(frozen=True)
class LayerGroup:
    """One KVCacheManagerV2 layer group as the connector moves it: one region of ``page_bytes`` per
    page slot, holding its layers' KV for ``tokens_per_block`` tokens."""

    group_id: int
    window_size: int | None
    """Its attention window in tokens; None: full attention."""
    num_layers: int
    page_bytes: int


@dataclass(frozen=True)
class GroupedLayout:
    """A cache of several layer groups, or of one sliding-window group (``connectors/kv_cache_layout.py``
    @ae7a7216): page indices are per group, and a sliding group's pages behind its window go back to
    the pool (their ordinals then read ``BAD_PAGE_INDEX``).

    A chunk is **one object for every group**: for each block ordinal of the chunk, the anchor group's
    page and then each other group's, so one lookup, one PREPARE and one COMMIT serve all groups. A
    chunk is stored only while every group holds all its blocks; a load writes a sliding group's pages
    only where the engine gave them one (its window), the full-attention groups the whole prefix.
    """

    groups: tuple[LayerGroup, ...]
    """The anchor first (a full-attention group: its pages never leave a live request), then the others
    in the layout's order."""

    @property
    def block_bytes(self) -> int:
        """Bytes of one block ordinal across every group: a chunk holds ``blocks_per_chunk`` of these."""
        return sum(group.page_bytes for group in self.groups)

    @property
    def group_ids(self) -> tuple[int, ...]:
        """Upstream's layer group ids, anchor first (the order of ``TransferOp.group_block_ids``' groups)."""
        return tuple(group.group_id for group in self.groups)

    def tag(self) -> str:
        """What the cache key's model name adds: every group's window, layers and page bytes, in
        chunk order, so another geometry never reads these chunks."""
        return "lg-" + "-".join(f"{g.window_size or 'full'}x{g.num_layers}x{g.page_bytes}" for g in self.groups)


def describe_layer_groups(groups: Sequence[tuple[int, int | None, int, Sequence[int], Sequence[int]]]) -> GroupedLayout:
    """The grouped layout of ``(group_id, window_size, num_layers, region_sizes, expansions)`` per
    layer group, or ``PoolLayoutError`` naming why it cannot be moved: each group one region of one
    page expansion, and at least one full-attention group (the anchor)."""
    described: list[LayerGroup] = []
    for group_id, window, layers, region_sizes, expansions in groups:
        if len(region_sizes) != 1:
            raise PoolLayoutError(
                f"layer group {group_id} holds {len(region_sizes)} regions per page (block scales, or layers of "
                "differing size); the connector moves one region per page"
            )
        if any(e != 1 for e in expansions):
            raise PoolLayoutError(
                f"layer group {group_id} has a page expansion factor of {max(expansions)} (layers of different "
                "tokens per block); the connector moves groups of one tokens per block"
            )
        if window is not None and window <= 0:
            raise PoolLayoutError(f"layer group {group_id} has an attention window of {window} tokens")
        described.append(LayerGroup(group_id, window, layers, int(region_sizes[0])))
    anchors = [g for g in described if g.window_size is None]
    if not anchors:
        windows = ", ".join(str(g.window_size) for g in described)
        raise PoolLayoutError(
            f"every layer group of this model keeps a sliding attention window ({windows} tokens) and none "
            "attends to the whole prompt; the connector serves models with at least one full-attention group"
        )
    anchor = anchors[0]
    return GroupedLayout((anchor, *[g for g in described if g is not anchor]))


GROUP_PAGE_STRIDE = 1 << 32
"""Page slots are below 2**32: a page of group index ``g`` (chunk order, 1 and on) is named
``g * GROUP_PAGE_STRIDE + slot`` where one set names the pages of several groups (fences)."""


def page_key(group_index: int, slot: int) -> int:
    """One int naming page ``slot`` of the group at ``group_index`` in chunk order (the anchor's: ``slot``)."""
    return group_index * GROUP_PAGE_STRIDE + slot
