"""The interface both KV-store backends (sidecar, in-process) offer the connector hooks."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from kvoffload.connector.layout import GroupedLayout, PoolLayout
from kvoffload.connector.wire import SecuredLoad, TransferOp

if TYPE_CHECKING:  # torch-level copies: not imported where only the protocol is needed
    from kvoffload.connector.backends.layer_copies import LayerwiseLoad

logger = logging.getLogger("kvoffload.connector")


class BackendError(RuntimeError):
    """A backend operation failed; ``operation``/``reason`` are bounded metric labels."""

    def __init__(self, operation: str, reason: str, detail: str = "") -> None:
        super().__init__(f"{operation} failed ({reason}){': ' + detail if detail else ''}")
        self.operation = operation
        self.reason = reason


@dataclass(frozen=True)
class KvGeometry:
    """How one block of TensorRT-LLM's pool splits: ``[num_kv_heads, tokens_per_block, head_dim]`` per layer and K/V."""

    num_kv_heads: int
    tokens_per_block: int
    head_dim: int

    def layout_hints(self) -> dict[str, Any]:
        """LMCache ``LayoutHints`` for TensorRT-LLM's HND block layout."""
        return {
            "kv_layout": "HND",
            "num_kv_heads": self.num_kv_heads,
            "tokens_per_block": self.tokens_per_block,
            "head_dim": self.head_dim,
        }


def kv_geometry(block_elems: int, tokens_per_block: int, hf_config: dict[str, Any] | None, tp_size: int) -> KvGeometry:
    """Split the pool's last dim (``num_kv_heads*tokens_per_block*head_dim``) using the HF config when it fits.

    Without a usable config the block is treated as one head: store/retrieve stay
    bit-exact (whole blocks move), only LMCache's internal token-major view differs.
    """
    if block_elems % tokens_per_block != 0:
        raise ValueError(
            f"KV pool block of {block_elems} elements is not a multiple of tokens_per_block={tokens_per_block}"
        )
    per_token = block_elems // tokens_per_block
    if hf_config:
        heads = hf_config.get("num_key_value_heads") or hf_config.get("num_attention_heads")
        head_dim = hf_config.get("head_dim")
        if not head_dim and hf_config.get("hidden_size") and hf_config.get("num_attention_heads"):
            head_dim = int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"])
        if heads and head_dim and int(heads) % tp_size == 0:
            local_heads = int(heads) // tp_size
            if local_heads * int(head_dim) == per_token:
                return KvGeometry(local_heads, tokens_per_block, int(head_dim))
    return KvGeometry(1, tokens_per_block, per_token)


def read_hf_config(model: str) -> dict[str, Any] | None:
    """``config.json`` of a local model directory, or None (no network, no transformers import)."""
    path = Path(model) / "config.json"
    try:
        if path.is_file():
            data = json.loads(path.read_text())
            return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        logger.debug("event=hf_config_unreadable path=%s", path)
    return None


@dataclass(frozen=True)
class LoadResult:
    """One load of a batch: bytes moved, or the error that stopped it; seconds from its start to its end."""

    nbytes: int
    seconds: float
    error: BackendError | None = None


class KVBackend(Protocol):
    """What the scheduler and worker hooks need from a KV store."""

    chunk_size: int

    def is_up(self) -> bool:
        """Whether the last contact succeeded (no waiting)."""

    def lookup(self, session_id: str, token_ids: tuple[int, ...], end: int, salt: str) -> int:
        """Chunk-aligned hit prefix of ``token_ids[:end]``; read-locks the hit chunks."""

    def free_lookup_locks(
        self, session_id: str, token_ids: tuple[int, ...], ranges: tuple[tuple[int, int], ...], salt: str
    ) -> None:
        """Release lookup locks on chunk ranges that will not be retrieved."""

    def end_session(self, session_id: str) -> None:
        """Forget per-request server state (fire and forget)."""

    def register(self, kv_pool: Any, geometry: KvGeometry, layout: PoolLayout | None = None) -> None:
        """Register the worker's KV pool (``layout``: what it holds; described from its shape when None)."""

    def register_grouped(self, pages: Any, layout: GroupedLayout, dtype: Any) -> None:
        """Register the worker's layer groups' pages (``blockcopy.GroupedPages``) as one chunk layout."""

    def layer_groups(self) -> GroupedLayout | None:
        """Scheduler: the layer groups this process's worker registered (None: one pool)."""

    def retrieve(self, op: TransferOp) -> int:
        """Load ``op``'s chunks into its blocks; returns bytes moved; raises BackendError."""

    def secure(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
    ) -> SecuredLoad | None:
        """Scheduler: have the server hand out and lock a load's chunks for every rank, or None."""

    def release_secured(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str, secured: SecuredLoad
    ) -> None:
        """Scheduler: give back a secured load that will not be copied."""

    def load_secured(self, ops: Sequence[TransferOp]) -> list[LoadResult]:
        """Worker: copy each op's secured chunks into its blocks (local copies); one result per op."""

    def load_secured_by_layer(self, ops: Sequence[TransferOp]) -> LayerwiseLoad | None:
        """Worker: issue the copies of ``load_secured`` span of layers by span without waiting
        (``layer_copies``); None where this pool or backend cannot (then ``load_secured``)."""

    def release_loaded(self) -> None:
        """Worker, after an iteration: release the chunks of the loads copied in it (rank 0)."""

    def expect_async_load(self) -> None:
        """Worker: an asynchronous load will be issued (its segment stays mapped till then)."""

    def start_async_load(self, op: TransferOp) -> BackendError | None:
        """Worker: issue an expected asynchronous load's copies without waiting; the error, if any."""

    def finished_async_loads(self) -> list[tuple[TransferOp, LoadResult]]:
        """Worker: asynchronous loads whose KV is in the pool since the last call (their chunks released)."""

    def order_after_async_loads(self, blocks: frozenset[int]) -> None:
        """Worker: order the next forward after asynchronous loads still copying into ``blocks``."""

    def wait_async_loads(self, blocks: frozenset[int]) -> None:
        """Worker: return once no asynchronous load copies into ``blocks`` any more (host-side)."""

    def park_load(self, request_id: int, llm_request: Any, blocks: frozenset[int]) -> None:
        """Scheduler: a parked request's asynchronous load writes ``blocks`` (``abandoned_load_blocks``)."""

    def unpark_load(self, request_id: int) -> None:
        """Scheduler: the request is back from its load, or gone."""

    def abandoned_load_blocks(self) -> frozenset[int]:
        """Worker: blocks written by loads of parked requests TensorRT-LLM finished (cancelled) meanwhile."""

    def store(self, op: TransferOp) -> int:
        """Store ``op``'s blocks; returns bytes moved; raises BackendError."""

    def commits_pending(self, session_id: str) -> bool:
        """Worker: whether COMMITs of ``session_id`` are still queued here (its stored chunks are
        copied but not yet visible to lookups); never waits."""

    def close(self) -> None:
        """Stop threads and release connections."""


def instance_id() -> int:
    """A worker instance id unique across the pod's containers (PIDs may repeat across PID namespaces)."""
    return (os.getpid() << 20) ^ int.from_bytes(os.urandom(2), "little")
