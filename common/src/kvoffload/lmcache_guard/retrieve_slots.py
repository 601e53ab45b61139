"""PREPARE_RETRIEVE's slot descriptions read from each memory object's metadata (``install_retrieve_slots``).

LMCache 0.5.6's ``ShmTransferStrategy.prepare_retrieve`` reads each slot's shape and dtype through
``MemoryObj.tensor``, which builds two tensor views each time it is read, three times per chunk:
about 40% of the server's PREPARE_RETRIEVE of a 32k-token load, and a hit's securing is paid inside
the engine iteration that schedules it (docs/results/cpu-lookup/lookup-and-secure-parts.md). The
replacement reads the shape and dtype that ``tensor`` views the bytes as from the object's metadata;
an object whose used size was narrowed (``set_used_size``: a flat byte view) or of another kind is
described through ``tensor`` as before. The rest is LMCache's own: the same read, the same refusals
(a missing or invalidated object: nothing secured, its read locks released), the same pending read
filed for COMMIT_RETRIEVE.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvoffload.lmcache_guard import check_lmcache_version, guarded, is_guard, require_callables
from kvoffload.lmcache_guard.unpickling import UNPICKLING_MODULE

MEMORY_MODULE = "lmcache.v1.memory_management"


def install_retrieve_slots() -> None:
    """Check the version, then have LMCache's SHM transfer strategy describe a retrieve's slots from
    its memory objects' metadata. Idempotent."""
    check_lmcache_version()
    transfer = importlib.import_module(UNPICKLING_MODULE)
    memory = importlib.import_module(MEMORY_MODULE)
    shm_cls = getattr(transfer, "ShmTransferStrategy", None)
    needed = (
        (shm_cls, "prepare_retrieve"),
        (transfer, "ShmSlotDescriptor"),
        (transfer, "PrepareRetrieveResponse"),
        (transfer, "_dtype_to_name"),
        (memory, "TensorMemoryObj"),
    )
    require_callables(needed, "the retrieve slots replacement uses")
    if is_guard(shm_cls.prepare_retrieve):  # type: ignore[union-attr]
        return
    shm_cls.prepare_retrieve = guarded(_prepare_retrieve(transfer, memory.TensorMemoryObj))  # type: ignore[union-attr]


def _prepare_retrieve(transfer: Any, tensor_memory_obj: Any) -> Any:
    describe_slot, respond, dtype_name = (
        transfer.ShmSlotDescriptor,
        transfer.PrepareRetrieveResponse,
        transfer._dtype_to_name,
    )

    def shape_and_dtype(memory_obj: Any) -> tuple[list[int], Any] | None:
        """What ``memory_obj.tensor`` would show (None: invalidated), read without building it."""
        if type(memory_obj) is tensor_memory_obj and memory_obj._used_size_override is None:
            if not memory_obj.valid:
                return None
            return list(memory_obj.meta.shape), memory_obj.meta.dtype
        view = memory_obj.tensor
        return None if view is None else (list(view.shape), view.dtype)

    def slots_of(memory_objs: list[Any]) -> list[dict[str, Any]] | None:
        """The slot descriptions of ``memory_objs`` (None: one of them was invalidated); LMCache's
        descriptor is built once per dtype (a load's chunks share one) and each slot's offset, length
        and shape filled in."""
        slots: list[dict[str, Any]] = []
        described_as: dict[Any, dict[str, Any]] = {}
        for memory_obj in memory_objs:
            described = shape_and_dtype(memory_obj)
            if described is None:
                return None
            shape, dtype = described
            template = described_as.get(dtype)
            if template is None:
                template = described_as[dtype] = describe_slot(offset=0, length=0, shape=shape,
                                                               dtype=dtype_name(dtype)).to_dict()  # fmt: skip
            slots.append({**template, "offset": memory_obj.shm_offset, "length": memory_obj.shm_byte_length,
                          "shape": shape})  # fmt: skip
        return slots

    def prepare_retrieve(self: Any, key: Any, instance_id: int, resolve_obj_keys: Any) -> Any:
        """LMCache 0.5.6's SHM ``prepare_retrieve`` with slots described from metadata."""
        obj_keys = resolve_obj_keys(key)
        read_keys, memory_objs = self._storage_manager.unsafe_read(obj_keys)
        whole = bool(memory_objs) and len(read_keys) == len(obj_keys) == len(memory_objs)
        slots = slots_of(memory_objs) if whole else None
        if slots is None:
            if read_keys:
                self._storage_manager.finish_read_prefetched(read_keys)
            return respond(success=False, data=b"", context={})
        with self._pending_lock:
            self._pending_reads[self._transfer_key_factory(key, instance_id)] = read_keys
        return respond(success=True, data=b"", context={"slots": slots})

    return prepare_retrieve
