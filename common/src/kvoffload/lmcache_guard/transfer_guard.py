"""Unfinished stores are dropped, never admitted (``install_transfer_guard``). LMCache 0.5.6 keeps a
``PREPARE_STORE`` reservation staged (invisible to readers) until its COMMIT, but when an engine-driven
context is unregistered or reaped (``EngineDrivenTransferModule._release_entry``) it calls
``finish_write`` on every pending reservation, which publishes slots nobody finished copying into.
Here the release discards them instead; a COMMIT_STORE whose payload is ``contract.STORE_ABORT_PAYLOAD``
discards its reservation (the connector's abort, which 0.5.6 has no call for); and an expired
reservation's buffer is freed rather than handed to the key's next writer (``L1Manager.reserve_write``
gives every MP writer the same tag, so the next writer would otherwise get the abandoned buffer, and
the abandoned reservation's release could discard it under that writer).
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
import time
from typing import Any

from kvoffload import contract
from kvoffload.lmcache_guard import check_lmcache_version, guarded, is_guard, require_callables
from kvoffload.lmcache_guard.unpickling import UNPICKLING_MODULE

log = logging.getLogger(__name__)

ENGINE_DRIVEN_MODULE = "lmcache.v1.multiprocess.modules.engine_driven_transfer"
"""The module whose context release publishes pending reservations (its ``_release_entry`` is replaced)."""
L1_MANAGER_MODULE = "lmcache.v1.distributed.l1_manager"


def _discard_reservations(storage_manager: Any, keys: list[Any], reserved_at: float | None) -> int:
    """Discard the staged (never admitted) reservations of ``keys``; how many were discarded.

    One reserved longer ago than the write TTL is left alone: its buffer may since have gone to another
    writer of the key (the same tag stages every MP write), whose reservation it would discard; an
    expired one is reclaimed by the next reservation of the key (``_reserve_write_without_handover``)."""
    from lmcache.v1.distributed.storage_manager import _L1_WRITE_TAG

    discarded = 0
    for manager in storage_manager._l1_managers_by_id.values():
        if reserved_at is not None and time.monotonic() - reserved_at >= manager._write_ttl_seconds:
            continue
        results = manager.finish_write_and_delete(keys, tag=_L1_WRITE_TAG)
        discarded += sum(1 for error in results.values() if getattr(error, "name", "") == "SUCCESS")
    return discarded


class _ReservationClock:
    """When each pending SHM reservation was made, by LMCache's transfer key ``(instance, key)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[Any, float] = {}

    def made(self, transfer_key: Any) -> None:
        with self._lock:
            self._at[transfer_key] = time.monotonic()

    def take(self, transfer_key: Any) -> float | None:
        with self._lock:
            return self._at.pop(transfer_key, None)


def install_transfer_guard() -> None:
    """Check the version, then make LMCache's server drop unfinished stores instead of admitting them:
    a released (unregistered or reaped) context's pending reservations are discarded, a COMMIT_STORE
    carrying ``contract.STORE_ABORT_PAYLOAD`` discards its reservation (and answers True), and an
    expired reservation's buffer is freed before the key is reserved again. Idempotent."""
    check_lmcache_version()
    transfer = importlib.import_module(ENGINE_DRIVEN_MODULE)
    strategies = importlib.import_module(UNPICKLING_MODULE)
    l1 = importlib.import_module(L1_MANAGER_MODULE)
    module_cls = getattr(transfer, "EngineDrivenTransferModule", None)
    shm_cls = getattr(strategies, "ShmTransferStrategy", None)
    pickle_cls = getattr(strategies, "PickleTransferStrategy", None)
    l1_cls = getattr(l1, "L1Manager", None)
    require_callables(((module_cls, "_release_entry"), (shm_cls, "prepare_store"), (shm_cls, "commit_store"),
                       (pickle_cls, "commit_store"), (l1_cls, "reserve_write"), (l1_cls, "finish_write_and_delete")),
                      "the transfer guard replaces")  # fmt: skip
    if is_guard(module_cls._release_entry):  # type: ignore[union-attr]
        return
    clock = _ReservationClock()
    _guard_release(module_cls, clock)
    _guard_shm_strategy(shm_cls, clock)
    _guard_pickle_strategy(pickle_cls)
    _guard_reserve_write(l1_cls)


def _guard_release(module_cls: Any, clock: _ReservationClock) -> None:
    def release_entry(self: Any, instance_id: int, entry: Any) -> None:
        """LMCache 0.5.6's ``_release_entry`` with its pending writes discarded, not admitted."""
        with self._pending_shm_lock:
            stale_writes = [k for k in self._pending_shm_writes if k[0] == instance_id]
            stale_reads = [k for k in self._pending_shm_reads if k[0] == instance_id]
            writes = [(k, self._pending_shm_writes.pop(k)) for k in stale_writes]
            read_obj_keys = [self._pending_shm_reads.pop(k) for k in stale_reads]
        storage_manager = self._ctx.storage_manager
        for transfer_key, obj_keys in writes:
            reserved_at = clock.take(transfer_key)
            if obj_keys:
                dropped = _discard_reservations(storage_manager, obj_keys, reserved_at)
                log.warning("event=unfinished_store_dropped instance=%d chunks=%d discarded=%d at=release",
                            instance_id, len(obj_keys), dropped)  # fmt: skip
        for obj_keys in read_obj_keys:
            if obj_keys:
                storage_manager.finish_read_prefetched(obj_keys)
        self._ctx.layout_desc_registry.unregister(entry.model_name, entry.world_size)

    module_cls._release_entry = guarded(release_entry)


def _guard_shm_strategy(shm_cls: Any, clock: _ReservationClock) -> None:
    original_prepare, original_commit = shm_cls.prepare_store, shm_cls.commit_store

    @functools.wraps(original_prepare)
    def prepare_store(self: Any, key: Any, instance_id: int, context: Any, resolve_obj_keys: Any) -> Any:
        response = original_prepare(self, key, instance_id, context, resolve_obj_keys)
        if response.context.get("slots"):
            clock.made(self._transfer_key_factory(key, instance_id))
        return response

    @functools.wraps(original_commit)
    def commit_store(
        self: Any, key: Any, instance_id: int, cpu_data: bytes, context: Any, resolve_obj_keys: Any
    ) -> bool:
        transfer_key = self._transfer_key_factory(key, instance_id)
        if cpu_data != contract.STORE_ABORT_PAYLOAD:
            clock.take(transfer_key)
            return bool(original_commit(self, key, instance_id, cpu_data, context, resolve_obj_keys))
        with self._pending_lock:
            obj_keys = self._pending_writes.pop(transfer_key, None)
        reserved_at = clock.take(transfer_key)
        if obj_keys:
            dropped = _discard_reservations(self._storage_manager, obj_keys, reserved_at)
            log.info("event=unfinished_store_dropped instance=%d chunks=%d discarded=%d at=abort",
                     instance_id, len(obj_keys), dropped)  # fmt: skip
        return True

    shm_cls.prepare_store = guarded(prepare_store)
    shm_cls.commit_store = guarded(commit_store)


def _guard_pickle_strategy(pickle_cls: Any) -> None:
    original_commit = pickle_cls.commit_store

    @functools.wraps(original_commit)
    def commit_store(
        self: Any, key: Any, instance_id: int, cpu_data: bytes, context: Any, resolve_obj_keys: Any
    ) -> bool:
        if cpu_data == contract.STORE_ABORT_PAYLOAD:
            return True  # the pickle transport reserves nothing before its COMMIT: nothing to drop
        return bool(original_commit(self, key, instance_id, cpu_data, context, resolve_obj_keys))

    pickle_cls.commit_store = guarded(commit_store)


def _guard_reserve_write(l1_cls: Any) -> None:
    original_reserve = l1_cls.reserve_write

    @functools.wraps(original_reserve)
    def reserve_write(self: Any, keys: Any, is_temporary: Any, layout_desc: Any, tag: str = "") -> Any:
        with self._lock:
            gone = []
            for key in keys:
                staged = self._get_staging(key, tag)
                if staged is not None and not staged.write_lock.is_locked():
                    self._reclaim_staging(key, force=False)  # frees expired reservations only
                    if key not in self._objects and key not in self._staging:
                        gone.append(key)
            self._report_staging_gone(gone)
        return original_reserve(self, keys=keys, is_temporary=is_temporary, layout_desc=layout_desc, tag=tag)

    l1_cls.reserve_write = guarded(reserve_write)
