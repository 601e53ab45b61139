"""The worker's background queue (``OpPipeline``): order, fences and errors, with a thread of its own."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvoffload.connector.pipeline import OpPipeline
from kvoffload.connector.wire import TransferOp

pytestmark = pytest.mark.connector


def _op(request_id: int, blocks: tuple[int, ...]) -> TransferOp:
    return TransferOp(request_id, f"s-{request_id}", (), 0, 0, blocks, 0, "")


def _wait_idle(pipeline: OpPipeline) -> None:
    deadline = time.monotonic() + 10
    while pipeline.pending_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pipeline.pending_requests()


class _Gate:
    """A ``run`` callback that holds each op until the test lets it go."""

    def __init__(self) -> None:
        self.ran: list[int] = []
        self.started = threading.Event()
        self.release = threading.Event()

    def __call__(self, op: TransferOp, event: Any) -> None:
        self.started.set()
        assert self.release.wait(10)
        self.ran.append(op.request_id)


def test_ops_run_in_order_and_leave_pending_once_run() -> None:
    gate = _Gate()
    pipeline = OpPipeline("test", gate)
    pipeline.start()
    pipeline.submit([(_op(1, (0,)), None), (_op(1, (1,)), None), (_op(2, (2,)), None)])
    assert gate.started.wait(10)
    assert pipeline.pending_requests() == {1, 2}
    gate.release.set()
    _wait_idle(pipeline)
    assert gate.ran == [1, 1, 2]


def test_a_fence_takes_queued_ops_on_its_blocks_and_waits_for_the_running_one() -> None:
    gate = _Gate()
    pipeline = OpPipeline("test", gate)
    pipeline.start()
    pipeline.submit([(_op(1, (0,)), "e1"), (_op(2, (5,)), "e2"), (_op(3, (0, 9)), "e3")])
    assert gate.started.wait(10)  # op 1 runs, held by the gate
    taken: list[tuple[int, Any]] = []
    fenced = threading.Thread(
        target=pipeline.fence, args=(frozenset({0}), lambda op, e: taken.append((op.request_id, e)))
    )
    fenced.start()
    fenced.join(0.2)
    assert fenced.is_alive(), "the fence waits while the running op names a fenced block"
    assert taken == [(3, "e3")] and pipeline.pending_requests() == {1, 2}
    gate.release.set()
    fenced.join(10)
    assert not fenced.is_alive()


def test_a_request_fence_takes_that_requests_queued_ops_and_waits_for_its_running_one() -> None:
    gate = _Gate()
    pipeline = OpPipeline("test", gate)
    pipeline.start()
    pipeline.submit([(_op(1, (0,)), "e1"), (_op(2, (0,)), "e2"), (_op(1, (7,)), "e3")])
    assert gate.started.wait(10)  # request 1's first op runs, held by the gate
    taken: list[tuple[int, Any]] = []
    fenced = threading.Thread(
        target=pipeline.fence_requests, args=(frozenset({1}), lambda op, e: taken.append((op.request_id, e)))
    )
    fenced.start()
    fenced.join(0.2)
    assert fenced.is_alive(), "the fence waits while the request's op runs"
    assert taken == [(1, "e3")], "request 2's op on the same block stays queued"
    assert pipeline.pending_requests() == {1, 2}
    gate.release.set()
    fenced.join(10)
    assert not fenced.is_alive()
    _wait_idle(pipeline)
    assert gate.ran == [1, 2]


def test_an_op_that_raises_is_logged_and_the_thread_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[int] = []

    def run(op: TransferOp, event: Any) -> None:
        if op.request_id == 1:
            raise RuntimeError("boom")
        ran.append(op.request_id)

    pipeline = OpPipeline("test", run)
    pipeline.start()
    pipeline.submit([(_op(1, (0,)), None), (_op(2, (1,)), None)])
    _wait_idle(pipeline)
    assert ran == [2]
    assert "event=test_error request=1" in caplog.text
