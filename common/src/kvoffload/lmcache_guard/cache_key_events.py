"""What KV events for routers read of LMCache's server: the cache-key events of its event bus and its
own chunk hashes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KeyTriple = tuple[str, bytes, str]
"""An LMCache object key as KV events need it: (model name, chunk hash, cache salt)."""


@dataclass(frozen=True)
class CacheKeysChanged:
    """One of LMCache's cache-key events, in plain values: a tier took or dropped these keys."""

    tier: str
    """``l1`` (host memory) or ``l2`` (an L2 adapter)."""
    stored: bool
    """True: the tier took the keys (for L1: loaded back from an L2); False: it dropped them (evicted
    or deleted)."""
    keys: tuple[KeyTriple, ...]
    backend: str = ""
    """The L2 adapter's type as LMCache names it (``fs_native``, ``resp``); empty for L1."""
    shared: bool = False
    """The L2 adapter was configured as shared by several servers."""


def _key_triples(metadata: dict[str, Any]) -> tuple[KeyTriple, ...]:
    return tuple((k.model_name, k.chunk_hash, k.cache_salt) for k in metadata.get("keys", ()))


def subscribe_cache_key_events(event_bus: Any, on_change: Callable[[CacheKeysChanged], None]) -> None:
    """Call ``on_change`` (on the bus's thread) when L1 evicts keys or takes them back from an L2 (a
    prefetch), and when an L2 adapter stores or deletes keys (LMCache 0.5.6's ``L1_KEYS_EVICTED``,
    ``L1_WRITE_FINISHED_AND_READ_RESERVED``, which only its prefetch controller causes,
    ``L2_KEYS_STORED``, ``L2_KEYS_DELETED``, whose metadata carry ``keys`` and, for L2, ``backend``
    and ``shared``; an L2 eviction is a delete). The engine's own stores into L1 are not passed on:
    the connector reports them, with their tokens."""
    from lmcache.v1.mp_observability.event import EventType

    def l1_evicted(event: Any) -> None:
        on_change(CacheKeysChanged("l1", False, _key_triples(event.metadata)))

    def l1_loaded(event: Any) -> None:
        on_change(CacheKeysChanged("l1", True, _key_triples(event.metadata)))

    def l2(stored: bool) -> Callable[[Any], None]:
        def handle(event: Any) -> None:
            meta = event.metadata
            on_change(CacheKeysChanged("l2", stored, _key_triples(meta), str(meta.get("backend", "")),
                                       bool(meta.get("shared", False))))  # fmt: skip

        return handle

    event_bus.subscribe(EventType.L1_KEYS_EVICTED, l1_evicted)
    event_bus.subscribe(EventType.L1_WRITE_FINISHED_AND_READ_RESERVED, l1_loaded)
    event_bus.subscribe(EventType.L2_KEYS_STORED, l2(True))
    event_bus.subscribe(EventType.L2_KEYS_DELETED, l2(False))


def resolve_chunk_hashes(
    server_context: Any, cache_model: str, world_size: int, token_ids: Sequence[int], end: int, salt: str = ""
) -> list[bytes]:
    """The hashes of a prompt's chunks up to token ``end``, as the server keys them under ``salt`` (its
    own hasher, LMCache 0.5.6's ``MPCacheServerContext.resolve_obj_keys``), on a throwaway session so
    that no request's own session is touched."""
    from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

    session = f"kvoffload-kv-events-{threading.get_ident()}"
    key = IPCCacheServerKey(
        model_name=cache_model,
        world_size=world_size,
        worker_id=0,
        token_ids=token_ids,
        start=0,
        end=end,
        request_id=session,
        cache_salt=salt,
        num_kv_readers=1,
    )
    try:
        keys = server_context.resolve_obj_keys(key, [0])[0]
    finally:
        server_context.session_manager.remove(session)
    # Keys come per chunk and KV rank; the chunk's hash is the same on every rank.
    hashes: list[bytes] = []
    for object_key in keys:
        if not hashes or hashes[-1] != object_key.chunk_hash:
            hashes.append(object_key.chunk_hash)
    return hashes
