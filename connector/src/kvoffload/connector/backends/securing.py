"""Secured loads: the server hands out and read-locks a load's chunks for every rank before the
load is promised to TensorRT-LLM, and gets them back once every rank copied them (or never will).

One PREPARE_RETRIEVE of a key at a time in a process: LMCache 0.5.6 files a pending read under
``(instance, key)`` and ``IPCCacheServerKey.request_id`` is excluded from equality, so a second
PREPARE_RETRIEVE of the same range (two identical prompts loading at once) would overwrite the
first's pending read and leave one read lock per chunk and rank behind both. A second load of a key
still secured shares the first's slots (the bytes are read-locked and only read), its own lookup
locks freed; the chunks go back once its last user gave them back. A load of a key whose release is
queued waits for that release to be answered first (a replay's release comes before its re-secure).

``lookup_and_prepare`` looks up and secures in one server call (``kvoffload.secured_lookup``, the
module the sidecar's server and the in-process one load); there the server itself refuses a second
PREPARE_RETRIEVE of a key this instance holds (``held``), and a load still held is shared as above."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from kvoffload import secured_lookup
from kvoffload.connector.backends.chunk_keys import ChunkKeys
from kvoffload.connector.backends.committer import Committer
from kvoffload.connector.backends.connection import ServerConnection
from kvoffload.connector.backends.segments import Segment, Segments
from kvoffload.connector.lmcache_seam import IPCCacheServerKey, ServerModuleCallRequest
from kvoffload.connector.metrics import ConnectorMetrics
from kvoffload.connector.wire import SecuredLoad, SlotRef


@dataclass(frozen=True)
class SecuredHit:
    """What one secured lookup found: ``hit`` tokens (their lookup locks settled by the server), and
    the load of ``[start, end)`` it secured (None: nothing; ``end`` 0 unless the server tried)."""

    hit: int
    start: int
    end: int
    load: SecuredLoad | None
    prepare_s: float
    server_s: float = 0.0
    """Seconds the server spent on the call (0 from a server that does not say)."""


@dataclass
class _LateAnswer:
    """A secured lookup the caller stopped waiting for: what its answer holds is given back once it comes."""

    future: Any
    session_id: str
    token_ids: tuple[int, ...]
    start: int
    salt: str
    prepared_on: tuple[Any, Segment | None]


class SecuredLookupFailed(Exception):
    """The server's secured lookup raised (its message): a miss, and lookups go apart from then on."""


class PrefetchStillRunning(Exception):
    """The server's prefetch of a secured lookup outlived its wait: a miss, its locks still held."""


class _Unsecured(Exception):
    """PREPARE_RETRIEVE handed out fewer chunks than the load needs (a miss, not a failure)."""


class _HeldKey:
    """A load's key as ``Securing`` files it: hashed once (an LMCache key hashes its whole prompt
    each time, 0.1 ms per 32k tokens, and a load's key is filed and found several times)."""

    __slots__ = ("_hash", "key")

    def __init__(self, key: IPCCacheServerKey) -> None:
        self.key = key
        self._hash = hash(key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _HeldKey) and self._hash == other._hash and self.key == other.key


@dataclass
class _Holding:
    """One key's secured load in this process: being secured (``load`` None), shared by ``users``
    loads, or given back (``releasing``: its COMMIT_RETRIEVEs queued, not yet answered)."""

    load: SecuredLoad | None = None
    users: int = 0
    releasing: bool = False


class Securing:
    """PREPARE_RETRIEVE and COMMIT_RETRIEVE of secured loads, under one worker instance (rank 0's)."""

    def __init__(self, *, instance_id: int, chunk_size: int, retrieve_timeout_s: float,
                 connection: ServerConnection, segments: Segments, keys: ChunkKeys, committer: Committer,
                 metrics: ConnectorMetrics) -> None:  # fmt: skip
        self._instance_id = instance_id
        self._chunk_size = chunk_size
        self._timeout_s = retrieve_timeout_s
        self._connection = connection
        self._segments = segments
        self._keys = keys
        self._committer = committer
        self._metrics = metrics
        self._held: dict[_HeldKey, _Holding] = {}
        """Keys of loads secured (or being secured) and not yet given back to the server."""
        self._changed = threading.Condition()
        self._late: list[_LateAnswer] = []

    def held(self) -> int:
        """Secured loads not yet given back to the server (their releases answered)."""
        with self._changed:
            return len(self._held)

    def _hold(self, key: _HeldKey, deadline: float) -> tuple[bool, SecuredLoad | None]:
        """Take ``key`` for one load: (True, None) to secure it, (True, load) to share a load of it
        already secured, (False, None) if neither came by ``deadline`` (another load still secures it,
        or its release is still unanswered)."""
        with self._changed:
            while True:
                holding = self._held.get(key)
                if holding is None:
                    self._held[key] = _Holding()
                    return True, None
                if holding.load is not None and not holding.releasing:
                    holding.users += 1
                    return True, holding.load
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False, None
                self._changed.wait(remaining)

    def _secured(self, key: _HeldKey, load: SecuredLoad) -> None:
        with self._changed:
            self._held[key] = _Holding(load=load, users=1)
            self._changed.notify_all()

    def _give_back(self, key: _HeldKey) -> bool:
        """One user of ``key``'s load is done: True if it was the last (its release is queued next)."""
        with self._changed:
            holding = self._held.get(key)
            if holding is None:
                return True
            holding.users -= 1
            if holding.users > 0:
                return False
            holding.releasing = True
            return True

    def _free(self, key: _HeldKey, holding: _Holding | None = None) -> None:
        """``key`` is no longer held (only if ``holding`` is still its entry: a load secured again
        after its release was answered by the server, before the answer reached here, stays)."""
        with self._changed:
            if holding is None or self._held.get(key) is holding:
                self._held.pop(key, None)
            self._changed.notify_all()

    def _queue_release(self, keys: list[IPCCacheServerKey], held: _HeldKey,
                       prepared_on: tuple[Any, Segment | None]) -> None:  # fmt: skip
        """Queue the COMMIT_RETRIEVEs of ``keys``; ``held`` is free once the last one was answered."""
        if not keys:
            self._free(held)
            return
        with self._changed:
            holding = self._held.get(held)
            if holding is not None:
                holding.releasing = True
        self._give_back_unheld(keys[:-1], prepared_on)
        self._committer.later("retrieve", keys[-1], None, prepared_on, on_done=lambda: self._free(held, holding))

    def prepare(self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
                ) -> SecuredLoad | None:  # fmt: skip
        """PREPARE_RETRIEVE ``[start, end)`` for every rank.

        The server hands out the chunks' L1 slots and keeps them read-locked until COMMIT_RETRIEVE;
        the slots live in the shared-memory segment every worker maps, so from here on the load is
        a local copy even if the server dies. None, with nothing left held, unless every chunk of
        every rank was handed out within the retrieve timeout: the time a load may take, spent here
        instead of in ``start_load_kv`` (also waiting for a store that holds the transfer context).
        """
        if not self._connection.is_up() or self._segments.segment is None:
            return None
        deadline = time.monotonic() + self._timeout_s
        held = _HeldKey(self._keys.key(session_id, token_ids, start, end, salt, worker=True, rank=0))
        taken, shared = self._hold(held, deadline)
        if shared is not None:  # read from the slots another load of this key secured
            self._segments.secured_opened(shared.segment)
            self._free_lookup_locks(session_id, token_ids, start, end, salt)
            return shared
        if not taken:
            self._metrics.error("retrieve", "miss")
            self._free_lookup_locks(session_id, token_ids, start, end, salt)
            return None
        if not self._segments.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            self._free(held)
            self._free_lookup_locks(session_id, token_ids, start, end, salt)
            return None
        asked: list[IPCCacheServerKey] = []
        transfer, segment = self._segments.transfer, self._segments.segment
        try:
            if transfer is None or segment is None:
                self._free(held)
                return None
            client = transfer.engine_driven_context.req_client
            chunks = (end - start) // self._chunk_size
            per_rank = []
            # Every rank is asked even after a miss: each PREPARE takes over that rank's lookup locks
            # (released by the server on a miss, by our COMMIT otherwise), so none is left behind.
            # All ranks' PREPAREs go out before the first answer is awaited: one round trip, not one
            # per rank (each names its own rank's chunks).
            pending = []
            for key in self._keys.of_every_rank(session_id, token_ids, start, end, salt):
                asked.append(key)
                pending.append(client.prepare_retrieve(key, self._instance_id))
            for future in pending:
                response = future.result(timeout=max(0.0, deadline - time.monotonic()) + 0.05)
                slots = response.context.get("slots") if response.success else None
                if slots and len(slots) == chunks:
                    per_rank.append(tuple(
                        SlotRef(int(d["offset"]), int(d["length"]), tuple(d["shape"]), str(d["dtype"])) for d in slots
                    ))  # fmt: skip
            if len(per_rank) != self._keys.world_size:
                raise _Unsecured
            self._segments.secured_opened(segment)  # its segment stays mapped until commit
            load = SecuredLoad(segment, tuple(per_rank))
            self._secured(held, load)
            return load
        except _Unsecured:
            self._metrics.error("retrieve", "miss")
        except Exception as exc:
            self._connection.request_failed("retrieve", exc, transfer.engine_driven_context.req_client)
        finally:
            self._segments.lock.release()
        self._queue_release(asked, held, (transfer, segment))  # whatever was handed out goes back
        if not asked:
            self._free_lookup_locks(session_id, token_ids, start, end, salt)
        return None

    def lookup_and_prepare(self, client: Any, lookup_key: IPCCacheServerKey, start: int, cap: int, wait_s: float,
                           deadline: float) -> SecuredHit | None:  # fmt: skip
        """LOOKUP of ``lookup_key`` and PREPARE_RETRIEVE of ``[start, min(hit, cap))`` for every rank
        in one call on ``client`` (``kvoffload.secured_lookup``): the server hashes the prompt once
        and settles every lookup lock of the hit. None when it cannot (no such module: the caller
        looks up and secures apart). Raises what the call raised, ``SecuredLookupFailed`` when the
        server's module raised, ``PrefetchStillRunning`` when the prefetch outlived ``wait_s``. What a late answer
        secured is given back when it comes (the server gives back itself what it secures after
        ``give_back_s``)."""
        self._settle_late()
        if not self._connection.is_up() or self._segments.segment is None:
            return None
        if not self._segments.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the transfer context stayed busy")
        try:
            transfer, segment = self._segments.transfer, self._segments.segment
            if transfer is None or segment is None:
                return None
            session_id, salt, tokens = lookup_key.request_id, lookup_key.cache_salt, lookup_key.token_ids
            rank_keys = self._keys.of_every_rank(session_id, tokens, start, start, salt)
            request = secured_lookup.SecuredLookupRequest(
                lookup_key={name: getattr(lookup_key, name) for name in secured_lookup.KEY_FIELDS},
                rank_keys=tuple({name: getattr(key, name) for name in secured_lookup.KEY_FIELDS} for key in rank_keys),
                token_ids=tokens[: lookup_key.end], start=start, cap=cap, instance_id=self._instance_id,
                wait_s=wait_s, budget_s=max(0.0, deadline - time.monotonic()),
                give_back_s=max(0.0, deadline - time.monotonic()) + self._timeout_s / 2,
            )  # fmt: skip
            try:
                payload = secured_lookup.encode_request(request)
            except OverflowError:  # a token id outside uint32: LMCache's own requests carry any integer
                return None
            future = client.server_module_call(ServerModuleCallRequest(method=secured_lookup.METHOD, payload=payload))
            try:
                response = future.result(timeout=max(0.0, deadline - time.monotonic()) + self._timeout_s)
            except Exception:
                with self._changed:
                    self._late.append(_LateAnswer(future, session_id, tokens, start, salt, (transfer, segment)))
                raise
            if not response.success:
                raise SecuredLookupFailed(response.error[:500])
            answer = secured_lookup.decode_answer(response.payload)
            if answer.hit is None:
                raise PrefetchStillRunning
            load = self._take(session_id, tokens, start, salt, answer, (transfer, segment))
            return SecuredHit(answer.hit, start, answer.end, load, answer.prepare_s, answer.server_s)
        finally:
            self._segments.lock.release()

    def _take(self, session_id: str, token_ids: tuple[int, ...], start: int, salt: str,
              answer: secured_lookup.SecuredLookupAnswer, prepared_on: tuple[Any, Segment]) -> SecuredLoad | None:  # fmt: skip
        """The load an answer secured, or the one of its key this process still holds (shared, what
        the answer handed out given back); else None, with whatever it handed out given back."""
        if answer.end <= start or answer.given_back:
            return None
        keys = self._keys.of_every_rank(session_id, token_ids[: answer.end], start, answer.end, salt)
        held, chunks = _HeldKey(keys[0]), (answer.end - start) // self._chunk_size
        per_rank = tuple(
            tuple(SlotRef(s.offset, s.length, s.shape, s.dtype) for s in rank)
            for rank in answer.slots if rank is not None and len(rank) == chunks
        )  # fmt: skip
        with self._changed:
            holding = self._held.get(held)
            if holding is not None and holding.load is not None and not holding.releasing:
                holding.users += 1  # a load of this key still held (by a server before this one, too)
                self._segments.secured_opened(holding.load.segment)
                shared = holding.load
            elif answer.held:
                shared = None  # held by the server for a release still on its way: promise nothing
            elif len(per_rank) == self._keys.world_size:
                load = SecuredLoad(prepared_on[1], per_rank)
                self._held[held] = _Holding(load=load, users=1)  # replaces one whose release was answered
                self._segments.secured_opened(prepared_on[1])
                return load
            else:
                self._held[held] = _Holding()  # given back next
                self._metrics.error("retrieve", "miss")
                self._queue_release(keys, held, prepared_on)
                return None
        if shared is None:
            self._metrics.error("retrieve", "miss")
        elif not answer.held:
            self._give_back_unheld(keys, prepared_on)
        return shared

    def _settle_late(self) -> None:
        """Give back what late answers secured (those that came by now)."""
        with self._changed:
            if not self._late:
                return
            done = [late for late in self._late if late.future.query()]
            self._late = [late for late in self._late if late not in done]
        for late in done:
            try:
                response = late.future.result(timeout=0)
                answer = secured_lookup.decode_answer(response.payload) if response.success else None
            except Exception:  # the call failed: the server secured nothing it answered for
                answer = None
            if answer is not None and answer.end > late.start and not (answer.held or answer.given_back):
                keys = self._keys.of_every_rank(late.session_id, late.token_ids[: answer.end], late.start, answer.end,
                                                late.salt)  # fmt: skip
                self._give_back_unheld(keys, late.prepared_on)

    def _give_back_unheld(self, keys: list[IPCCacheServerKey], prepared_on: tuple[Any, Segment | None]) -> None:
        """Queue the COMMIT_RETRIEVEs of chunks handed out that no load of this process holds."""
        for key in keys:
            self._committer.later("retrieve", key, None, prepared_on)

    def _free_lookup_locks(self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str) -> None:
        """Release the lookup read locks of ``[start, end)`` that no PREPARE_RETRIEVE took over."""
        if not self._connection.is_up():
            return
        key = self._keys.key(session_id, token_ids, start, end, salt, worker=False)
        try:
            self._connection.client.free_lookup_locks(key, 1)
        except Exception as exc:
            self._connection.request_failed("retrieve", exc, self._connection.client)

    def commit(self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str,
               segment: Segment) -> None:  # fmt: skip
        """Queue the COMMIT_RETRIEVEs (every rank's key) that release a secured load's chunks; its
        segment, if replaced meanwhile, may be unmapped once no other load secured in it is open."""
        keys = self._keys.of_every_rank(session_id, token_ids, start, end, salt)
        held = _HeldKey(keys[0])
        if self._give_back(held):
            self._queue_release(keys, held, (None, segment))
        self._segments.secured_closed(segment)
