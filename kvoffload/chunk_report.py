"""The report a connector sends its cache server after a store: which chunks of a prompt it holds now.

The connector (``connector.backends``) encodes it; the cache server's KV-event module
(``sidecar.kv_events_module``) decodes it and announces the chunks to KV-aware routers. Plain JSON
through LMCache's opaque ``server_module_call`` envelope; standard library only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHOD = "kvoffload.chunks_stored"
"""The namespaced server-module method the report is sent to."""


class ReportError(ValueError):
    """A report that cannot be used; the message names the field and the bad value."""


@dataclass(frozen=True)
class ChunksStored:
    """Chunks ``[start, end)`` of a prompt (token offsets, chunk-aligned) were committed to the cache."""

    served_model: str
    """The model name routers know (the engine's), not the cache's layout-tagged one."""
    cache_model: str
    """The model name in the cache's keys (``keys.cache_model_name``)."""
    world_size: int
    token_ids: tuple[int, ...]
    """The prompt's tokens from the first up to ``end`` (the chunk hashes chain from the first)."""
    start: int
    end: int
    tokens_per_block: int
    salt: str
    """The store's key salt; a server announces only unsalted (``""``) chunks."""


def encode(report: ChunksStored) -> bytes:
    return json.dumps(
        [report.served_model, report.cache_model, report.world_size, list(report.token_ids[: report.end]),
         report.start, report.end, report.tokens_per_block, report.salt],
        separators=(",", ":"),
    ).encode()  # fmt: skip


def decode(payload: bytes) -> ChunksStored:
    """The report in ``payload``; raises ``ReportError`` naming what is wrong."""
    try:
        fields = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"chunks_stored: payload is not JSON ({exc})") from None
    if not isinstance(fields, list) or len(fields) != 8:
        raise ReportError("chunks_stored: payload must be a JSON array of 8 fields")
    served, cache, world, tokens, start, end, tpb, salt = fields
    if not (isinstance(served, str) and isinstance(cache, str) and isinstance(salt, str)):
        raise ReportError("chunks_stored: served_model, cache_model and salt must be strings")
    ints = (world, start, end, tpb)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        raise ReportError(f"chunks_stored: world_size, start, end, tokens_per_block must be integers, got {ints!r}")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise ReportError("chunks_stored: token_ids must be a list of integers")
    if world < 1 or tpb < 1 or not 0 <= start < end <= len(tokens):
        raise ReportError(
            f"chunks_stored: need world_size>=1, tokens_per_block>=1, 0<=start<end<=len(token_ids); "
            f"got world_size={world} tokens_per_block={tpb} start={start} end={end} len={len(tokens)}"
        )
    return ChunksStored(served, cache, world, tuple(tokens), start, end, tpb, salt)
