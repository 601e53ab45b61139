"""Stand-in for ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_layout.py`` (main @ae7a7216).

What KVCacheManagerV2 hands ``register_kv_cache_layout``: per layer group, the byte regions that
repeat once per page slot (``base + stride * i``, ``size`` bytes), each covering ``(layer, role)``
buffers in memory order. Upstream addresses device memory through ``TensorWrapper``; the stand-in
pools are host tensors, so the views are made from the same addresses with ``torch.frombuffer``.
Semantics kept as upstream has them: ``valid_page_slots`` drops ``BAD_PAGE_INDEX`` (-1) entries,
``slot_tensor`` refuses a slot out of range (-1 included) where the strided ``as_tensor`` view
silently addresses its last row, and ``as_single_pool_tensor`` is None for several groups, several
regions or a page expansion factor other than 1.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

BAD_PAGE_INDEX = -1
ROLES = ("key", "value")
"""The roles V2 names a layer's buffers by (a latent pool has only the first)."""


def valid_page_slots(page_indices: Iterable[int]) -> Iterator[tuple[int, int]]:
    """``(block_ordinal, page_slot)`` for the entries that address a page."""
    for ordinal, slot in enumerate(page_indices):
        if slot >= 0:
            yield ordinal, slot


_POOLS: list[weakref.ref[torch.Tensor]] = []
"""Pools described by :func:`describe_pool` (their owner keeps them alive, as V2 keeps its memory),
read for the device an address is on: upstream's regions are device addresses only, the stand-in's
may be host memory."""


class _DeviceBytes:
    """``nbytes`` of device memory at ``address``, for ``torch.as_tensor`` (``__cuda_array_interface__``)."""

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False), "version": 3}


def _bytes_at(address: int, nbytes: int) -> torch.Tensor:
    _POOLS[:] = [ref for ref in _POOLS if ref() is not None]
    for ref in _POOLS:
        pool = ref()
        if pool is None:
            continue
        storage = pool.untyped_storage()
        if storage.data_ptr() <= address and address + nbytes <= storage.data_ptr() + storage.nbytes():
            if pool.device.type == "cuda":
                return torch.as_tensor(_DeviceBytes(address, nbytes), device=pool.device)
            break
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


@dataclass(frozen=True)
class KvCacheBufferRef:
    """One ``(layer, role)`` buffer covered by a region, in memory order."""

    layer_id: int
    role: str
    expansion: int = 1


@dataclass(frozen=True)
class KvCacheRegion:
    """A contiguous byte range that repeats once per page slot."""

    base: int
    size: int
    stride: int
    num_slots: int
    buffers: tuple[KvCacheBufferRef, ...]

    def address_of(self, slot_id: int) -> int:
        if not 0 <= slot_id < self.num_slots:
            raise IndexError(f"slot_id {slot_id} out of range [0, {self.num_slots})")
        return self.base + self.stride * slot_id

    def as_tensor(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A strided ``[num_slots, size // itemsize]`` view; row ``i`` is slot ``i`` (row -1: the last)."""
        itemsize = torch.tensor([], dtype=dtype).element_size()
        if self.size % itemsize or self.stride % itemsize:
            raise ValueError(
                f"region size {self.size} and stride {self.stride} must both be multiples of {dtype} itemsize {itemsize}"
            )
        span = self.stride * (self.num_slots - 1) + self.size
        flat = _bytes_at(self.base, span).view(dtype)
        return flat.as_strided((self.num_slots, self.size // itemsize), (self.stride // itemsize, 1))

    def slot_tensor(self, slot_id: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """One page slot's bytes; raises ``IndexError`` for a slot out of range (``BAD_PAGE_INDEX``)."""
        itemsize = torch.tensor([], dtype=dtype).element_size()
        if self.size % itemsize:
            raise ValueError(f"region size {self.size} must be a multiple of {dtype} itemsize {itemsize}")
        return _bytes_at(self.address_of(slot_id), self.size).view(dtype)


@dataclass(frozen=True)
class KvCacheLayerGroupLayout:
    """One layer group: the unit page indices are scoped to."""

    layer_group_id: int
    layer_ids: tuple[int, ...]
    window_size: int | None
    regions: tuple[KvCacheRegion, ...]

    @property
    def bytes_per_page(self) -> int:
        return sum(region.size for region in self.regions)


@dataclass(frozen=True)
class KvCacheLayout:
    """What a connector is handed in place of a single KV cache pool tensor."""

    tokens_per_block: int
    groups: tuple[KvCacheLayerGroupLayout, ...]
    dtype: torch.dtype = torch.uint8

    def group(self, layer_group_id: int) -> KvCacheLayerGroupLayout:
        for group in self.groups:
            if group.layer_group_id == layer_group_id:
                return group
        raise KeyError(f"no layer group {layer_group_id} in layout")

    def group_of_layer(self, layer_id: int) -> KvCacheLayerGroupLayout:
        for group in self.groups:
            if layer_id in group.layer_ids:
                return group
        raise KeyError(f"layer {layer_id} is not covered by this layout")

    def as_single_pool_tensor(self) -> torch.Tensor | None:
        """A ``[num_slots, num_layers, kv_factor, block_size]`` view, or None (several groups, several
        regions, a page expansion factor other than 1, or a region the buffers do not divide)."""
        if len(self.groups) != 1 or len(self.groups[0].regions) != 1:
            return None
        group = self.groups[0]
        region = group.regions[0]
        num_layers = len(group.layer_ids)
        if not num_layers or len(region.buffers) % num_layers:
            return None
        kv_factor = len(region.buffers) // num_layers
        if any(buffer.expansion != 1 for buffer in region.buffers):
            return None
        itemsize = torch.tensor([], dtype=self.dtype).element_size()
        if region.size % (itemsize * len(region.buffers)):
            return None
        block_size = region.size // itemsize // len(region.buffers)
        return region.as_tensor(self.dtype).unflatten(1, (num_layers, kv_factor, block_size))


def describe_pool(pool: torch.Tensor, tokens_per_block: int, window_size: int | None = None) -> KvCacheLayout:
    """The layout V2 gives for one layer group over a contiguous ``[slots, layers, kv_factor, elems]``
    pool: one region, each layer's ``key`` (and ``value``) buffers in order (``build_kv_cache_layout_v2``).
    Not upstream API: how the stand-in executor and the GPU check describe their pools."""
    _POOLS.append(weakref.ref(pool))
    slots, layers, kv_factor, _elems = pool.shape
    roles = ROLES[:kv_factor]
    page_bytes = pool[0].numel() * pool.element_size()
    region = KvCacheRegion(
        base=pool.data_ptr(),
        size=page_bytes,
        stride=pool.stride(0) * pool.element_size(),
        num_slots=slots,
        buffers=tuple(KvCacheBufferRef(layer, role) for layer in range(layers) for role in roles),
    )
    group = KvCacheLayerGroupLayout(0, tuple(range(layers)), window_size, (region,))
    return KvCacheLayout(tokens_per_block, (group,), pool.dtype)


def describe_pools(
    pools: list[tuple[torch.Tensor, tuple[int, ...], int | None]], tokens_per_block: int
) -> KvCacheLayout:
    """The layout V2 gives for layer groups each in a pool of its own, ``(pool, layer ids, window)``
    in layer-group id order (how the stand-in executor describes a VSWA model's pools)."""
    groups = []
    for group_id, (pool, layers, window) in enumerate(pools):
        (region,) = describe_pool(pool, tokens_per_block, window).groups[0].regions
        buffers = tuple(
            KvCacheBufferRef(layers[i // len(ROLES[: pool.shape[2]])], ref.role) for i, ref in enumerate(region.buffers)
        )
        region = KvCacheRegion(region.base, region.size, region.stride, region.num_slots, buffers)
        groups.append(KvCacheLayerGroupLayout(group_id, tuple(layers), window, (region,)))
    return KvCacheLayout(tokens_per_block, tuple(groups), pools[0][0].dtype)
