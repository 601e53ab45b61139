"""The cache server's side of ``kvoffload.secured_lookup``: LOOKUP, WAIT and PREPARE_RETRIEVE of a
hit in one server call (an LMCache server module, ``--server-module``).

A hit's lookup and securing run inside the engine iteration that schedules it; as three requests
they cost three round trips, and LMCache decodes and hashes the whole prompt for each request that
carries it (docs/results/cpu-lookup/lookup-and-secure-parts.md). Here LMCache's own handlers run in
turn on one request whose tokens travel as raw uint32; the prompt's chunk hashes are computed once
(blake3 over the packed tokens, checked at start against LMCache's own hasher) and handed to the
request's session, so PREPARE_RETRIEVE does not hash it again. What LMCache's handlers do is
unchanged: the same prefetch and read locks, the same pending read filed per key and instance, the
same refusals.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

from kvoffload import secured_lookup as wire
from kvoffload.lmcache_guard import LMCacheVersionError, check_lmcache_version
from kvoffload.lmcache_guard.server_cli import server_module_handler

KEY_MODULE = "lmcache.v1.multiprocess.custom_types"
SERVER_MODULE_ARGS = ("--server-module", json.dumps({"module_path": __name__}))
"""LMCache server arguments loading this module (the sidecar's server and the in-process one)."""


def with_secured_lookups(arguments: list[str]) -> list[str]:
    """LMCache server ``arguments`` loading this module too (unchanged if they load it already)."""
    return arguments if SERVER_MODULE_ARGS[1] in arguments else [*arguments, *SERVER_MODULE_ARGS]


def blake3_chain(hasher: Any) -> Callable[[array[int], int], list[bytes]] | None:
    """A function hashing the first ``n`` chunks of a token array as ``hasher`` (LMCache's
    ``TokenHasher``) does, from packed bytes; None unless ``hasher`` hashes with blake3 and the
    function agrees with it on a sample prompt."""
    if getattr(hasher, "hash_algorithm_name", None) != "blake3" or not isinstance(hasher.none_hash, bytes):
        return None
    import blake3

    chunk = int(hasher.chunk_size)
    none_hash: bytes = hasher.none_hash

    def chain(tokens: array[int], chunks: int) -> list[bytes]:
        packed = array("I", tokens[: chunks * chunk])
        if sys.byteorder == "little":
            packed.byteswap()  # LMCache packs big-endian (">I")
        view, width = memoryview(packed.tobytes()), 4 * chunk
        prefix, hashes = none_hash, []
        for i in range(chunks):
            digest = blake3.blake3(prefix)
            digest.update(view[i * width : (i + 1) * width])
            prefix = digest.digest()
            hashes.append(prefix)
        return hashes

    sample = array("I", ((i * 2654435761) & 0xFFFFFFFF for i in range(2 * chunk + 1)))  # every bit varies
    theirs = hasher.compute_chunk_hashes(list(sample))
    return chain if chain(sample, 2) == theirs else None


class _Tokens(tuple):
    """A prompt's token ids, hashed once: LMCache hashes a key, all its tokens, each time it files or
    finds it (the pending read, the held check), 0.1 ms per 32k tokens."""

    def __hash__(self) -> int:
        cached: int | None = self.__dict__.get("hash")
        if cached is None:
            cached = self.__dict__["hash"] = tuple.__hash__(self)
        return cached


class PromptHashes:
    """LMCache's ``TokenHasher`` as its LOOKUP and lock release reach it (``ctx.token_hasher``): on a
    secured lookup's thread, the chunk hashes it computed of its prompt; anywhere else, LMCache's own.
    A secured lookup builds every key it hands LMCache from that one prompt."""

    def __init__(self, hasher: Any) -> None:
        self.hasher = hasher
        self._prompt = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.hasher, name)

    def hashed(self, tokens: int, hashes: list[bytes] | None) -> None:
        """This thread's prompt from now on: ``tokens`` long, its chunks' ``hashes`` (None: no prompt)."""
        self._prompt.value = None if hashes is None else (tokens, hashes)

    def compute_chunk_hashes(self, token_ids: list[int], prefix_hash: Any = None, start: int = 0,
                             end: int | None = None) -> list[bytes]:  # fmt: skip
        """``TokenHasher.compute_chunk_hashes``, answered from this thread's prompt where it is that prompt."""
        prompt = getattr(self._prompt, "value", None)
        if prompt is None or prefix_hash is not None or len(token_ids) != prompt[0]:
            return self.hasher.compute_chunk_hashes(token_ids, prefix_hash, start, end)
        chunk = self.hasher.chunk_size
        effective = len(token_ids) if end is None else min(len(token_ids), end)
        return prompt[1][-(-start // chunk) : effective // chunk]


class SecuredLookups:
    """The ``kvoffload.secured_lookup`` handler over LMCache's lookup and engine-driven transfer modules."""

    def __init__(self, ctx: Any, lookup: Any, transfer: Any, key_cls: Any) -> None:
        self._ctx = ctx
        self._lookup = lookup
        self._transfer = transfer
        self._key = key_cls
        hasher = ctx.token_hasher
        self._chain = blake3_chain(hasher.hasher if isinstance(hasher, PromptHashes) else hasher)
        self._prompt_hashes: PromptHashes | None = None
        if self._chain is not None:
            if not isinstance(hasher, PromptHashes):
                hasher = ctx._token_hasher = PromptHashes(hasher)
            self._prompt_hashes = hasher
        self.counts = {"calls": 0, "secured": 0, "held": 0, "late": 0}

    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict[str, Any]:
        return {"kvoffload_secured_lookups": dict(self.counts, hash_once=self._chain is not None)}

    def close(self) -> None:
        return None

    @server_module_handler(wire.METHOD)
    def secured_lookup(self, payload: bytes) -> bytes:
        """One ``SecuredLookupRequest`` in, its ``SecuredLookupAnswer`` out."""
        arrived = time.monotonic()
        if payload == wire.PROBE:
            return wire.PROBE_ANSWER
        request, packed = wire.decode_request(payload)
        self.counts["calls"] += 1
        hashes = self._chain(packed, len(packed) // self._ctx.chunk_size) if self._chain is not None else None
        if self._prompt_hashes is not None:
            self._prompt_hashes.hashed(len(packed), hashes)
        try:
            answer = self._look_up_and_secure(request, packed, hashes, arrived)
        finally:
            if self._prompt_hashes is not None:
                self._prompt_hashes.hashed(0, None)
        return wire.encode_answer(dataclasses.replace(answer, server_s=time.monotonic() - arrived))

    def _look_up_and_secure(self, request: wire.SecuredLookupRequest, packed: array[int],
                            hashes: list[bytes] | None, arrived: float) -> wire.SecuredLookupAnswer:  # fmt: skip
        tokens = _Tokens(packed.tolist())
        session_id = str(request.lookup_key["request_id"])
        lookup_key = self._key(**request.lookup_key, token_ids=tokens, start=0, end=len(tokens))
        self._lookup.lookup(lookup_key, 1)
        chunks = self._lookup.wait_prefetch_status(session_id, request.wait_s)
        if chunks is None:
            return wire.SecuredLookupAnswer(hit=None)
        hit = int(chunks) * self._ctx.chunk_size
        end = min(hit, request.cap)
        if end <= request.start or time.monotonic() - arrived > request.budget_s:
            self.counts["late"] += end > request.start
            self._free(lookup_key, 0, hit)
            return wire.SecuredLookupAnswer(hit=hit)
        load_tokens = tokens if end == len(tokens) else _Tokens(tokens[:end])
        rank_keys = [self._key(**fields, token_ids=load_tokens, start=request.start, end=end)
                     for fields in request.rank_keys]  # fmt: skip
        if self._held(rank_keys, request.instance_id):
            self.counts["held"] += 1
            self._free(lookup_key, 0, hit)
            return wire.SecuredLookupAnswer(hit=hit, end=end, held=True)
        self._free(lookup_key, 0, request.start)
        self._free(lookup_key, end, hit)
        if hashes is not None:
            self._hand_to_session(session_id, hashes[: end // self._ctx.chunk_size])
        started = time.perf_counter()
        slots = tuple(self._prepare(key, request.instance_id) for key in rank_keys)
        prepare_s = time.perf_counter() - started
        if time.monotonic() - arrived > request.give_back_s:  # nobody waits for these slots any more
            self.counts["late"] += 1
            for key in rank_keys:
                self._transfer.commit_retrieve(key, request.instance_id)
            return wire.SecuredLookupAnswer(hit=hit, end=end, given_back=True, prepare_s=prepare_s)
        self.counts["secured"] += 1
        return wire.SecuredLookupAnswer(hit=hit, end=end, slots=slots, prepare_s=prepare_s)

    def _free(self, lookup_key: Any, start: int, end: int) -> None:
        if end > start:
            self._lookup.free_lookup_locks(self._key_range(lookup_key, start, end), 1)

    def _key_range(self, key: Any, start: int, end: int) -> Any:
        fields = {name: getattr(key, name) for name in wire.KEY_FIELDS}
        return self._key(**fields, token_ids=key.token_ids, start=start, end=end)

    def _held(self, rank_keys: list[Any], instance_id: int) -> bool:
        """Whether this instance holds a pending read of one of ``rank_keys`` (a load secured, not yet
        committed): a second PREPARE_RETRIEVE would replace it and strand its read locks."""
        module = self._transfer
        with module._pending_shm_lock:
            return any(module._make_transfer_key(key, instance_id) in module._pending_shm_reads for key in rank_keys)

    def _hand_to_session(self, session_id: str, hashes: list[bytes]) -> None:
        """Hand the prompt's chunk hashes to its session: PREPARE_RETRIEVE reads them there (LOOKUP
        set the session's tokens)."""
        session = self._ctx.session_manager.get_or_create(session_id)
        with session._lock:
            session.chunk_hashes = list(hashes)
            session.last_prefix_hash = hashes[-1] if hashes else None
            session.num_chunks_processed = len(hashes)

    def _prepare(self, key: Any, instance_id: int) -> tuple[wire.SlotDescription, ...] | None:
        response = self._transfer.prepare_retrieve(key, instance_id)
        slots = response.context.get("slots") if response.success else None
        if not slots:
            return None
        return tuple(wire.SlotDescription(int(s["offset"]), int(s["length"]), tuple(s["shape"]), str(s["dtype"]))
                     for s in slots)  # fmt: skip


def _module_named(modules: Any, name: str) -> Any:
    found = [m for m in modules if type(m).__name__ == name]
    if len(found) != 1:
        raise LMCacheVersionError(f"LMCache's server has {len(found)} {name}s; the secured lookup needs one")
    return found[0]


def build_server_modules(build: Any) -> SecuredLookups:
    """LMCache's server-module factory (``ExtServerModuleBuildContext`` in, the module out)."""
    check_lmcache_version("secured lookup", "it runs LMCache's lookup and transfer handlers")
    transfer = _module_named(build.modules, "EngineDrivenTransferModule")
    for name in ("_pending_shm_lock", "_pending_shm_reads", "_make_transfer_key", "prepare_retrieve"):
        if not hasattr(transfer, name):
            raise LMCacheVersionError(f"LMCache's EngineDrivenTransferModule no longer has {name}")
    if not hasattr(build.server_context, "_token_hasher"):
        raise LMCacheVersionError("LMCache's server context no longer keeps its token hasher as _token_hasher")
    key_cls = importlib.import_module(KEY_MODULE).IPCCacheServerKey
    return SecuredLookups(build.server_context, _module_named(build.modules, "LookupModule"), transfer, key_cls)
