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


class ParkedLoads:
    """The asynchronous loads rank 0's scheduler issued for parked requests, by request: the blocks
    each writes and the request's ``LlmRequest``. TensorRT-LLM (1.2, main) frees a parked request it
    cancels at once and stores its blocks for reuse; its next ``prepare_resources`` may copy one
    (partial reuse) or hand it out before any hook of the connector runs, so the worker in this
    process lands such loads in ``get_finished`` (``abandoned_blocks``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loads: dict[int, tuple[Any, frozenset[int]]] = {}

    def park(self, request_id: int, llm_request: Any, blocks: frozenset[int]) -> None:
        with self._lock:
            self._loads[request_id] = (llm_request, blocks)

    def unpark(self, request_id: int) -> None:
        with self._lock:
            self._loads.pop(request_id, None)

    def abandoned_blocks(self) -> frozenset[int]:
        """Blocks written by loads of parked requests that TensorRT-LLM has finished (cancelled)."""
        with self._lock:
            loads = list(self._loads.values())
        return frozenset(
            block for request, blocks in loads if getattr(request, "is_finished", False) is True for block in blocks
        )


class SavingRequests:
    """Rank 0's requests with saves planned, by id, and their ``LlmRequest``. TensorRT-LLM (1.2, main)
    frees a request it cancels or fails at once, without ``request_finished``; its next
    ``prepare_resources`` may copy into one of the freed blocks (partial reuse) before
    ``start_load_kv``'s save fence runs, so the worker in this process ends such a request's saves in
    ``get_finished`` (``ended``). A request that ended through ``request_finished`` is forgotten there
    (its blocks stay held until its saves are done)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[int, Any] = {}

    def note(self, request_id: int, llm_request: Any) -> None:
        with self._lock:
            self._requests[request_id] = llm_request

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._requests.pop(request_id, None)

    def ended(self) -> frozenset[int]:
        """Requests TensorRT-LLM has finished (cancelled, failed) that the scheduler still tracks."""
        with self._lock:
            requests = list(self._requests.items())
        return frozenset(rid for rid, request in requests if getattr(request, "is_finished", False) is True)


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
