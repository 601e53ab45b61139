"""Cache keys: which model, which tenant (``cache_salt``) and which token range.

LMCache's server mixes ``cache_salt`` into its object keys, so two tenants with
the same prompt never share KV. TensorRT-LLM reports the salt as
``RequestData.cache_salt`` (newer) or ``cache_salt_id`` (TRT@5a06f334) or on the
``LlmRequest``; ``salt_of`` reads whichever exists. The salt is hashed into a
fixed-length token because LMCache rejects salts with ``@ / \\ NUL`` or over 128
characters, and a tenant's raw salt should never appear in a cache server's
logs.
"""

from __future__ import annotations

import hashlib
from typing import Any

CHUNK_LAYOUT_TAG = "kvoffload-blocks-v1"
_SALT_ATTRS = ("cache_salt", "cache_salt_id", "py_cache_salt", "py_cache_salt_id")


def normalize_salt(raw: object) -> str:
    """A raw salt (str/int/bytes/None) -> LMCache-safe salt; ``""`` means no salt."""
    if raw is None:
        return ""
    if isinstance(raw, bytes):
        data = raw
    else:
        text = str(raw)
        if text == "":
            return ""
        data = text.encode("utf-8")
    return "s" + hashlib.blake2b(data, digest_size=16).hexdigest()


def salt_of(obj: Any) -> str:
    """The normalized salt carried by a ``RequestData`` or ``LlmRequest`` (first attribute set)."""
    for attr in _SALT_ATTRS:
        value = getattr(obj, attr, None)
        if value is not None and value != "":
            return normalize_salt(value)
    return ""


def chunk_floor(tokens: int, chunk_size: int) -> int:
    """Largest multiple of ``chunk_size`` not above ``tokens``."""
    return (tokens // chunk_size) * chunk_size


def chunk_ceil(tokens: int, chunk_size: int) -> int:
    """Smallest multiple of ``chunk_size`` not below ``tokens``."""
    return -(-tokens // chunk_size) * chunk_size


def cache_model_name(model_name: str) -> str:
    """The model name in LMCache keys, tagged with the chunk layout this connector writes.

    Chunks hold TensorRT-LLM's block bytes (``blockcopy``), not LMCache's own layout, so a client
    that expects LMCache's layout (LMCache's own adapter, another connector version) must never
    find them in a shared or persistent tier, nor this connector find theirs.
    """
    return f"{model_name}~{CHUNK_LAYOUT_TAG}"
