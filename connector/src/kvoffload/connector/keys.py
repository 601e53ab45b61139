"""Cache keys: everything that decides a chunk's bytes besides its tokens, and the token arithmetic.

An LMCache object key is (model name, KV rank from world size and rank, chain hash of the chunk's
tokens, cache salt). The connector fills those fields so that two requests share a chunk only when
TensorRT-LLM would share the block on the device, and two deployments share one only when its
bytes mean the same to both:

- the model name carries the weights' identity and the chunk layout (:func:`cache_model_name`):
  a digest of the checkpoint (``identities``), block-native chunks, the pool's KV dtype, tokens per
  block and bytes per block;
- the salt carries the request's key scope (:func:`key_salt`): its ``cache_salt``, LoRA adapter
  (its task id and its weights' digest), multimodal items, prompt-tuning extra ids and table, the
  parts of TensorRT-LLM's own device block key (``struct BlockKey`` in
  ``cpp/include/tensorrt_llm/batch_manager/kvCacheManager.h`` @2213a799) that the token ids do not
  show, and what a cache shared by deployments needs beyond it.

Routers see a narrower scope (:func:`lora_scope`): of all that, only a LoRA adapter is something a
KV-aware router can match a request by (vLLM's ``lora_name``), so a chunk whose salt is its adapter's
alone is announced under that adapter and every other salted chunk is not announced.

Salts are hashed into fixed-length tokens because LMCache rejects salts with ``@ / \\ NUL`` or over
128 characters, and a tenant's raw salt should never appear in a cache server's logs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, Literal

from kvoffload.chunk_report import LoraScope

CHUNK_LAYOUT_TAG = "kvoffload-blocks-v1"
_SALT_ATTRS = ("cache_salt", "cache_salt_id", "py_cache_salt", "py_cache_salt_id")
_LORA_ATTRS = ("lora_task_id", "py_lora_task_id")
_EXTRA_IDS_ATTRS = ("input_token_extra_ids", "py_input_token_extra_ids")


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


def _first_set(obj: Any, attrs: Iterable[str]) -> Any:
    for attr in attrs:
        value = getattr(obj, attr, None)
        if value is not None:
            return value
    return None


def _framed(parts: Iterable[bytes]) -> bytes:
    """Length-prefixed parts: no two different part lists encode alike."""
    return b"".join(len(part).to_bytes(4, "little") + part for part in parts)


def _ints(values: Iterable[int], width: int, byteorder: Literal["little", "big"] = "little") -> bytes:
    return b"".join(int(v).to_bytes(width, byteorder, signed=True) for v in values)


def _multimodal_items(hashes: Sequence[Sequence[int]], positions: Sequence[int], lengths: Sequence[int]) -> bytes:
    """Each item's content digest (8 int32, most significant byte first, as TensorRT-LLM hashes
    images) with its prompt position and length, in prompt order."""
    items = []
    for i, digest in enumerate(hashes):
        where = (positions[i] if i < len(positions) else -1, lengths[i] if i < len(lengths) else -1)
        items.append(_framed((_ints(digest, 4, "big"), _ints(where, 8))))
    return _framed(items)


_MULTIMODAL_DATA_ATTRS = ("py_multimodal_data", "multimodal_embedding", "py_multimodal_embedding")


def key_salt(request: Any, adapter: bytes | None = b"", prompt_table: bytes = b"") -> str | None:
    """The salt scoping ``request``'s keys, or None when the request must not be cached.

    Reads what TensorRT-LLM's ``LlmRequest`` carries (``_torch/pyexecutor/llm_request.py`` @002f3cc3
    and the properties in ``cpp/tensorrt_llm/nanobind/batch_manager/bindings.cpp`` @cc8cd5af): the
    salt (``salt_of``), ``lora_task_id``, ``multimodal_hashes``/``_positions``/``_lengths``, and the
    prompt-tuning ``input_token_extra_ids`` where a version exposes them (those commits do not);
    with the identities ``identities`` gives: ``adapter``, the digest of the LoRA adapter's weights
    (``b""``: none; None: an adapter that cannot be identified), and ``prompt_table``, the digest of
    its prompt-tuning table. A request with none of them keeps ``salt_of``'s salt; any of them gives
    a ``k`` + blake2b-128 salt over all of them. A multimodal request without content hashes
    (placeholder positions, or embeddings passed in) is not cacheable: its tokens do not say which
    image, as upstream's MooncakeStore connector decides (``connectors/mooncake_store/scheduler.py``
    @240a8a76); nor is one under an adapter that cannot be identified.
    """
    salt = salt_of(request)
    lora = _first_set(request, _LORA_ATTRS)
    hashes = getattr(request, "multimodal_hashes", None) or ()
    positions = getattr(request, "multimodal_positions", None) or ()
    lengths = getattr(request, "multimodal_lengths", None) or ()
    if not hashes and (positions or lengths or any(_is_set(request, a) for a in _MULTIMODAL_DATA_ATTRS)):
        return None
    if adapter is None:
        return None
    extra_ids = _first_set(request, _EXTRA_IDS_ATTRS)
    if extra_ids is not None and hasattr(extra_ids, "tolist"):
        extra_ids = extra_ids.tolist()
    if lora is None and not hashes and not extra_ids and not adapter and not prompt_table:
        return salt
    scope = _framed(
        (
            salt.encode(),
            b"" if lora is None else _ints((lora,), 8),
            _multimodal_items(hashes, positions, lengths) if hashes else b"",
            _ints(extra_ids, 8) if extra_ids else b"",
            adapter,
            prompt_table,
        )
    )
    return "k" + hashlib.blake2b(scope, digest_size=16).hexdigest()


_LORA_PATH_ATTRS = ("py_lora_path",)


def lora_scope(request: Any, prompt_table: bytes = b"") -> LoraScope | None:
    """The LoRA scope a router can match ``request``'s chunks under, when its adapter is all that
    scopes its keys; None when it has no adapter or more than one (a ``cache_salt``, multimodal
    items, prompt-tuning ids or ``prompt_table``: routers cannot match those, docs/routing.md), or an
    adapter without a checkpoint path to name it by.

    The name is the last component of the adapter's checkpoint path (``LlmRequest.py_lora_path``,
    ``LoRARequest.lora_path``): TensorRT-LLM's request carries no adapter name, and that directory's
    name is what a router lists the adapter as where a deployment names adapters after their
    checkpoints (``--lora-modules <name>=<dir>/<name>``). The id is ``lora_task_id``.
    """
    task = _first_set(request, _LORA_ATTRS)
    if task is None or salt_of(request) or prompt_table:
        return None
    if any(_is_set(request, a) for a in ("multimodal_hashes", "multimodal_positions", "multimodal_lengths")):
        return None
    if any(_is_set(request, a) for a in (*_MULTIMODAL_DATA_ATTRS, *_EXTRA_IDS_ATTRS)):
        return None
    path = _first_set(request, _LORA_PATH_ATTRS)
    name = PurePosixPath(str(path).rstrip("/")).name if path else ""
    return LoraScope(int(task), name) if name else None


def _is_set(obj: Any, attr: str) -> bool:
    value = getattr(obj, attr, None)
    if value is None:
        return False
    if isinstance(value, (dict, list, tuple, str, bytes)):
        return len(value) > 0
    return True


@dataclass(frozen=True)
class ChunkLayout:
    """What decides a chunk's bytes besides the model, its tokens and the rank: block-native
    chunks of blocks of ``tokens_per_block`` tokens, ``block_bytes`` each, in ``kv_dtype``."""

    kv_dtype: str
    """The pool's element type (torch's name: ``bfloat16``, ``float8_e4m3fn``, ...)."""
    tokens_per_block: int
    block_bytes: int
    """One block of the pool: every layer, K and V, this rank's KV heads (MLA: the latent)."""
    pool_tag: str = ""
    """The pool's kind and geometry where it is not key/value (``layout.PoolLayout.tag``: ``mla-l61-w576``)."""


def chunk_layout(pool_dtype: object, tokens_per_block: int, block_bytes: int, pool_tag: str = "") -> ChunkLayout:
    """The layout of chunks copied from a pool of ``pool_dtype`` (a torch dtype or its name)."""
    return ChunkLayout(str(pool_dtype).removeprefix("torch."), tokens_per_block, block_bytes, pool_tag)


def cache_model_name(model_name: str, layout: ChunkLayout, weights: str = "") -> str:
    """The model name in LMCache keys, tagged with the identity of its weights (``weights``:
    ``identities.model_identity``, after a ``~``: LMCache splits keys on ``@``) and the layout of the
    chunks this connector writes.

    Chunks hold TensorRT-LLM's block bytes (``blockcopy``), not LMCache's own layout, so a client
    that expects LMCache's layout (LMCache's own adapter, another connector version) must never
    find them in a shared or persistent tier, nor this connector find theirs; nor may a deployment
    with another KV dtype, block size or block shape read them as its own. A pool that is not
    key/value (multi-head latent attention) says so with its geometry (``-mla-l61-w576``).
    """
    named = f"{model_name}~{weights}" if weights else model_name
    name = f"{named}~{CHUNK_LAYOUT_TAG}~{layout.kv_dtype}-t{layout.tokens_per_block}-b{layout.block_bytes}"
    return f"{name}-{layout.pool_tag}" if layout.pool_tag else name


def chunk_floor(tokens: int, chunk_size: int) -> int:
    """Largest multiple of ``chunk_size`` not above ``tokens``."""
    return (tokens // chunk_size) * chunk_size


def chunk_ceil(tokens: int, chunk_size: int) -> int:
    """Smallest multiple of ``chunk_size`` not below ``tokens``."""
    return -(-tokens // chunk_size) * chunk_size
