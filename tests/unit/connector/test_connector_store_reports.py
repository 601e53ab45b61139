"""Reports of committed stores to the cache server's KV-event module: fire-and-forget, never raised."""

from __future__ import annotations

from typing import Any

import pytest
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey
from lmcache.v1.multiprocess.futures import MessagingFuture
from lmcache.v1.multiprocess.protocols.server_module import ServerModuleCallResponse

from kvoffload import chunk_report
from kvoffload.connector.backends.store_reports import MAX_IN_FLIGHT, StoreReporter

pytestmark = pytest.mark.connector


class Errors:
    def __init__(self) -> None:
        self.counted: list[tuple[str, str]] = []

    def error(self, operation: str, reason: str) -> None:
        self.counted.append((operation, reason))


class Client:
    """Answers nothing until told; records what was sent."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[Any] = []
        self.futures: list[MessagingFuture[ServerModuleCallResponse]] = []
        self.fail = fail

    def server_module_call(self, request: Any) -> MessagingFuture[ServerModuleCallResponse]:
        if self.fail:
            raise ConnectionError("socket closed")
        self.sent.append(request)
        future: MessagingFuture[ServerModuleCallResponse] = MessagingFuture()
        self.futures.append(future)
        return future


def key(salt: str = "", worker: int | None = 0) -> IPCCacheServerKey:
    return IPCCacheServerKey(
        model_name="m~layout", world_size=1, worker_id=worker, token_ids=tuple(range(300)), start=0, end=256,
        request_id="s1", cache_salt=salt, num_kv_readers=1,
    )  # fmt: skip


def answer(future: MessagingFuture[ServerModuleCallResponse], success: bool) -> None:
    future.set_result(ServerModuleCallResponse(success=success, payload=b"", error="" if success else "bad"))


def test_an_unsalted_store_is_reported_with_its_chunks_and_the_served_model() -> None:
    client, errors = Client(), Errors()
    StoreReporter("served", 16, errors).report(client, key())  # type: ignore[arg-type]
    (request,) = client.sent
    assert request.method == chunk_report.METHOD
    report = chunk_report.decode(request.payload)
    assert (report.served_model, report.cache_model, report.start, report.end, report.tokens_per_block) == (
        "served", "m~layout", 0, 256, 16,
    )  # fmt: skip
    assert report.token_ids == tuple(range(256)) and errors.counted == []


def test_salted_stores_and_other_tensor_parallel_ranks_are_never_reported() -> None:
    client, errors = Client(), Errors()
    reporter = StoreReporter("served", 16, errors)  # type: ignore[arg-type]
    reporter.report(client, key(salt="stenant"))
    reporter.report(client, key(worker=1))
    assert client.sent == [] and errors.counted == []


def test_a_salted_store_is_reported_only_under_the_lora_scope_its_store_named_for_that_salt() -> None:
    client, errors = Client(), Errors()
    reporter = StoreReporter("served", 16, errors)  # type: ignore[arg-type]
    adapter = chunk_report.LoraScope(7, "adapter-a")
    reporter.scope("kA", adapter)
    reporter.report(client, key(salt="kA"))
    reporter.report(client, key(salt="stenant"))  # a tenant's salt: no scope was ever named for it
    (request,) = client.sent
    report = chunk_report.decode(request.payload)
    assert (report.salt, report.lora) == ("kA", adapter) and errors.counted == []


def test_a_failing_connection_or_a_refused_report_is_counted_never_raised() -> None:
    errors = Errors()
    reporter = StoreReporter("served", 16, errors)  # type: ignore[arg-type]
    reporter.report(Client(fail=True), key())
    client = Client()
    reporter.report(client, key())
    reporter.report(client, key())
    answer(client.futures[0], success=False)
    answer(client.futures[1], success=True)
    reporter.report(client, key())  # collects the two answers
    assert errors.counted == [("kv_event", "error"), ("kv_event", "server_error")]


def test_a_server_that_never_answers_bounds_the_reports_in_flight() -> None:
    client, errors = Client(), Errors()
    reporter = StoreReporter("served", 16, errors)  # type: ignore[arg-type]
    for _ in range(MAX_IN_FLIGHT + 3):
        reporter.report(client, key())
    assert len(client.sent) == MAX_IN_FLIGHT and errors.counted == [("kv_event", "timeout")] * 3


def test_the_in_process_backend_never_reports_its_server_loads_no_event_module(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataclasses

    from kvoffload.connector.backends.inprocess import InProcessServer
    from kvoffload.connector.settings import ConnectorSettings

    monkeypatch.setattr(InProcessServer, "start", lambda self, settings: "tcp://127.0.0.1:1")
    fields = {f.name: None for f in dataclasses.fields(ConnectorSettings) if f.default is dataclasses.MISSING}
    settings = ConnectorSettings(**{**fields, "kv_events": True})  # type: ignore[arg-type]
    assert InProcessServer().settings_for(settings).kv_events is False
