"""A review forwarded to the Lease holder's webhook, so the holder answers it.

During an upgrade that changes the operator's image, the new replica waits for the Lease while both
serve the webhook, and it cannot plan with the holder's inputs (its code may render them otherwise:
``acting_replica``). An app created opted in and answered by it would be admitted as written and
roll again for the holder's label. So it sends such a review on to the holder (the address the holder
published in the Lease), over TLS verified against the install's CA for the webhook's own name, and
returns the holder's answer when it is one for that review. Anything else (no answer within
``FORWARD_TIMEOUT_S``, another status, another review's answer) is a failure: the replica answers
itself, as it did before forwarding existed.
"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload import contract as c

FORWARD_TIMEOUT_S = 1.5
"""Each step of a forward (connect, handshake, send, each read): well inside the registration's 5 s
with the replica's own answer still to come."""
MAX_ANSWER_BYTES = 4 * 2**20
"""An answer is its patch and warnings: far below this."""


def webhook_address(host: str, port: int) -> str:
    """``host:port`` as published in the Lease (an IPv6 host in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of ``webhook_address``'s form, or None."""
    host, colon, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not colon or not host or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def client_context(ca_pem: bytes) -> ssl.SSLContext:
    """TLS to a replica of this install: its certificate signed by the install's CA, for the
    webhook's name (the same Secret serves every replica)."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=ca_pem.decode())
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def holders_answer(body: bytes, uid: str) -> bytes | str:
    """``body`` when it is an AdmissionReview answering review ``uid``, else why not."""
    try:
        document = json.loads(body)
    except ValueError:
        return "the holder's answer is not JSON"
    if not isinstance(document, dict) or document.get("apiVersion") != "admission.k8s.io/v1":
        return "the holder's answer is not an admission.k8s.io/v1 AdmissionReview"
    response = document.get("response")
    if not isinstance(response, dict):
        return "the holder's answer is not an admission.k8s.io/v1 AdmissionReview"
    if response.get("uid") != uid:
        return "the holder answered another review"
    return body


def forward_review(address: str, path: str, body: bytes, uid: str, context: ssl.SSLContext,
                   server_name: str, timeout_s: float = FORWARD_TIMEOUT_S) -> bytes | str:  # fmt: skip
    """The holder's answer to the review ``body`` (``uid``) posted to ``path`` at ``address``, or why
    there is none."""
    target = split_address(address)
    if target is None:
        return f"the holder's address {address[:60]!r} is not host:port"
    head = (f"POST {path} HTTP/1.1\r\nHost: {server_name}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n{c.HEADER_FORWARDED_REVIEW}: 1\r\nConnection: close\r\n\r\n")  # fmt: skip
    try:
        with (socket.create_connection(target, timeout=timeout_s) as raw,
              context.wrap_socket(raw, server_hostname=server_name) as tls):  # fmt: skip
            tls.sendall(head.encode("latin-1") + body)
            response = http.client.HTTPResponse(tls)
            response.begin()
            if response.status != 200:
                return f"the holder answered {response.status}"
            length = response.getheader("Content-Length")
            if length is None or not length.isdigit() or int(length) > MAX_ANSWER_BYTES:
                return "the holder's answer has no Content-Length within bounds"
            answer = response.read(int(length))
    except (OSError, http.client.HTTPException) as exc:  # ssl.SSLError is an OSError
        return f"forwarding to {address} failed: {type(exc).__name__}: {exc}"
    return holders_answer(answer, uid)


@dataclass(frozen=True)
class Forwarding:
    """A replica's way to the holder's webhook."""

    address: Callable[[], str | None]
    """Where to forward a review now (``acting_replica.forwarding_address`` of the Lease read now);
    None: this replica answers it."""
    context: ssl.SSLContext
    server_name: str
    """The webhook's name, which the holder's certificate must carry."""

    def forward(self, address: str, path: str, body: bytes, uid: str) -> bytes | str:
        return forward_review(address, path, body, uid, self.context, self.server_name)
