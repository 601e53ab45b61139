"""The keys a backend names chunks with on an LMCache server (not ``kvoffload.cache_keys``, the
CURVE keys that authenticate the connection): the model tagged with the pool's chunk
layout, the world size, and (for a worker's transfers) the rank: the deployment's, or one rank's
worth for a pool every rank holds alike (``layout.key_ranks``: multi-head latent attention)."""

from __future__ import annotations

from kvoffload.connector.backends.base import BackendError
from kvoffload.connector.layout import KeyRanks
from kvoffload.connector.lmcache_seam import IPCCacheServerKey


class ChunkKeys:
    """Key maker for one backend; ``model`` is set when a pool is registered (the scheduler keys its lookups with rank 0's worker's)."""

    def __init__(self, world_size: int, rank: int) -> None:
        self._world_size = world_size
        self._rank = rank
        self.stores = True
        """Whether this rank writes chunks (False: another rank stores the bytes this one holds too)."""
        self.model: str | None = None
        """The model name in the keys, tagged with the layout of the registered pool (``keys.cache_model_name``)."""

    @property
    def world_size(self) -> int:
        """The world size in the keys: how many ranks' chunks make one prefix."""
        return self._world_size

    @property
    def rank(self) -> int:
        """The rank in this worker's transfer keys (its index among a secured load's ranks)."""
        return self._rank

    def use(self, ranks: KeyRanks) -> None:
        """Key as ``ranks`` says (set when a pool is registered, from its layout)."""
        self._world_size, self._rank, self.stores = ranks.world_size, ranks.rank, ranks.stores

    def key(self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str, worker: bool,
            rank: int | None = None) -> IPCCacheServerKey:  # fmt: skip
        """The key of ``token_ids[start:end]``: a lookup's (``worker`` False) or a rank's transfer's."""
        if self.model is None:
            raise BackendError("key", "unavailable", "no KV pool registered: the chunk layout is unknown")
        return IPCCacheServerKey(
            model_name=self.model,
            world_size=self._world_size,
            worker_id=(self._rank if rank is None else rank) if worker else None,
            token_ids=token_ids,
            start=start,
            end=end,
            request_id=session_id,
            cache_salt=salt,
            num_kv_readers=1,
        )

    def of_every_rank(self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
                      ) -> list[IPCCacheServerKey]:  # fmt: skip
        """Rank by rank, the worker keys of one load: what PREPARE secures and COMMIT releases."""
        return [self.key(session_id, token_ids, start, end, salt, worker=True, rank=rank)
                for rank in range(self._world_size)]  # fmt: skip
