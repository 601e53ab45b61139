"""The seam to the internals of LMCache's cache server wherever kvoffload runs one (the sidecar's
``kvoffload.sidecar.lmcache_server``, the connector's in-process backend): the LMCache version it
was written for, the restricted unpickler it puts in place of LMCache's, and what KV events for
routers need of its internals: the cache-key events of its event bus
(:func:`subscribe_cache_key_events`) and its own chunk hashes (:func:`resolve_chunk_hashes`). The
connector's client side has its own seam, ``kvoffload.connector.lmcache_seam``.

Why: LMCache 0.5.6 unpickles the ``cpu_data`` of every engine-driven COMMIT_STORE that
carries bytes (``v1/multiprocess/modules/server_transfer.py``, ``pickle.loads``), from any
client that reaches its request port, authenticated or not. A pickle may name any callable,
so a foreign client could run code in the cache server. Here that module's ``pickle`` is
replaced by one whose ``loads`` runs no pickle machinery at all: ``kvoffload.tensor_payload`` reads
the opcodes of what LMCache's pickle transport sends (a list of CPU tensors) with a stack machine of
its own, hands no real function or existing object to the payload, fills each storage from exactly
the bytes sent and checks every tensor's geometry against it. Anything else is refused before a
tensor is built, and the COMMIT fails as a bad payload would: one keyholder can neither change how
the server rebuilds other clients' tensors nor make it store (and hand back) memory it never wrote.

Node mode also authenticates the request port (``require_curve_clients``): LMCache 0.5.6 builds its
request server on ``zmq.Context.instance()`` (``transport/zmq_impl/server.py``); here that module's
``MessageQueueServer`` gets a context of its own whose sockets are CURVE servers, with a ZAP
handler that admits only the policy's client key. A client without it never completes the
handshake, so none of its frames reaches a handler (store, lookup, clear, the unpickler).

Unfinished stores are dropped, never admitted (:func:`install_transfer_guard`). LMCache 0.5.6 keeps a
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

import argparse
import functools
import importlib
import importlib.metadata
import logging
import pickle
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload import contract
from kvoffload.cache_keys import ServerKeys
from kvoffload.log_budget import LogBudget

log = logging.getLogger("kvoffload.lmcache_guard")

SUPPORTED_LMCACHE_VERSIONS = ("0.5.6",)
"""LMCache releases kvoffload was checked against: the server internals this module replaces or reads,
and the private client names ``kvoffload.connector.lmcache_seam`` uses."""
UNPICKLING_MODULE = "lmcache.v1.multiprocess.modules.server_transfer"
"""The one module of the server that unpickles request data (its ``pickle`` global is replaced)."""
REQUEST_SERVER_MODULE = "lmcache.v1.multiprocess.transport.zmq_impl.server"
"""The module that builds the request port's ``MessageQueueServer`` (its name there is replaced)."""
ENGINE_DRIVEN_MODULE = "lmcache.v1.multiprocess.modules.engine_driven_transfer"
"""The module whose context release publishes pending reservations (its ``_release_entry`` is replaced)."""
STORAGE_MANAGER_MODULE = "lmcache.v1.distributed.storage_manager"
L1_MANAGER_MODULE = "lmcache.v1.distributed.l1_manager"
ZAP_DOMAIN = "kvoffload-cache"
_AUTHENTICATORS: list[Any] = []


class LMCacheVersionError(RuntimeError):
    """The installed LMCache is not one kvoffload was written for (or no longer has what it replaces)."""


def restricted_loads(data: bytes) -> list[Any]:
    """``pickle.loads`` for LMCache's tensor payloads only (``tensor_payload.decode_tensor_list``: no
    pickle machinery runs); raises ``TensorPayloadError`` (a ``pickle.UnpicklingError``) for anything else."""
    from kvoffload.tensor_payload import decode_tensor_list  # torch is imported only by servers

    return decode_tensor_list(data)


def installed_lmcache_version() -> str:
    """The installed LMCache's version; raises ``LMCacheVersionError`` when none is installed."""
    try:
        return importlib.metadata.version("lmcache")
    except importlib.metadata.PackageNotFoundError as exc:
        raise LMCacheVersionError("LMCache is not installed") from exc


def check_lmcache_version(
    who: str = "server guard",
    what_to_do: str = "check where it unpickles before allowing it",
    version: str | None = None,
) -> str:
    """kvoffload's one LMCache version check: ``version`` (default: the installed one) when it is in
    ``SUPPORTED_LMCACHE_VERSIONS``, else ``LMCacheVersionError`` in one line naming both, ``who``
    refuses it and ``what_to_do``. The server guard, the KV-event module and the connector's seam call it."""
    version = installed_lmcache_version() if version is None else version
    if version not in SUPPORTED_LMCACHE_VERSIONS:
        raise LMCacheVersionError(
            f"LMCache {version} is installed; kvoffload's {who} was written for LMCache "
            f"{', '.join(SUPPORTED_LMCACHE_VERSIONS)} ({what_to_do})"
        )
    return version


def install_restricted_unpickler() -> None:
    """Check the version, then make LMCache's server unpickle request data with ``restricted_loads``.

    Fails (``LMCacheVersionError``) rather than start a server whose unpickling site moved.
    """
    check_lmcache_version()
    target = importlib.import_module(UNPICKLING_MODULE)
    current = getattr(target, "pickle", None)
    if current is not pickle and not _is_guard(current):
        raise LMCacheVersionError(f"{UNPICKLING_MODULE} no longer unpickles through its 'pickle' global")
    target.pickle = types.SimpleNamespace(  # type: ignore[attr-defined]
        loads=restricted_loads,
        dumps=pickle.dumps,
        UnpicklingError=pickle.UnpicklingError,
        kvoffload_guard=True,
    )


def run_lmcache_cli(arguments: Sequence[str]) -> None:
    """Run LMCache's own command line (``lmcache server ...``) in this process."""
    import lmcache.cli.main as cli

    sys.argv = ["lmcache", *arguments]
    cli.main(list(arguments))


def preload_lmcache_server() -> None:
    """Import what ``lmcache server`` imports when it runs (``lmcache.cli.commands.server``) and
    build its parser once, which imports every registered L2 adapter (its ``--help`` lists them),
    then put the restricted unpickler in place: a server forked from this process starts warm."""
    import lmcache.cli.main
    import lmcache.v1.distributed.config
    import lmcache.v1.mp_observability.config
    import lmcache.v1.multiprocess.config
    import lmcache.v1.multiprocess.http_server  # noqa: F401
    from lmcache.cli.commands import register_commands

    register_commands(argparse.ArgumentParser(prog="lmcache").add_subparsers(dest="command"), ["server"])
    install_restricted_unpickler()


def server_module_handler(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """LMCache's decorator that registers a server module's method as the handler of ``method``."""
    from lmcache.v1.multiprocess.ext_server_module import server_module_handler as lmcache_handler

    return lmcache_handler(method)


def _is_guard(value: object) -> bool:
    return bool(getattr(value, "kvoffload_guard", False))


def unpickler_is_restricted() -> bool:
    """Whether this process's LMCache server unpickles through ``restricted_loads``."""
    module = sys.modules.get(UNPICKLING_MODULE)
    return module is not None and _is_guard(getattr(module, "pickle", None))


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


class AllowedClients:
    """pyzmq's ZAP credentials provider: admits the listed Z85 client keys, logs refusals (on a
    budget: a stranger retrying its handshake in a loop gets a few lines and a count)."""

    def __init__(self, allowed: frozenset[str], refusals: LogBudget | None = None) -> None:
        self._allowed = allowed
        self._refusals = refusals or LogBudget(log)

    def callback(self, domain: str, key: bytes) -> bool:
        allowed = key.decode("ascii", "replace") in self._allowed
        if not allowed:
            self._refusals.warning("event=cache_client_refused reason=unknown_key domain=%s", domain)
        return allowed


def curve_server_context(keys: ServerKeys) -> Any:
    """A ``zmq.Context`` whose every socket is a CURVE server with ``keys``, and its running ZAP
    handler admitting only ``keys.allowed_clients`` (it lives as long as the process)."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator

    context = zmq.Context()
    authenticator = ThreadAuthenticator(context, log=log)
    authenticator.start()
    authenticator.configure_curve_callback(ZAP_DOMAIN, credentials_provider=AllowedClients(keys.allowed_clients))
    # Set after the ZAP socket exists: context-level options apply to the sockets created later.
    context.setsockopt(zmq.CURVE_SERVER, 1)
    context.setsockopt(zmq.CURVE_SECRETKEY, keys.secret.encode("ascii"))
    context.setsockopt(zmq.CURVE_PUBLICKEY, keys.public.encode("ascii"))
    context.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode("ascii"))
    _AUTHENTICATORS.append(authenticator)  # stopped when collected: it lives as long as the process
    return context


def require_curve_clients(keys: ServerKeys) -> None:
    """Check the version, then make LMCache's request server a CURVE server admitting only
    ``keys.allowed_clients``. Call before the server starts."""
    check_lmcache_version()
    target = importlib.import_module(REQUEST_SERVER_MODULE)
    original = getattr(target, "MessageQueueServer", None)
    if original is None or _is_guard(original):
        raise LMCacheVersionError(f"{REQUEST_SERVER_MODULE} no longer builds a MessageQueueServer")
    curve_context = curve_server_context(keys)

    def authenticated_server(bind_url: str, context: Any = None) -> Any:
        del context  # LMCache passes zmq.Context.instance(): its sockets would admit anyone
        return original(bind_url=bind_url, context=curve_context)

    authenticated_server.kvoffload_guard = True  # type: ignore[attr-defined]
    target.MessageQueueServer = authenticated_server  # type: ignore[attr-defined]


# --- unfinished stores: dropped, never admitted -------------------------------------------------------


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
    for owner, name in ((module_cls, "_release_entry"), (shm_cls, "prepare_store"), (shm_cls, "commit_store"),
                        (pickle_cls, "commit_store"), (l1_cls, "reserve_write"), (l1_cls, "finish_write_and_delete")):  # fmt: skip
        if owner is None or not callable(getattr(owner, name, None)):
            raise LMCacheVersionError(f"LMCache no longer has the {name} the transfer guard replaces")
    if _is_guard(module_cls._release_entry):  # type: ignore[union-attr]
        return
    clock = _ReservationClock()
    _guard_release(module_cls, clock)
    _guard_shm_strategy(shm_cls, clock)
    _guard_pickle_strategy(pickle_cls)
    _guard_reserve_write(l1_cls)


def _guarded(function: Callable[..., Any]) -> Callable[..., Any]:
    function.kvoffload_guard = True  # type: ignore[attr-defined]
    return function


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

    module_cls._release_entry = _guarded(release_entry)


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

    shm_cls.prepare_store = _guarded(prepare_store)
    shm_cls.commit_store = _guarded(commit_store)


def _guard_pickle_strategy(pickle_cls: Any) -> None:
    original_commit = pickle_cls.commit_store

    @functools.wraps(original_commit)
    def commit_store(
        self: Any, key: Any, instance_id: int, cpu_data: bytes, context: Any, resolve_obj_keys: Any
    ) -> bool:
        if cpu_data == contract.STORE_ABORT_PAYLOAD:
            return True  # the pickle transport reserves nothing before its COMMIT: nothing to drop
        return bool(original_commit(self, key, instance_id, cpu_data, context, resolve_obj_keys))

    pickle_cls.commit_store = _guarded(commit_store)


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

    l1_cls.reserve_write = _guarded(reserve_write)
