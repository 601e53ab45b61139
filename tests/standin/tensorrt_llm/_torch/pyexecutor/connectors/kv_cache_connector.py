"""Stand-in for ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py``.

The ABCs and data classes as in TensorRT-LLM at TRT@5a06f334 (see
/work/shared/reference/trtllm-kv-connector.md §1): names, signatures, which
methods are abstract, and the concrete metadata helpers of the worker.
``RequestData`` carries ``cache_salt_id`` (TRT@5a06f334) and the newer optional
``cache_salt`` so connectors can be tested against both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestData:
    """What the scheduler reports about one request in one iteration."""

    request_id: int
    new_tokens: list[int]
    new_block_ids: list[int]
    computed_position: int
    num_scheduled_tokens: int
    priorities: list[int] | None = None
    cache_salt_id: int | None = None
    cache_salt: str | None = None


@dataclass
class SchedulerOutput:
    """Requests of one iteration: first appearance in ``new_requests``, later ones in ``cached_requests``."""

    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)


class KvCacheConnectorScheduler(ABC):
    """Runs only on rank 0; every hook is a collective in TensorRT-LLM."""

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` and whether the load is async."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Called right after blocks were allocated for the request's first context chunk."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """Per-iteration metadata, broadcast to every worker."""

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """True when an async save is in flight; blocks stay held until ``get_finished``."""

    def wait_for_initialization(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Optional: block until the connector is ready."""


class KvCacheConnectorWorker(ABC):
    """Runs on every rank."""

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        self._metadata: object | None = None

    def bind_connector_meta(self, metadata: object) -> None:
        """Store this iteration's metadata."""
        self._metadata = metadata

    def get_connector_meta(self) -> object:
        """This iteration's metadata."""
        return self._metadata

    def _clear_connector_meta(self) -> None:
        self._metadata = None

    def register_forward_pass_callable(self) -> Callable[[], None]:
        """Optional: a callable TensorRT-LLM runs at the end of each forward pass."""
        return lambda: None

    @abstractmethod
    def register_kv_caches(self, kv_cache_tensor: Any) -> None:
        """Once at init: the contiguous KV pool ``[num_blocks, num_layers, kv_factor, block_size]``."""

    @abstractmethod
    def start_load_kv(self, stream: Any) -> None:
        """Begin loads for the next forward pass."""

    @abstractmethod
    def wait_for_layer_load(self, layer_idx: int, stream: Any) -> None:
        """Called immediately before a decoder layer's work is enqueued."""

    @abstractmethod
    def save_kv_layer(self, layer_idx: int, stream: Any) -> None:
        """Called immediately after a decoder layer's work is enqueued."""

    @abstractmethod
    def wait_for_save(self, stream: Any) -> None:
        """Block until all synchronous saving operations are complete (end of forward)."""

    @abstractmethod
    def get_finished(
        self, finished_gen_req_ids: list[int], started_loading_req_ids: list[int]
    ) -> tuple[list[int], list[int]]:
        """(finished saving ids, finished loading ids); ids only after they were passed in."""
