"""With ``--webhook-client-ca`` the webhook answers reviews only for a caller holding a client
certificate of that CA (the apiserver, given one through its ``AdmissionConfiguration``
``kubeConfigFile``): a caller that is not the apiserver gets no review answered, however well it
knows the cluster's uids (issue 42, item 1). Probes, which present no certificate, still pass.

The webhook server runs here on 127.0.0.1 with the stand-in apiserver of ``webhook_process`` (one
injected Deployment): a certified caller gets the real injection patch for its pod.
"""

from __future__ import annotations

import datetime
import json
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvoffload import contract as c
from kvoffload.operator.admission.webhook import WebhookServer
from kvoffload.operator.admission.webhook_tls import issue
from kvoffload.operator.metrics import OperatorMetrics
from tests.support.webhook_process import StandInApiserver, pod_review, post

pytestmark = [pytest.mark.operator]


@dataclass(frozen=True)
class ClientAuthority:
    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def client_authority(name: str) -> ClientAuthority:
    """A CA and one client certificate it signed (``CN=name``, client-auth usage)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name}-ca")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    cert = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip
    pem = serialization.Encoding.PEM
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return ClientAuthority(ca.public_bytes(pem), cert.public_bytes(pem), key_pem)


APISERVER = client_authority("kube-apiserver")


@pytest.fixture(scope="module")
def certified_webhook() -> Iterator[WebhookServer]:
    server = WebhookServer(StandInApiserver(), OperatorMetrics(), issue(["127.0.0.1"]), 0,  # type: ignore[arg-type]
                           host="127.0.0.1", client_ca_pem=APISERVER.ca_pem)  # fmt: skip
    server.start()
    try:
        yield server
    finally:
        server.stop()


def exchange(port: int, data: bytes, tmp_path: Path, client: ClientAuthority | None) -> tuple[int, bytes]:
    """Send ``data`` over TLS (presenting ``client``'s certificate, if any): (status, body); 0 when
    the TLS handshake itself failed."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    if client is not None:
        cert, key = tmp_path / "client.crt", tmp_path / "client.key"
        cert.write_bytes(client.cert_pem)
        key.write_bytes(client.key_pem)
        context.load_cert_chain(str(cert), str(key))
    reply = bytearray()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, context.wrap_socket(raw) as tls:
            tls.sendall(data)
            while chunk := tls.recv(65536):
                reply += chunk
    except (ssl.SSLError, ConnectionError):
        return 0, b""
    head, _, body = bytes(reply).partition(b"\r\n\r\n")
    return (int(head.split(b" ")[1]), body) if head else (0, b"")


def review_bytes() -> bytes:
    return post(json.dumps(pod_review("a-review")).encode())


def test_the_apiservers_certificate_gets_the_injection(certified_webhook: WebhookServer, tmp_path: Path) -> None:
    status, body = exchange(certified_webhook.port, review_bytes(), tmp_path, APISERVER)
    assert status == 200 and "patch" in json.loads(body)["response"]


def test_a_caller_without_a_certificate_gets_no_review_answered(
    certified_webhook: WebhookServer, tmp_path: Path
) -> None:
    status, body = exchange(certified_webhook.port, review_bytes(), tmp_path, None)
    assert status == 401 and b"patch" not in body and len(body.strip().splitlines()) == 1


def test_a_certificate_of_another_authority_is_refused_in_the_handshake(
    certified_webhook: WebhookServer, tmp_path: Path
) -> None:
    status, _ = exchange(certified_webhook.port, review_bytes(), tmp_path, client_authority("kube-apiserver"))
    assert status == 0


def test_probes_without_a_certificate_still_pass(certified_webhook: WebhookServer, tmp_path: Path) -> None:
    request = f"GET {c.PATH_READY} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    assert exchange(certified_webhook.port, request, tmp_path, None)[0] == 200
