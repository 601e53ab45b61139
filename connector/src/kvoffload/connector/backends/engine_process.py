"""What the scheduler and the workers of one engine process share: every per-process thing.

TensorRT-LLM builds the connector's scheduler and its workers apart, with no handle on each other,
and runs the scheduler in rank 0's process. The scheduler secures loads through rank 0's worker
backend (PREPARE_RETRIEVE must come from a registered worker instance) and keys its lookups with the
chunk layout of the pool that worker registered; its lookups wait for the store COMMITs this
process has pending on their chain. The in-process backend's cache server is one per process too,
and so are the metrics (their instances, the pod's endpoint and the flusher). The connector's entry
point (``runtime.engine_process``) makes one :class:`EngineProcess` and hands it to every role and
backend it builds.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Protocol

from kvoffload.connector.backends.commits import PendingCommits
from kvoffload.connector.backends.inprocess import InProcessServer
from kvoffload.connector.layout import GroupedLayout
from kvoffload.connector.load_cost import LoadCosts
from kvoffload.connector.metrics import ProcessMetrics
from kvoffload.connector.wire import SecuredLoad

if TYPE_CHECKING:
    from kvoffload.connector.backends.chunk_keys import ChunkKeys
    from kvoffload.connector.backends.securing import SecuredHit
    from kvoffload.connector.lmcache_seam import IPCCacheServerKey


class LocalWorker(Protocol):
    """What the scheduler needs of rank 0's worker backend in its process."""

    @property
    def cache_model(self) -> str | None: ...

    @property
    def chunk_keys(self) -> ChunkKeys: ...

    @property
    def grouped_layout(self) -> GroupedLayout | None: ...

    def prepare_secured(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str
    ) -> SecuredLoad | None: ...  # fmt: skip

    def commit_secured(
        self, session_id: str, token_ids: tuple[int, ...], start: int, end: int, salt: str, segment: tuple[str, int]
    ) -> None: ...  # fmt: skip

    def lookup_and_secure(
        self, client: Any, lookup_key: IPCCacheServerKey, start: int, cap: int, wait_s: float, deadline: float
    ) -> SecuredHit | None: ...  # fmt: skip


class FinishedWatch:
    """Requests rank 0's scheduler tracks by id, each with its ``LlmRequest`` and what the worker must
    settle should TensorRT-LLM finish the request unannounced. TensorRT-LLM (1.2, main) frees a request
    it cancels or fails at once, without ``request_finished``, and its next ``prepare_resources`` may
    copy into one of the freed blocks (partial reuse) or hand it out before any hook of the connector
    runs; so the worker in this process settles such requests in ``get_finished`` (``finished``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tracked: dict[int, tuple[Any, frozenset[int]]] = {}

    def track(self, request_id: int, llm_request: Any, blocks: frozenset[int] = frozenset()) -> None:
        with self._lock:
            self._tracked[request_id] = (llm_request, blocks)

    def untrack(self, request_id: int) -> None:
        with self._lock:
            self._tracked.pop(request_id, None)

    def finished(self) -> dict[int, frozenset[int]]:
        """The tracked requests TensorRT-LLM has finished, each with the blocks it was tracked with."""
        with self._lock:
            tracked = list(self._tracked.items())
        return {rid: blocks for rid, (request, blocks) in tracked if getattr(request, "is_finished", False) is True}


class ParkedLoads(FinishedWatch):
    """The asynchronous loads rank 0's scheduler issued for parked requests: the blocks each writes.
    A parked request cancelled while its load runs has that load landed in ``get_finished``
    (``abandoned_blocks``) before a copy or another request may touch the blocks."""

    def abandoned_blocks(self) -> frozenset[int]:
        """Blocks written by loads of parked requests that TensorRT-LLM has finished (cancelled)."""
        return frozenset(block for blocks in self.finished().values() for block in blocks)


class SavingRequests(FinishedWatch):
    """Rank 0's requests with saves planned. One cancelled or failed has its saves ended in
    ``get_finished`` (``ended``): a save still running would read a block the next
    ``prepare_resources`` copies into. A request that ended through ``request_finished`` is no longer
    tracked (its blocks stay held until its saves are done)."""

    def ended(self) -> frozenset[int]:
        """Requests TensorRT-LLM has finished (cancelled, failed) that the scheduler still tracks."""
        return frozenset(self.finished())


class EngineProcess:
    """Rank 0's worker backend, parked requests' loads, saving requests and the load costs per server URL, the COMMITs
    pending in this process, the cache server the in-process backend hosts here, and the metrics."""

    def __init__(self) -> None:
        self.pending = PendingCommits()
        """The store and release COMMITs queued in this process, by session and chain."""
        self.inprocess = InProcessServer()
        """The LMCache engine the in-process backend hosts here (started on first use)."""
        self.metrics = ProcessMetrics()
        """The metrics every role of this process records into, their endpoint and flusher."""
        self._workers: dict[str, LocalWorker] = {}
        self._parked: dict[str, ParkedLoads] = {}
        self._saving: dict[str, SavingRequests] = {}
        self._costs: dict[str, LoadCosts] = {}
        self._lock = threading.Lock()

    def load_costs(self, url: str) -> LoadCosts:
        """The securing, copy and prefill samples of the engine using ``url`` in this process (its
        scheduler and rank 0's worker record them)."""
        with self._lock:
            return self._costs.setdefault(url, LoadCosts())

    def parked_loads(self, url: str) -> ParkedLoads:
        """The parked requests' loads of the engine using ``url`` in this process."""
        with self._lock:
            return self._parked.setdefault(url, ParkedLoads())

    def saving_requests(self, url: str) -> SavingRequests:
        """The requests with saves planned of the engine using ``url`` in this process."""
        with self._lock:
            return self._saving.setdefault(url, SavingRequests())

    def attach(self, url: str, worker: LocalWorker) -> None:
        """Rank 0's worker for ``url`` registered its pool in this process."""
        with self._lock:
            self._workers[url] = worker

    def detach(self, url: str, worker: LocalWorker) -> None:
        with self._lock:
            if self._workers.get(url) is worker:
                del self._workers[url]

    def worker(self, url: str) -> LocalWorker | None:
        """Rank 0's worker for ``url`` in this process, if one registered."""
        with self._lock:
            return self._workers.get(url)
