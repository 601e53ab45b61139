"""Stand-in for ``tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py`` (main @035ab91c,
with the prefix-reservation trio as upstream's newer main states it: see below).

The connector ABCs and data classes as TensorRT-LLM main has them: names, signatures, which methods
are abstract, the ``supports_attention_dp`` opt-in, the per-layer-group forms (whose defaults
delegate to the flat forms for one layer group and refuse several), and the worker's concrete
metadata helpers.

The prefix reservations (``reserve_prefix`` / ``release_prefix_reservation`` on the scheduler,
``get_finished_prefix_loads`` on the worker, ``SchedulerOutput.prefix_loads``): no stored version of
this file carries them (re-read 2026-12-07: docs/results/trtllm-main-repin.md); their contract is
taken from upstream's own code and tests that use them (``connectors/prefix_load_completion.py``
@785b0128, the manager's reservation unit tests, the executor's connector-ownership tests,
KVCacheManagerV2's real-manager prefix tests, ``examples/llm-api/llm_kv_cache_connector.py``, and the
connector docs' ``PrefixLoad`` table, which adds ``is_async``; docs/connector.md names them). ``tests/standin/upstream_api.py`` pins these per supported version; the executor
stand-in (``tests/support/trtllm_executor.py``) plays the ``KvCacheConnectorManager`` around them.
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
    block_hashes: list[int] = field(default_factory=list)
    priorities: list[int] | None = None
    cache_salt: str | None = None
    new_block_ids_by_layer_group: list[list[int]] = field(default_factory=list)


@dataclass
class PrefixLoad:
    """A reservation's load as KVCacheManagerV2 accepted it: tokens ``[start, end)`` into these pages;
    ``is_async``: the request waits outside the compute batch until every rank finished it."""

    reservation_id: int
    request_id: int
    start: int
    end: int
    is_async: bool
    block_ids_by_layer_group: list[list[int]]
    tokens: list[int]
    cache_salt: str | None = None


@dataclass
class SchedulerOutput:
    """Requests of one iteration: first appearance in ``new_requests``, later ones in ``cached_requests``."""

    new_requests: list[RequestData] = field(default_factory=list)
    cached_requests: list[RequestData] = field(default_factory=list)
    attention_dp_rank: int | None = None
    """Under attention DP, the rank owning these requests' blocks; None on the tensor-parallel path."""
    prefix_loads: list[PrefixLoad] = field(default_factory=list)
    """Loads of prefix reservations accepted for this batch (only when reservations are enabled)."""


def _grouped_form_stands_in(cls: type, base: type, flat_for_grouped: dict[str, str]) -> None:
    """An override of a per-layer-group form implements its flat form too (upstream lets a
    connector implement either spelling; only the flat one is abstract)."""
    for flat, grouped in flat_for_grouped.items():
        if getattr(cls, grouped, None) is getattr(base, grouped):
            continue
        if not getattr(getattr(cls, flat, None), "__isabstractmethod__", False):
            continue

        def unavailable(self: Any, *args: Any, _flat: str = flat, _grouped: str = grouped, **kwargs: Any) -> None:
            raise NotImplementedError(f"{type(self).__name__} implements {_grouped}, not {_flat}")

        setattr(cls, flat, unavailable)


class KvCacheConnectorWorker(ABC):
    """Runs on every rank (under attention DP: one per DP rank, owner-local)."""

    supports_attention_dp: bool = False

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        self._metadata: object | None = None
        super().__init__()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _grouped_form_stands_in(cls, KvCacheConnectorWorker, {"register_kv_caches": "register_kv_cache_layout"})

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

    def register_kv_cache_layout(self, layout: Any) -> None:
        """KVCacheManagerV2: the pools per layer group; one pool goes to ``register_kv_caches``."""
        tensor = layout.as_single_pool_tensor()
        if tensor is None:
            raise NotImplementedError(
                f"{type(self).__name__} does not implement register_kv_cache_layout, and this KV cache "
                f"cannot be described as one pool tensor: {len(layout.groups)} layer group(s)"
            )
        self.register_kv_caches(tensor)

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

    def get_finished_prefix_loads(self) -> list[int]:
        """Reservation ids whose prefix loads finished on this rank since the last call (opt-in)."""
        raise NotImplementedError


class KvCacheConnectorScheduler(ABC):
    """Rank 0 only on the tensor-parallel path; one per rank under attention DP."""

    supports_attention_dp: bool = False

    def __init__(self, llm_args: Any):
        self._llm_args = llm_args
        super().__init__()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _grouped_form_stands_in(
            cls,
            KvCacheConnectorScheduler,
            {
                "request_finished": "request_finished_by_layer_group",
                "update_state_after_alloc": "update_state_after_alloc_by_layer_group",
            },
        )

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """Per-iteration metadata, broadcast to every worker (owner-local under attention DP)."""

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens loadable beyond ``num_computed_tokens`` and whether the load is async."""

    @abstractmethod
    def request_finished(self, request: Any, cache_block_ids: list[int]) -> bool:
        """True when an async save is in flight; blocks stay held until ``get_finished``."""

    def request_finished_by_layer_group(self, request: Any, cache_block_ids_by_layer_group: list[list[int]]) -> bool:
        """Per-layer-group form of ``request_finished``: one group delegates, several are refused."""
        if len(cache_block_ids_by_layer_group) != 1:
            raise NotImplementedError(
                f"{type(self).__name__} does not implement request_finished_by_layer_group, and this KV "
                f"cache has {len(cache_block_ids_by_layer_group)} layer groups"
            )
        return self.request_finished(request, cache_block_ids_by_layer_group[0])

    @abstractmethod
    def update_state_after_alloc(self, request: Any, block_ids: list[int]) -> None:
        """Called right after blocks were allocated for the request's first context chunk."""

    def update_state_after_alloc_by_layer_group(self, request: Any, block_ids_by_layer_group: list[list[int]]) -> None:
        """Per-layer-group form of ``update_state_after_alloc``: one group delegates, several are refused."""
        if len(block_ids_by_layer_group) != 1:
            raise NotImplementedError(
                f"{type(self).__name__} does not implement update_state_after_alloc_by_layer_group, and "
                f"this KV cache has {len(block_ids_by_layer_group)} layer groups"
            )
        self.update_state_after_alloc(request, block_ids_by_layer_group[0])

    def wait_for_initialization(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Optional: block until the connector is ready."""

    def reserve_prefix(self, request: Any, num_computed_tokens: int, reservation_id: int) -> tuple[int, bool]:
        """Protect the source of the tokens loadable beyond ``num_computed_tokens`` (opt-in): how many, async."""
        raise NotImplementedError

    def release_prefix_reservation(self, request: Any, reservation_id: int, start: int, end: int) -> None:
        """Tokens ``[start, end)`` of a reservation are no longer needed (each range released once)."""
        raise NotImplementedError


_RESERVATION_METHODS = (
    (KvCacheConnectorScheduler, "reserve_prefix"),
    (KvCacheConnectorScheduler, "release_prefix_reservation"),
    (KvCacheConnectorWorker, "get_finished_prefix_loads"),
)


def prefix_reservations_enabled(worker_cls: type, scheduler_cls: type) -> bool:
    """``KvCacheConnectorManager.configure_prefix_reservations(True)``: a connector that implements all
    three reservation methods gets reservations, one implementing none keeps the per-request path, and
    a partial set is refused."""
    classes = {KvCacheConnectorScheduler: scheduler_cls, KvCacheConnectorWorker: worker_cls}
    implemented = [getattr(classes[base], name) is not getattr(base, name) for base, name in _RESERVATION_METHODS]
    if all(implemented):
        return True
    if any(implemented):
        missing = [name for (_base, name), done in zip(_RESERVATION_METHODS, implemented, strict=True) if not done]
        raise ValueError(f"prefix reservations require reserve_prefix, release_prefix_reservation and "
                         f"get_finished_prefix_loads; missing: {missing}")  # fmt: skip
    return False


def check_reservation_answer(answer: Any) -> tuple[int, bool]:
    """The manager's check of ``reserve_prefix``'s answer: ``(n >= 0 int, bool)``, never ``(0, True)``."""
    if not isinstance(answer, tuple) or len(answer) != 2:
        raise ValueError(f"reserve_prefix must return (num_tokens, is_async), got {answer!r}")
    num, is_async = answer
    if isinstance(num, bool) or not isinstance(num, int) or num < 0 or not isinstance(is_async, bool):
        raise ValueError(f"reserve_prefix returned an invalid answer {answer!r}")
    if num == 0 and is_async:
        raise ValueError("reserve_prefix returned (0, True): nothing to load asynchronously")
    return num, is_async


def validate_attention_dp(worker_cls: type, scheduler_cls: type) -> None:
    """``KvCacheConnectorManager.validate_attention_dp``: both classes must opt in."""
    for connector_cls in (worker_cls, scheduler_cls):
        if getattr(connector_cls, "supports_attention_dp", False) is not True:
            raise NotImplementedError(
                "The connector must declare supports_attention_dp=True "
                "and implement owner-local scheduling/transfers against a shared pool."
            )
