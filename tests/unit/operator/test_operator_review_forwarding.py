"""A review forwarded to the Lease holder's webhook (``admission.review_forwarding``): the holder's
answer comes back only from a replica of the same install, for the same review, in time; anything
else is a one-line failure, after which the replica answers itself."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from kvoffload import contract as c
from kvoffload.operator.admission.https_server import HttpsServer, Reply, Request
from kvoffload.operator.admission.review_forwarding import client_context, forward_review, split_address
from kvoffload.operator.admission.webhook import server_context
from kvoffload.operator.admission.webhook_tls import TlsMaterial, issue

pytestmark = pytest.mark.operator
INSTALL = issue(["127.0.0.1"])
UID = "705ab4f5"


def answer(uid: str) -> bytes:
    return json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                       "response": {"uid": uid, "allowed": True}}).encode()  # fmt: skip


class Holder:
    """A webhook-shaped server of some install: answers as ``reply`` says, keeps what it was sent."""

    def __init__(self, tls: TlsMaterial, reply: Reply) -> None:
        self.reply, self.requests = reply, list[Request]()
        self.server = HttpsServer(server_context(tls), "127.0.0.1", 0, self.handle, 2**20)

    def handle(self, request: Request) -> Reply:
        self.requests.append(request)
        return self.reply


@pytest.fixture
def holder(request: pytest.FixtureRequest) -> Iterator[Holder]:
    tls, reply = request.param
    served = Holder(tls, reply)
    served.server.start()
    yield served
    served.server.stop()


def forward(address: str) -> bytes | str:
    return forward_review(address, c.WEBHOOK_WORKLOADS_PATH, b'{"review": 1}', UID, client_context(INSTALL.ca_pem),
                          "127.0.0.1", timeout_s=1.0)  # fmt: skip


@pytest.mark.parametrize("holder", [(INSTALL, Reply(200, answer(UID), "application/json"))], indirect=True)
def test_the_holders_answer_comes_back_and_the_holder_is_told_it_was_forwarded(holder: Holder) -> None:
    assert forward(f"127.0.0.1:{holder.server.port}") == answer(UID)
    (sent,) = holder.requests
    assert (sent.path, sent.body, sent.forwarded) == (c.WEBHOOK_WORKLOADS_PATH, b'{"review": 1}', True)


@pytest.mark.parametrize(
    ("holder", "why"),
    [
        ((INSTALL, Reply(200, answer("another-review"), "application/json")), "the holder answered another review"),
        ((INSTALL, Reply(200, b"[]", "application/json")), "not an admission.k8s.io/v1 AdmissionReview"),
        ((INSTALL, Reply(401, b"a client certificate is required\n")), "the holder answered 401"),
        ((issue(["127.0.0.1"]), Reply(200, answer(UID), "application/json")), "CERTIFICATE_VERIFY_FAILED"),
        ((issue(["10.0.0.7"], INSTALL.ca_pem, INSTALL.ca_key_pem), Reply(200, answer(UID))), "IP address mismatch"),
    ],
    indirect=["holder"],
    ids=["another-uid", "not-a-review", "refused", "another-install", "another-name"],
)
def test_an_answer_that_is_not_the_holders_for_this_review_is_a_failure_with_the_reason(
    holder: Holder, why: str
) -> None:
    result = forward(f"127.0.0.1:{holder.server.port}")
    assert isinstance(result, str) and why in result, result


def test_a_holder_that_is_gone_or_never_answers_fails_within_the_timeout() -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    result = forward(f"127.0.0.1:{port}")
    assert isinstance(result, str) and "ConnectionRefusedError" in result, result
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never speaks TLS
        started = time.monotonic()
        result = forward(f"127.0.0.1:{silent.getsockname()[1]}")
        assert isinstance(result, str) and "timed out" in result, result
        assert time.monotonic() - started < 3


@pytest.mark.parametrize(
    ("address", "parsed"),
    [("10.0.0.7:8443", ("10.0.0.7", 8443)), ("[fd00::7]:8443", ("fd00::7", 8443)), ("10.0.0.7", None),
     ("10.0.0.7:0", None), ("10.0.0.7:99999", None), (":8443", None), ("10.0.0.7:\uff18\uff14", None)],
)  # fmt: skip
def test_a_published_address_is_host_and_port_or_nothing(address: str, parsed: tuple[str, int] | None) -> None:
    assert split_address(address) == parsed
