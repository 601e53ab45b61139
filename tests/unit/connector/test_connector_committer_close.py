"""The committer after ``close``: what a heartbeat's retry or a late copy queues then is refused and
kept to abort, never left pending (a pending COMMIT nobody sends stalls every later wait for idle)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

from kvoffload.connector.backends.commits import PendingCommits
from kvoffload.connector.backends.committer import Committer
from kvoffload.connector.metrics import ConnectorMetrics


class _Unanswered:
    """A reply that never comes in time (a stalled server)."""

    def result(self, timeout: float | None = None) -> Any:
        raise TimeoutError("no answer")


class _StalledServer:
    """The one server the committer's transfers reach: every abort times out."""

    def __init__(self) -> None:
        self.transfer = SimpleNamespace(
            engine_driven_context=SimpleNamespace(
                mq_timeout=0.01, req_client=SimpleNamespace(commit_store=lambda *a: _Unanswered())
            )
        )
        self.slow_calls = 0

    # the connection's and the segments' faces, as the committer uses them
    def slow(self, operation: str, detail: str) -> None:
        self.slow_calls += 1

    def commit_target(self, transfer: Any, segment: Any) -> Any:
        return self.transfer

    def is_current(self, transfer: Any) -> bool:
        return True


def _key(session: str) -> IPCCacheServerKey:
    return IPCCacheServerKey(
        model_name="m", world_size=1, worker_id=0, token_ids=(1, 2, 3, 4), start=0, end=4,
        request_id=session, cache_salt="", num_kv_readers=1,
    )  # fmt: skip


def test_a_retry_or_a_commit_queued_after_close_is_kept_to_abort_and_leaves_nothing_pending() -> None:
    server, pending = _StalledServer(), PendingCommits()
    committer = Committer("worker", 1, server, server, pending, ConnectorMetrics("m", "sidecar", enabled=False), None)  # type: ignore[arg-type]
    committer.abort(_key("stalled"), (server.transfer, None))
    assert pending.wait_idle(5.0)
    assert committer.unaborted == 1 and server.slow_calls == 1, "the unanswered abort is kept"
    committer.close(timeout_s=5.0)

    committer.retry_aborts()  # the heartbeat, racing the backend's close
    released: list[str] = []
    committer.later("store", _key("late"), None, (server.transfer, None), on_done=lambda: released.append("late"))

    assert pending.wait_idle(0.5), "a COMMIT queued after close stays pending forever"
    assert committer.unaborted == 2, "both reservations stay kept, so the context is not unregistered over them"
    assert released == ["late"]
