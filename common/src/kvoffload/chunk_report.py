"""The report a connector sends its cache server after a store: which chunks of a prompt it holds now.

The connector (``connector.backends``) encodes it; the cache server's KV-event module
(``sidecar.kv_events_module``) decodes it and announces the chunks to KV-aware routers. Plain JSON
through LMCache's opaque ``server_module_call`` envelope: a JSON header line, then the token ids as
little-endian uint32 (a 32k-token prompt encodes in 0.2 ms this way, 4.5 ms as JSON, on the committer
thread that sends the next COMMIT); standard library only.

An unsalted store's header has 7 fields; a LoRA-scoped one (``LoraScope``) 9, the adapter's id and
name appended, so a server that predates them refuses only the scoped reports (it announced no
salted chunk anyway).
"""

from __future__ import annotations

import json
import sys
from array import array
from dataclasses import dataclass

METHOD = "kvoffload.chunks_stored"
"""The namespaced server-module method the report is sent to."""
MAX_TOKENS = 1 << 22
"""The longest prompt a report may carry (4 Mi tokens, 16 MiB): the server hashes all of it."""


class ReportError(ValueError):
    """A report that cannot be used; the message names the field and the bad value."""


@dataclass(frozen=True)
class LoraScope:
    """The LoRA adapter a router matches a chunk under: vLLM's ``lora_id`` and ``lora_name`` of a
    ``BlockStored`` (Dynamo and llm-d key by the name; the id alone scopes nothing)."""

    lora_id: int
    """TensorRT-LLM's ``lora_task_id`` (``LoRARequest.lora_int_id``), vLLM's ``lora_int_id``."""
    lora_name: str
    """The name the router knows the adapter by (``keys.lora_scope``)."""


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
    """The store's key salt; a server announces unsalted (``""``) chunks and LoRA-scoped ones (``lora``)."""
    lora: LoraScope | None = None
    """The router scope of a salted store whose salt is its LoRA adapter's alone; None: unscoped
    (``salt == ""``) or a scope no router can match (never announced)."""


def _tokens_bytes(tokens: tuple[int, ...]) -> bytes:
    packed = array("I", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def encode(report: ChunksStored) -> bytes:
    """The report as bytes; raises ``OverflowError`` for a token id outside uint32."""
    header = [report.served_model, report.cache_model, report.world_size, report.start, report.end,
              report.tokens_per_block, report.salt]  # fmt: skip
    if report.lora is not None:
        header += [report.lora.lora_id, report.lora.lora_name]
    return json.dumps(header, separators=(",", ":")).encode() + b"\n" + _tokens_bytes(report.token_ids[: report.end])


def decode(payload: bytes) -> ChunksStored:
    """The report in ``payload``; raises ``ReportError`` naming what is wrong."""
    head, newline, packed = payload.partition(b"\n")
    try:
        fields = json.loads(head)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"chunks_stored: header is not JSON ({exc})") from None
    if len(packed) > 4 * MAX_TOKENS:
        raise ReportError(f"chunks_stored: token_ids: {len(packed) // 4} tokens, more than {MAX_TOKENS}")
    if not newline or len(packed) % 4:
        raise ReportError(f"chunks_stored: token_ids must follow the header as uint32, got {len(packed)} bytes")
    if not isinstance(fields, list) or len(fields) not in (7, 9):
        raise ReportError("chunks_stored: header must be a JSON array of 7 fields (9 with a LoRA scope)")
    served, cache, world, start, end, tpb, salt = fields[:7]
    lora = _lora_scope(fields[7:])
    if not (isinstance(served, str) and isinstance(cache, str) and isinstance(salt, str)):
        raise ReportError("chunks_stored: served_model, cache_model and salt must be strings")
    ints = (world, start, end, tpb)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
        raise ReportError(f"chunks_stored: world_size, start, end, tokens_per_block must be integers, got {ints!r}")
    tokens = array("I")
    tokens.frombytes(packed)
    if sys.byteorder != "little":
        tokens.byteswap()
    if world < 1 or tpb < 1 or not 0 <= start < end <= len(tokens):
        raise ReportError(
            f"chunks_stored: need world_size>=1, tokens_per_block>=1, 0<=start<end<=len(token_ids); "
            f"got world_size={world} tokens_per_block={tpb} start={start} end={end} len={len(tokens)}"
        )
    return ChunksStored(served, cache, world, tuple(tokens), start, end, tpb, salt, lora)


def _lora_scope(fields: list[object]) -> LoraScope | None:
    if not fields:
        return None
    lora_id, lora_name = fields
    if not (isinstance(lora_id, int) and not isinstance(lora_id, bool) and isinstance(lora_name, str) and lora_name):
        raise ReportError(f"chunks_stored: lora_id must be an integer and lora_name a non-empty string, got {fields!r}")
    return LoraScope(lora_id, lora_name)
