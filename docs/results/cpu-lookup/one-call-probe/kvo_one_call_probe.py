"""A measurement probe, not part of kvoffload: an LMCache MP server module whose one call runs
LMCache's own LOOKUP, WAIT and PREPARE_RETRIEVE handlers in turn, server-side, and returns the
slots with each handler's time. ``one_call_probe.py`` loads it with ``--server-module``.

It skips what the connector's securing guards (one PREPARE of a key at a time in a process, shared
loads, lookup locks of ranges not loaded), so it is only fit to time one request at a time."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.ext_server_module import server_module_handler

METHOD = "kvoffload_probe.lookup_prepare"


class OneCallProbe:
    """LOOKUP + WAIT + PREPARE_RETRIEVE of rank 0 in one server module call."""

    def __init__(self, modules: Any, ctx: Any) -> None:
        self._ctx = ctx
        self._lookup = next(m for m in modules if type(m).__name__ == "LookupModule")
        self._transfer = next(m for m in modules if type(m).__name__ == "EngineDrivenTransferModule")

    @property
    def context(self) -> Any:
        return self._ctx

    def report_status(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass

    @server_module_handler(METHOD)
    def lookup_prepare(self, payload: bytes) -> bytes:
        """Payload (msgpack): tokens, model, end, session, chunk, start, cap, instance."""
        t0 = time.perf_counter()
        req = msgspec.msgpack.decode(payload)
        tokens = tuple(req["tokens"])
        key = IPCCacheServerKey(model_name=req["model"], world_size=1, worker_id=None, token_ids=tokens, start=0,
                                end=req["end"], request_id=req["session"], cache_salt="", num_kv_readers=1)  # fmt: skip
        t1 = time.perf_counter()
        self._lookup.lookup(key, 1)
        t2 = time.perf_counter()
        hit = int(self._lookup.wait_prefetch_status(req["session"], 1.0) or 0) * req["chunk"]
        t3 = time.perf_counter()
        end = min(hit, req["cap"])
        slots = None
        if end > req["start"]:
            rank_key = IPCCacheServerKey(model_name=req["model"], world_size=1, worker_id=0, token_ids=tokens[:end],
                                         start=req["start"], end=end, request_id=req["session"], cache_salt="",
                                         num_kv_readers=1)  # fmt: skip
            answer = self._transfer.prepare_retrieve(rank_key, req["instance"])
            slots = answer.context.get("slots") if answer.success else None
        t4 = time.perf_counter()
        spent = {"decode": t1 - t0, "LOOKUP": t2 - t1, "WAIT": t3 - t2, "PREPARE": t4 - t3}
        return msgspec.msgpack.encode({"hit": hit, "end": end, "slots": slots, "server_s": spent})


def build_server_modules(build: Any) -> OneCallProbe:
    return OneCallProbe(build.modules, build.server_context)
