"""What the scheduler sends the workers each iteration: the connector metadata and its transfer ops.

TensorRT-LLM pickles ``ConnectorMetadata`` on rank 0 and unpickles it on every rank, so everything
here is a frozen dataclass of plain values, importable by module path on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.chunk_report import LoraScope
from kvoffload.connector.layout import page_key


@dataclass(frozen=True)
class SlotRef:
    """One chunk slot in the server's L1 shared-memory segment, as PREPARE_RETRIEVE describes it."""

    offset: int
    length: int
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class SecuredLoad:
    """The chunks of one load, handed out and read-locked by the server at lookup time, per rank.

    The bytes stay in the segment (which every worker maps) until the load's COMMIT, whatever
    the server does meanwhile, so the load itself is a local copy that cannot fail.
    """

    segment: tuple[str, int]
    """(name, inode) of the L1 segment the slots are in."""
    slots: tuple[tuple[SlotRef, ...], ...]
    """``slots[rank]``: that rank's chunks, in order."""


@dataclass(frozen=True)
class TransferOp:
    """One store or retrieve for the worker; picklable (broadcast to every rank)."""

    request_id: int
    session_id: str
    token_ids: tuple[int, ...]
    """Tokens ``[0, end)``: LMCache hashes chunks as a chain from token 0."""
    start: int
    end: int
    block_ids: tuple[int, ...]
    """Blocks holding tokens ``[start, end)``."""
    skip_tokens: int
    salt: str
    secured: SecuredLoad | None = None
    """For a load: its chunks, secured at lookup."""
    copy_end: int | None = None
    """For a load TensorRT-LLM honoured in part: where its copies (and ``block_ids``) end."""
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    """Several layer groups (``layout.GroupedLayout``): ``block_ids`` are the anchor group's pages and
    these the other groups', one tuple per group in chunk order, aligned with ``block_ids``; -1 where
    the group has no page (behind a sliding window): a load leaves it, a store never names one."""
    reservation_id: int | None = None
    """For a load of a prefix reservation (TensorRT-LLM main's KVCacheManagerV2): the id every rank
    reports through ``get_finished_prefix_loads`` once its copies are done."""
    lora: LoraScope | None = None
    """The router scope of its salted chunks (``keys.lora_scope``), for the store's KV-event report."""

    def pages(self) -> tuple[int, ...]:
        """Every page the op reads or writes, other groups' named by ``layout.page_key`` (fences)."""
        if not self.group_block_ids:
            return self.block_ids
        extra = (page_key(g, s) for g, ids in enumerate(self.group_block_ids, 1) for s in ids if s >= 0)
        return (*self.block_ids, *extra)

    @property
    def num_tokens(self) -> int:
        """Tokens the op writes into the pool (a store: reads from it)."""
        end = self.end if self.copy_end is None else min(self.end, self.copy_end)
        return max(0, end - self.start - self.skip_tokens)


@dataclass(frozen=True)
class ConnectorMetadata:
    """What ``build_connector_meta`` broadcasts each iteration."""

    loads: tuple[TransferOp, ...] = ()
    """Synchronous loads: copied in ``start_load_kv``, before this iteration's forward."""
    async_loads: tuple[TransferOp, ...] = ()
    """Loads of requests TensorRT-LLM parked (``(n, True)``): issued in ``start_load_kv``, not waited
    for; ``get_finished`` reports each once its KV is in the pool."""
    saves: tuple[TransferOp, ...] = ()
    fresh_blocks: frozenset[int] = frozenset()
    """Blocks TensorRT-LLM allocated this iteration that its forward may write: a queued save
    still naming one of them belongs to a request that ended without ``request_finished``."""
    reused_blocks: frozenset[int] = frozenset()
    """Device-reused blocks of this iteration's new requests (their prefix, a partially matched block
    included), which its forward reads: an asynchronous load still writing one belongs to a parked
    request that was cancelled, whose blocks TensorRT-LLM stored for reuse under its prompt."""
    settled_prefix_loads: tuple[int, ...] = ()
    """Prefix reservations whose accepted loads copy nothing (nothing of them was secured): every rank
    reports them finished at once."""
    computed_prompt_tokens: int = 0
    """Prompt tokens this iteration's forward computes (rank 0's worker times prefill by it)."""
