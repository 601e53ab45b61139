"""The scheduler/worker hooks against a fake backend: what reaches the worker, and failure handling."""

from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvoffload import contract
from kvoffload.connector import wire
from kvoffload.connector.backends.base import BackendError, LoadResult

pytestmark = pytest.mark.connector
STANDIN = str(Path(__file__).resolve().parents[2] / "standin")
if STANDIN not in sys.path:
    sys.path.insert(0, STANDIN)


class FakeBackend:
    """Both sides' backend at once: the scheduler's client and the worker's backend (its own ``copies``)."""

    chunk_size = 64

    def __init__(self) -> None:
        self.hit = 0
        self.fail: str | None = None
        self.freed: list[tuple[tuple[int, int], ...]] = []
        self.stored: list[wire.TransferOp] = []
        self.sessions_ended: list[str] = []
        self.secured: list[tuple[int, int]] = []
        self.released: list[tuple[int, int]] = []
        self.publishing: set[str] = set()  # sessions whose COMMITs are still queued
        self.copies = self

    def lookup(self, session_id: str, token_ids: tuple[int, ...], end: int, salt: str) -> int:
        if self.fail:
            raise BackendError("lookup", self.fail)
        return min(self.hit, end)

    def lookup_and_secure(self, session_id: str, token_ids: Any, end: int, salt: str, start: int, cap: int) -> None:
        return None  # a server without secured lookups: looked up, then secured

    def free_lookup_locks(self, session_id: str, token_ids: Any, ranges: Any, salt: str) -> None:
        self.freed.append(ranges)

    def end_session(self, session_id: str) -> None:
        self.sessions_ended.append(session_id)

    def retrieve(self, op: wire.TransferOp) -> int:
        if self.fail:
            raise BackendError("retrieve", self.fail)
        return 1

    def secure(self, session_id: str, token_ids: Any, start: int, end: int, salt: str) -> Any:
        if self.fail:
            return None
        self.secured.append((start, end))
        return wire.SecuredLoad(("seg", 1), ((),))

    def release_secured(self, session_id: str, token_ids: Any, start: int, end: int, salt: str, secured: Any) -> None:
        self.released.append((start, end))

    def load_secured(self, ops: Any) -> list[LoadResult]:
        out = []
        for op in ops:
            try:
                out.append(LoadResult(self.retrieve(op), 0.001))
            except BackendError as exc:
                out.append(LoadResult(0, 0.001, exc))
        return out

    def release_loaded(self) -> None:
        pass

    def finished_async_loads(self) -> list[tuple[wire.TransferOp, LoadResult]]:
        return []

    def order_after_async_loads(self, blocks: frozenset[int]) -> None:
        pass

    def wait_async_loads(self, blocks: frozenset[int]) -> None:
        pass

    def park_load(self, request_id: int, llm_request: Any, blocks: frozenset[int]) -> None:
        pass

    def unpark_load(self, request_id: int) -> None:
        pass

    def abandoned_load_blocks(self) -> frozenset[int]:
        return frozenset()

    def note_saving(self, request_id: int, llm_request: Any) -> None:
        pass

    def forget_saving(self, request_id: int) -> None:
        pass

    def ended_saving_requests(self) -> frozenset[int]:
        return frozenset()

    def store(self, op: wire.TransferOp) -> int:
        if self.fail:
            raise BackendError("store", self.fail)
        self.stored.append(op)
        return 1

    def commits_pending(self, session_id: str) -> bool:
        return session_id in self.publishing

    def register(self, pool: Any, geometry: Any, layout: Any = None) -> None:
        pass

    def layer_groups(self) -> None:
        return None

    def close(self) -> None:
        pass


class Req:
    def __init__(self, rid: int, tokens: list[int], salt: str | None = None) -> None:
        self.request_id = rid
        self.tokens = tokens
        self.cache_salt = salt

    def get_tokens(self, beam: int) -> list[int]:
        return self.tokens


@pytest.fixture
def trtllm() -> Any:
    """The shipped hooks module (imported after the stand-in is on sys.path)."""
    return importlib.import_module(contract.CONNECTOR_MODULE)


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch, trtllm: Any) -> FakeBackend:
    backend = FakeBackend()
    # where each hook class builds its backend
    monkeypatch.setattr(importlib.import_module("kvoffload.connector.scheduler"), "start_scheduler_client",
                        lambda *a, **k: backend)  # fmt: skip
    monkeypatch.setattr(importlib.import_module("kvoffload.connector.worker"), "start_worker_backend",
                        lambda *a, **k: backend)  # fmt: skip
    monkeypatch.setenv(contract.ENV_METRICS_ENABLED, "false")
    monkeypatch.setenv(contract.ENV_ASYNC_SAVE, "false")
    return backend


def _args() -> Any:
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, TorchLlmArgs

    return TorchLlmArgs(model="hooks", kv_cache_config=KvCacheConfig(tokens_per_block=16))


def _new(rid: int, tokens: list[int], blocks: list[int], computed: int, scheduled: int) -> Any:
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData, SchedulerOutput

    return SchedulerOutput(new_requests=[RequestData(rid, tokens, blocks, computed, scheduled)])


def test_hit_becomes_one_load_and_new_chunks_one_save(fake: FakeBackend, trtllm: Any) -> None:
    sched = trtllm.KvoffloadConnectorScheduler(_args())
    tokens = list(range(200))
    fake.hit = 128
    assert sched.get_num_new_matched_tokens(Req(1, tokens), 0) == (128, False)
    blocks = list(range(13))
    sched.update_state_after_alloc(Req(1, tokens), blocks)
    meta = sched.build_connector_meta(_new(1, tokens, blocks, 0, 72))
    (load,) = meta.loads
    assert (load.start, load.end, load.skip_tokens, load.block_ids) == (0, 128, 0, tuple(blocks[:8]))
    (save,) = meta.saves  # [128, 192): the chunk this step completes
    assert (save.start, save.end, save.block_ids) == (128, 192, tuple(blocks[8:12]))
    assert save.token_ids == tuple(tokens[:192])
    assert sched.request_finished(Req(1, tokens), blocks) is True  # held until its save is published
    assert fake.sessions_ended == [load.session_id]


def test_failed_lookup_promises_nothing_and_forgets_an_earlier_promise(fake: FakeBackend, trtllm: Any) -> None:
    sched = trtllm.KvoffloadConnectorScheduler(_args())
    tokens = list(range(200))
    fake.hit = 192
    assert sched.get_num_new_matched_tokens(Req(1, tokens), 0)[0] == 192
    fake.fail = "timeout"  # TensorRT-LLM asks again (request rescheduled): the sidecar is now down
    assert sched.get_num_new_matched_tokens(Req(1, tokens), 0) == (0, False)
    meta = sched.build_connector_meta(_new(1, tokens, list(range(13)), 0, 200))
    assert meta.loads == ()


def test_salts_reach_every_op(fake: FakeBackend, trtllm: Any) -> None:
    sched = trtllm.KvoffloadConnectorScheduler(_args())
    tokens = list(range(130))
    sched.get_num_new_matched_tokens(Req(1, tokens, salt="tenant"), 0)
    meta = sched.build_connector_meta(_new(1, tokens, list(range(9)), 0, 130))
    assert meta.saves and all(op.salt and op.salt != "tenant" for op in meta.saves)


def test_a_failed_load_never_raises_from_start_load_kv_but_stops_the_forward(fake: FakeBackend, trtllm: Any) -> None:
    """start_load_kv runs outside any try in TensorRT-LLM (an exception stops the engine); the first
    layer hook, inside ``_forward_step``'s try, refuses to run the forward on the missing KV."""
    worker = trtllm.KvoffloadConnectorWorker(_args())
    op = wire.TransferOp(1, "s-1", tuple(range(64)), 0, 64, (0, 1, 2, 3), 0, "")
    fake.fail = "timeout"
    worker.bind_connector_meta(wire.ConnectorMetadata(loads=(op,)))
    worker.start_load_kv(None)
    with pytest.raises(trtllm.KvoffloadLoadError, match=r"\[1\]"):
        worker.wait_for_layer_load(0, None)
    worker.wait_for_layer_load(1, None)  # raised once
    worker.bind_connector_meta(wire.ConnectorMetadata(saves=(op,)))
    worker.wait_for_save(None)  # logged and counted, never raised
    assert worker.get_finished([1], []) == ([1], [])  # nothing to publish: its blocks go back


def test_a_model_whose_every_layer_group_slides_is_refused_at_start_naming_the_windows(
    fake: FakeBackend, trtllm: Any
) -> None:
    """Served layer groups need one that attends to the whole prompt (the anchor, whose pages never
    leave a live request); a model of sliding windows only is refused at start, by its windows."""
    import torch
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout import describe_pool

    layout = describe_pool(torch.zeros(8, 2, 2, 64, dtype=torch.float16), 16, 4096)
    worker = trtllm.KvoffloadConnectorWorker(_args())
    with pytest.raises(RuntimeError, match=r"sliding attention window \(4096 tokens\) and none attends"):
        worker.register_kv_cache_layout(layout)


def test_an_async_save_is_reported_done_only_once_its_commits_are_answered(
    fake: FakeBackend, trtllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Copied is not yet findable: the save is done for TensorRT-LLM (which waits for every rank's
    report) when lookups would find it, so under TP a prompt sent after it hits on every rank."""
    monkeypatch.setenv(contract.ENV_ASYNC_SAVE, "true")
    worker = trtllm.KvoffloadConnectorWorker(_args())
    op = wire.TransferOp(1, "s-1", tuple(range(64)), 0, 64, (0, 1, 2, 3), 0, "")
    fake.publishing.add("s-1")
    worker.bind_connector_meta(wire.ConnectorMetadata(saves=(op,)))
    worker.wait_for_save(None)
    deadline = time.monotonic() + 10
    while (not fake.stored or worker.saving_request_ids) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.stored == [op] and not worker.saving_request_ids
    assert worker.get_finished([1], []) == ([], [])
    fake.publishing.clear()
    assert worker.get_finished([], []) == ([1], [])


class _EngineStream:
    """A stand-in CUDA stream: ``record_event`` returns a marker naming the stream's work so far."""

    def __init__(self) -> None:
        self.recorded = 0

    def record_event(self) -> str:
        self.recorded += 1
        return f"engine-work-{self.recorded}"


@pytest.mark.parametrize("path", ["async_load", "async_save"])
def test_off_thread_copies_wait_on_the_device_for_the_stream_passed_to_the_hook(
    path: str, fake: FakeBackend, trtllm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The loader and saver threads copy on streams of their own: each copy must first wait for an
    event recorded on the stream TensorRT-LLM passed to ``start_load_kv``/``wait_for_save`` (a fresh
    block may still be written by a forward pass queued before it was freed)."""
    worker_module = importlib.import_module("kvoffload.connector.worker")
    steps: list[str] = []
    monkeypatch.setattr(worker_module, "order_after", lambda event: steps.append(f"after {event}"))
    monkeypatch.setattr(fake, "expect_async_load", lambda: None, raising=False)
    monkeypatch.setattr(fake, "start_async_load", lambda op: steps.append("load copies"), raising=False)
    monkeypatch.setattr(fake, "store", lambda op: steps.append("save copies") or 1)
    monkeypatch.setenv(contract.ENV_ASYNC_SAVE, "true")
    worker = trtllm.KvoffloadConnectorWorker(_args())
    op = wire.TransferOp(1, "s-1", tuple(range(64)), 0, 64, (0, 1, 2, 3), 0, "")
    stream = _EngineStream()
    if path == "async_load":
        worker.bind_connector_meta(wire.ConnectorMetadata(async_loads=(op,)))
        worker.start_load_kv(stream)
    else:
        worker.bind_connector_meta(wire.ConnectorMetadata(saves=(op,)))
        worker.wait_for_save(stream)
    deadline = time.monotonic() + 10
    while len(steps) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    copies = "load copies" if path == "async_load" else "save copies"
    assert steps == ["after engine-work-1", copies]


class AdapterReq(Req):
    """An ``LlmRequest`` under a LoRA adapter (``RequestData`` never carries it)."""

    def __init__(self, rid: int, tokens: list[int], lora_task_id: int, lora_path: str) -> None:
        super().__init__(rid, tokens)
        self.lora_task_id = lora_task_id
        self.py_lora_path = lora_path
        self.is_finished = False


def test_a_reaped_request_that_comes_back_saves_under_its_own_scope(
    fake: FakeBackend, trtllm: Any, tmp_path: Path
) -> None:
    """Request 1 (adapter 5) loses its state when one of its blocks is handed to request 2 (as if it
    had ended); TensorRT-LLM still runs it, and its saves keep adapter 5's scope, not RequestData's."""
    from kvoffload.connector.identities import AdapterIdentities
    from kvoffload.connector.keys import key_salt

    sched = trtllm.KvoffloadConnectorScheduler(_args())
    tokens = list(range(200))
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    adapter = AdapterReq(1, tokens, lora_task_id=5, lora_path=str(tmp_path))
    sched.get_num_new_matched_tokens(adapter, 0)
    sched.update_state_after_alloc(adapter, list(range(13)))
    sched.build_connector_meta(_new(2, list(range(1000, 1040)), [5, 20, 21], 0, 40))
    assert 1 not in sched.tracked_request_ids, "request 1 was not reaped: the test no longer reaches the path"
    meta = sched.build_connector_meta(_new(1, tokens, list(range(13)), 0, 200))
    scope = key_salt(adapter, AdapterIdentities().of(adapter))
    assert meta.saves and {op.salt for op in meta.saves} == {scope} and scope != key_salt(Req(9, tokens))


def test_a_request_reported_without_a_lookup_is_never_saved(fake: FakeBackend, trtllm: Any) -> None:
    """``RequestData`` alone cannot say which adapter or image the KV depends on: no save."""
    sched = trtllm.KvoffloadConnectorScheduler(_args())
    meta = sched.build_connector_meta(_new(7, list(range(200)), list(range(13)), 0, 200))
    assert meta.saves == ()


def test_a_layer_group_of_two_regions_per_page_is_refused_at_start_naming_them(fake: FakeBackend, trtllm: Any) -> None:
    """A page of key/value plus block scales (quantized KV) is two regions: not one pool the
    connector's chunk copies could move; refused at start rather than left to upstream's default."""
    import torch
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_layout import (
        KvCacheBufferRef,
        KvCacheLayerGroupLayout,
        KvCacheLayout,
        KvCacheRegion,
    )

    pool, scales = torch.zeros(8, 2, 2, 64, dtype=torch.float16), torch.zeros(8, 2, 2, 4, dtype=torch.float16)
    refs = tuple(KvCacheBufferRef(layer, role) for layer in range(2) for role in ("key", "value"))
    regions = tuple(KvCacheRegion(t.data_ptr(), t[0].numel() * 2, t.stride(0) * 2, 8, refs) for t in (pool, scales))
    layout = KvCacheLayout(16, (KvCacheLayerGroupLayout(0, (0, 1), None, regions),), torch.float16)
    worker = trtllm.KvoffloadConnectorWorker(_args())
    with pytest.raises(RuntimeError, match=r"1 layer group, 2 region\(s\) per page"):
        worker.register_kv_cache_layout(layout)


def test_a_layer_group_report_for_a_request_whose_other_pages_were_never_reported_saves_none_of_them(
    fake: FakeBackend, trtllm: Any
) -> None:
    """A running request reported per layer group while the scheduler knows only its anchor pages
    (its first report came before the worker registered its layer groups): the unknown pages are
    never guessed, the chunk they hold is never saved (nor anything after it), and the hook does not
    raise (an exception in ``build_connector_meta`` stops the engine)."""
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData, SchedulerOutput

    from kvoffload.connector.layout import describe_layer_groups

    sched = trtllm.KvoffloadConnectorScheduler(_args())
    tokens = list(range(129))
    assert sched.get_num_new_matched_tokens(Req(1, tokens), 0) == (0, False)
    sched.update_state_after_alloc(Req(1, tokens), [0, 1])
    assert sched.build_connector_meta(_new(1, tokens, [0, 1], 0, 32)).saves == ()  # half a chunk
    fake.layer_groups = lambda: describe_layer_groups([(0, 48, 1, [512], [1, 1]), (1, None, 1, [512], [1, 1])])
    for ordinals, scheduled in (((2, 3), 32), ((4, 5, 6, 7), 64)):
        by_group = [[10 + o for o in ordinals], list(ordinals)]
        cached = RequestData(1, [], [], 0, scheduled, new_block_ids_by_layer_group=by_group)
        assert sched.build_connector_meta(SchedulerOutput(cached_requests=[cached])).saves == ()


def test_an_idle_attention_dp_rank_fences_every_layer_groups_pages_of_requests_that_vanished(
    fake: FakeBackend, trtllm: Any
) -> None:
    """Under attention DP a rank with no request joins the others' forward with a dummy request that
    KVCacheManagerV2 gives a page in every layer group: the pages of a request that ended unseen
    (cancelled: no ``request_finished``) are fenced in the sliding group too, not only the anchor's."""
    from tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector import RequestData, SchedulerOutput
    from tensorrt_llm.llmapi.llm_args import KvCacheConfig, TorchLlmArgs

    from kvoffload.connector.layout import describe_layer_groups, page_key

    args = TorchLlmArgs(model="hooks", enable_attention_dp=True, kv_cache_config=KvCacheConfig(tokens_per_block=16))
    fake.layer_groups = lambda: describe_layer_groups([(0, 48, 1, [512], [1, 1]), (1, None, 1, [512], [1, 1])])
    sched = trtllm.KvoffloadConnectorScheduler(args)
    tokens = list(range(70))
    assert sched.get_num_new_matched_tokens(Req(1, tokens), 0) == (0, False)
    by_group = [[20, 21, 22, 23, 24], [0, 1, 2, 3, 4]]  # group 0 slides, group 1 (the anchor) is full
    sched.update_state_after_alloc_by_layer_group(Req(1, tokens), by_group)
    first = RequestData(1, tokens, [], 0, 70, new_block_ids_by_layer_group=by_group)
    sched.build_connector_meta(SchedulerOutput(new_requests=[first], attention_dp_rank=0))
    idle = sched.build_connector_meta(SchedulerOutput(attention_dp_rank=0))  # cancelled: the rank idles
    assert idle.fresh_blocks == frozenset([0, 1, 2, 3, 4, *(page_key(1, page) for page in by_group[0])])
    assert sched.tracked_request_ids == frozenset()
