"""The admission webhook's server against hostile peers on 127.0.0.1, run alone in a process of its
own (``tests/support/webhook_process.py``) so its threads and memory are its own: idle and
dribbling connections delay no review, an oversized body is refused unread, a malformed review
gets a 400 and the server goes on serving."""

from __future__ import annotations

import json
import selectors
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvoffload.operator.admission.https_server import HANDLER_THREADS, REQUEST_DEADLINE_S
from tests.support.webhook_process import HUNG_WORKLOAD, WebhookProcess, pod_review, post, webhook_process

pytestmark = [pytest.mark.operator, pytest.mark.reliability]
CHART_VALUES = Path(__file__).resolve().parents[3] / "charts" / "kvoffload" / "values.yaml"
IDLE, SLOWLORIS, REVIEWS = 200, 200, 100
REVIEW_LATENCY_S = 1.0
MAX_THREADS = HANDLER_THREADS + 2
"""The handler threads, the I/O thread and the main thread: nothing per connection."""


@pytest.fixture(scope="module")
def webhook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebhookProcess]:
    with webhook_process(tmp_path_factory.mktemp("webhook")) as server:
        yield server


def review(uid: str, mutate: Callable[[dict[str, Any]], Any] | None = None) -> bytes:
    """A pod review of the injected Deployment, as the apiserver sends it, changed by ``mutate``."""
    body = pod_review(uid)
    if mutate is not None:
        mutate(body)
    return post(json.dumps(body).encode())


def assert_injects(server: WebhookProcess, uid: str) -> None:
    status, body = server.exchange(review(uid))
    assert status == 200, body
    response = json.loads(body)["response"]
    assert response["uid"] == uid and response["allowed"] is True and response["patchType"] == "JSONPatch"


def chart_memory_limit_kib() -> int:
    limit = yaml.safe_load(CHART_VALUES.read_text())["operator"]["resources"]["limits"]["memory"]
    assert limit.endswith("Mi"), limit
    return int(limit[:-2]) * 1024


class Attackers:
    """Connections that never finish a request, held open from one thread for as long as the test
    runs: opened again whenever the server drops one, so the pressure never lets up.

    ``idle`` connect and send nothing, not even a TLS ClientHello; ``slowloris`` complete the TLS
    handshake, then send a review's head one byte every ``DRIBBLE_S``."""

    DRIBBLE_S = 0.25

    def __init__(self, server: WebhookProcess, idle: int, slowloris: int) -> None:
        self.server, self.idle, self.slowloris = server, idle, slowloris
        self.partial = review("slow")[:200]
        self.selector = selectors.DefaultSelector()
        self.opened_at: dict[socket.socket, float] = {}
        self.sent: dict[socket.socket, int] = {}
        self.lifetimes: list[float] = []  # how long each connection lived before the server closed it
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="attackers", daemon=True)

    def open_now(self) -> int:
        return len(self.opened_at)

    def _open(self, slow: bool) -> None:
        raw = socket.create_connection(("127.0.0.1", self.server.port), timeout=5)
        sock: socket.socket = raw
        if slow:
            sock = self.server.client_context.wrap_socket(raw, server_hostname="127.0.0.1")
            self.sent[sock] = 0
        sock.setblocking(False)
        self.opened_at[sock] = time.monotonic()
        self.selector.register(sock, selectors.EVENT_READ, slow)

    def _closed_by_server(self, sock: socket.socket) -> bool:
        try:
            return sock.recv(4096) == b""
        except (ssl.SSLWantReadError, BlockingIOError):
            return False
        except OSError:
            return True

    def _replace(self, sock: socket.socket, slow: bool) -> None:
        self.lifetimes.append(time.monotonic() - self.opened_at.pop(sock))
        self.sent.pop(sock, None)
        self.selector.unregister(sock)
        sock.close()
        if not self.stopping.is_set():
            self._open(slow)

    def _run(self) -> None:
        while not self.stopping.is_set():
            for key, _ in self.selector.select(self.DRIBBLE_S):
                sock, slow = key.fileobj, key.data
                assert isinstance(sock, socket.socket)
                if self._closed_by_server(sock):
                    self._replace(sock, slow)
            for sock, sent in list(self.sent.items()):
                if sent < len(self.partial):
                    try:
                        sock.send(self.partial[sent : sent + 1])
                        self.sent[sock] = sent + 1
                    except (ssl.SSLWantWriteError, BlockingIOError):
                        pass
                    except OSError:
                        self._replace(sock, True)
            time.sleep(self.DRIBBLE_S)

    def __enter__(self) -> Attackers:
        for _ in range(self.idle):
            self._open(slow=False)
        for _ in range(self.slowloris):
            self._open(slow=True)
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)
        for sock in list(self.opened_at):
            sock.close()


def test_real_reviews_are_answered_within_a_second_while_idle_and_slowloris_connections_are_held(
    webhook: WebhookProcess,
) -> None:
    latencies: list[float] = []
    threads: list[int] = []
    held: list[int] = []  # attacking connections open at each review
    with Attackers(webhook, IDLE, SLOWLORIS) as attackers:
        time.sleep(1.0)  # every attacking connection accepted and waiting
        started = time.monotonic()
        for i in range(REVIEWS):
            began = time.monotonic()
            status, body = webhook.exchange(review(f"real-{i}"), timeout=REVIEW_LATENCY_S * 5)
            latencies.append(time.monotonic() - began)
            assert status == 200 and json.loads(body)["response"]["uid"] == f"real-{i}", body
            threads.append(webhook.status("Threads"))
            held.append(attackers.open_now())
            time.sleep(0.05)  # spread over longer than the request deadline: the attack rolls over
        elapsed = time.monotonic() - started
    latencies.sort()
    print(f"\n{REVIEWS} reviews over {elapsed:.1f} s beside {min(held)}-{max(held)} attacking connections: latency p50 "
          f"{latencies[len(latencies) // 2] * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms; server threads max "
          f"{max(threads)}; peak RSS {webhook.status('VmHWM') // 1024} MiB; attacking connections cut off "
          f"{len(attackers.lifetimes)} (lived {min(attackers.lifetimes, default=0):.1f}-"
          f"{max(attackers.lifetimes, default=0):.1f} s)")  # fmt: skip
    assert min(held) >= 0.95 * (IDLE + SLOWLORIS), "the attack was held for the whole run"
    assert latencies[-1] < REVIEW_LATENCY_S, f"slowest review {latencies[-1]:.2f} s"
    assert max(threads) <= MAX_THREADS, threads
    assert webhook.status("VmHWM") < chart_memory_limit_kib()
    assert attackers.lifetimes and max(attackers.lifetimes) < REQUEST_DEADLINE_S + 1.5, (
        "the server cuts attacking connections off"
    )


def test_an_idle_and_a_dribbling_connection_are_closed_by_the_server_after_the_request_deadline(
    webhook: WebhookProcess,
) -> None:
    with Attackers(webhook, 1, 1) as attackers:
        deadline = time.monotonic() + REQUEST_DEADLINE_S + 3
        while len(attackers.lifetimes) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
    first_two = attackers.lifetimes[:2]
    assert len(first_two) == 2, "the server never closed them"
    assert all(REQUEST_DEADLINE_S - 0.5 < t < REQUEST_DEADLINE_S + 1.5 for t in first_two), first_two


def test_a_4_mib_review_is_refused_with_413_without_its_body_growing_the_server(webhook: WebhookProcess) -> None:
    def four_mib_of_env(body: dict[str, Any]) -> None:
        engine = body["request"]["object"]["spec"]["containers"][0]
        engine["env"] = [{"name": f"E{i}", "value": "v" * 20} for i in range(4 * 2**20 // 45)]

    oversized = review("big", four_mib_of_env)
    assert len(oversized) > 4 * 2**20
    peak_before = webhook.status("VmHWM")
    status, body = webhook.exchange(oversized)
    grown_mib = (webhook.status("VmHWM") - peak_before) / 1024
    print(f"\n4 MiB review: {status} {body[:80]!r}; peak RSS grew {grown_mib:.1f} MiB")
    assert status == 413, body
    assert grown_mib < 50
    assert_injects(webhook, "after-big")


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = body
        for key in parents:
            node = node[key]
        node[last] = value

    return mutate


def _drop(path: str) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node = body
        for key in parents:
            node = node[key]
        del node[last]

    return mutate


def _owned_by(deployment: str) -> Callable[[dict[str, Any]], None]:
    def mutate(body: dict[str, Any]) -> None:
        body["request"]["object"]["metadata"]["ownerReferences"][0]["name"] = f"{deployment}-5d8f7c9b4"

    return mutate


MALFORMED: dict[str, bytes] = {
    "not JSON": post(b"{not json"),
    "a JSON list": post(b"[1, 2]"),
    "request a string": review("x", _set("request", "x")),
    "deeply nested": post(b'{"request": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "wrong apiVersion": review("x", _set("apiVersion", "admission.k8s.io/v1beta1")),
    "wrong kind": review("x", _set("kind", "ConversionReview")),
    "a DELETE": review("x", _set("request.operation", "DELETE")),
    "missing uid": review("x", _drop("request.uid")),
    "a uid not a string": review("x", _set("request.uid", 7)),
    "a Deployment's review": review(
        "x", _set("request.kind", {"group": "apps", "version": "v1", "kind": "Deployment"})
    ),
    "object a list": review("x", _set("request.object", [])),
    "object in another namespace": review("x", _set("request.object.metadata.namespace", "elsewhere")),
    "no namespace": review("x", _drop("request.namespace")),
    "invalid Content-Length": b"POST /mutate-pods HTTP/1.1\r\nContent-Length: 12x\r\n\r\n{}",
    "two Content-Lengths": b"POST /mutate-pods HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    "malformed request line": b"POST\r\nContent-Length: 2\r\n\r\n{}",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_review_gets_400_with_one_line_and_no_patch_and_the_server_keeps_serving(
    webhook: WebhookProcess, case: str
) -> None:
    status, body = webhook.exchange(MALFORMED[case])
    assert status == 400, (status, body)
    assert body.endswith(b"\n") and body.count(b"\n") == 1 and b"patch" not in body, body
    assert_injects(webhook, f"after-{case}")


@pytest.mark.parametrize(
    "request_bytes",
    [b"POST /mutate-pods HTTP/1.1\r\nHost: x\r\n\r\n", b"POST /mutate-pods HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"],
    ids=["no Content-Length", "chunked"],
)  # fmt: skip
def test_a_post_without_a_content_length_gets_411(webhook: WebhookProcess, request_bytes: bytes) -> None:
    status, body = webhook.exchange(request_bytes)
    assert status == 411, (status, body)
    assert_injects(webhook, "after-411")


READYZ = b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n"


def test_a_webhook_whose_handlers_all_hang_is_not_ready_until_they_answer_again(webhook: WebhookProcess) -> None:
    assert webhook.exchange(READYZ) == (200, b"ok\n")
    hung = [threading.Thread(target=webhook.exchange, args=(review(f"hung-{i}", _owned_by(HUNG_WORKLOAD)),))
            for i in range(HANDLER_THREADS)]  # fmt: skip
    for thread in hung:
        thread.start()
    time.sleep(0.5)  # every handler thread waits on the hung apiserver
    with pytest.raises(TimeoutError):
        webhook.exchange(READYZ, timeout=1.0)
    for thread in hung:
        thread.join()
    assert webhook.exchange(READYZ) == (200, b"ok\n")
