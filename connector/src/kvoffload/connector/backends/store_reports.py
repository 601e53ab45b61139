"""Reports of committed stores to the cache server's KV-event module, sent fire-and-forget.

Opt-in (``KVOFFLOAD_KV_EVENTS``). The committer thread calls :meth:`StoreReporter.report` once a
store's COMMIT was answered; the report goes out through LMCache's public ``server_module_call``
RPC without waiting for its answer, so neither the engine nor the next COMMIT waits on it. Answers
are collected on later calls: failures are counted (``errors_total{operation="kv_event"}``), never
raised. A salted store is reported only under the LoRA scope its op named (``scope``, from
``keys.lora_scope``), so that a router matches it only for requests of that adapter; other salted
stores (a tenant's ``cache_salt``, multimodal or prompt-tuning prompts) are never reported, so a
router never learns a tenant's prefix.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from kvoffload import chunk_report
from kvoffload.connector.lmcache_seam import IPCCacheServerKey, ServerModuleCallRequest
from kvoffload.connector.metrics import ConnectorMetrics

logger = logging.getLogger("kvoffload.connector")

MAX_IN_FLIGHT = 256
"""Reports sent and not yet answered; past it a report is dropped (counted) rather than queued."""
MAX_SCOPES = 4096
"""LoRA scopes remembered by salt (one per adapter); past it they are forgotten and learnt again."""


class StoreReporter:
    """Sends ``chunk_report.ChunksStored`` for one connector process's committed stores."""

    def __init__(self, served_model: str, tokens_per_block: int, metrics: ConnectorMetrics) -> None:
        self._served_model = served_model
        self._tokens_per_block = tokens_per_block
        self._metrics = metrics
        self._in_flight: deque[Any] = deque()
        self._scopes: dict[str, chunk_report.LoraScope] = {}
        """Salt -> the LoRA scope its stores are announced under (the committer sees only keys)."""

    def scope(self, salt: str, lora: chunk_report.LoraScope) -> None:
        """Stores under ``salt`` are ``lora``'s (called by the store, before its COMMIT is queued)."""
        if self._scopes.get(salt) != lora:
            if len(self._scopes) >= MAX_SCOPES:
                self._scopes.clear()  # a store of a forgotten adapter is then not reported until it is named again
            self._scopes[salt] = lora

    def report(self, client: Any, key: IPCCacheServerKey) -> None:
        """Report ``key``'s chunks stored on ``client``'s server; never raises, never waits."""
        try:
            self._collect()
            if key.worker_id not in (None, 0):
                return  # tensor parallelism: rank 0 reports for all (the chunks' hashes are the same)
            lora = self._scopes.get(key.cache_salt) if key.cache_salt else None
            if key.cache_salt and lora is None:
                return  # a scope no router can match: never announced
            if len(self._in_flight) >= MAX_IN_FLIGHT:
                self._metrics.error("kv_event", "timeout")
                return
            report = chunk_report.ChunksStored(
                served_model=self._served_model,
                cache_model=key.model_name,
                world_size=key.world_size,
                token_ids=tuple(key.token_ids),
                start=key.start,
                end=key.end,
                tokens_per_block=self._tokens_per_block,
                salt=key.cache_salt,
                lora=lora,
            )
            request = ServerModuleCallRequest(method=chunk_report.METHOD, payload=chunk_report.encode(report))
            self._in_flight.append(client.server_module_call(request))
        except Exception as exc:
            self._metrics.error("kv_event", "error")
            logger.debug("event=kv_event_report_failed error=%r", exc)

    def _collect(self) -> None:
        """Count the answers that came back (in order; the first unanswered one stops the scan)."""
        while self._in_flight and self._in_flight[0].query():
            future = self._in_flight.popleft()
            try:
                answer = future.result(timeout=0)
            except Exception:
                self._metrics.error("kv_event", "unavailable")
                continue
            if not getattr(answer, "success", False):
                self._metrics.error("kv_event", "server_error")
                logger.debug("event=kv_event_refused error=%s", getattr(answer, "error", ""))
