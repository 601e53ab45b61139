"""The webhook's certificates: the serving one in its Secret, the CA's key apart and read only to issue."""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
from cryptography import x509

from kvoffload import contract as c
from kvoffload.operator.admission.webhook_tls import ensure_tls
from kvoffload.operator.api.kube import KubeApiError
from kvoffload.operator.api.operator_deployment import OperatorDeployment

pytestmark = pytest.mark.operator
NS = "kvoffload-system"
HOSTS = ["kvo-webhook.kvoffload-system.svc"]


class SecretStore:
    """The slice of ``Kube`` ensure_tls uses, over an in-memory namespace; records every read."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.reads: list[str] = []
        self.deleted_before_update: set[str] = set()
        """Secrets deleted between their read and their update (the garbage collector)."""

    def get(self, path: str) -> dict[str, Any] | None:
        self.reads.append(path.rsplit("/", 1)[-1])
        found = self.objects.get(path)
        return copy.deepcopy(found) if found is not None else None

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            raise KubeApiError(409, {}, "POST", path)
        self.objects[full] = copy.deepcopy(body)
        return body

    def request(self, method: str, path: str, body: dict[str, Any] | None = None, **_: Any) -> dict[str, Any]:
        assert method == "PUT" and body is not None
        if path in self.deleted_before_update:
            self.deleted_before_update.discard(path)
            self.objects.pop(path, None)
        if path not in self.objects:
            raise KubeApiError(404, {}, method, path)
        self.objects[path] = copy.deepcopy(body)
        return body

    def data(self, name: str) -> dict[str, bytes]:
        raw = self.objects[f"/api/v1/namespaces/{NS}/secrets/{name}"]["data"]
        return {k: base64.b64decode(v) for k, v in raw.items()}


def _issuer(cert_pem: bytes) -> x509.Name:
    return x509.load_pem_x509_certificate(cert_pem).issuer


def test_the_ca_key_is_kept_apart_from_the_serving_certificate_and_never_returned() -> None:
    store = SecretStore()
    tls = ensure_tls(store, NS, c.WEBHOOK_TLS_SECRET, HOSTS)  # type: ignore[arg-type]
    serving, ca = store.data(c.WEBHOOK_TLS_SECRET), store.data(c.WEBHOOK_CA_SECRET)
    assert set(serving) == {"ca.crt", "tls.crt", "tls.key"}, "no CA key beside the serving certificate"
    assert set(ca) == {"ca.crt", "ca.key"}
    assert tls.ca_key_pem == b"" and tls.cert_pem == serving["tls.crt"] and tls.ca_pem == ca["ca.crt"]
    assert _issuer(tls.cert_pem) == x509.load_pem_x509_certificate(ca["ca.crt"]).subject


def test_a_start_with_a_good_certificate_reads_no_ca_key() -> None:
    store = SecretStore()
    first = ensure_tls(store, NS, c.WEBHOOK_TLS_SECRET, HOSTS)  # type: ignore[arg-type]
    store.reads.clear()
    again = ensure_tls(store, NS, c.WEBHOOK_TLS_SECRET, HOSTS)  # type: ignore[arg-type]
    assert again == first and store.reads == [c.WEBHOOK_TLS_SECRET]


def test_new_hosts_renew_the_certificate_with_the_same_ca() -> None:
    store = SecretStore()
    first = ensure_tls(store, NS, c.WEBHOOK_TLS_SECRET, HOSTS)  # type: ignore[arg-type]
    renewed = ensure_tls(store, NS, c.WEBHOOK_TLS_SECRET, [*HOSTS, "other.svc"])  # type: ignore[arg-type]
    assert renewed.cert_pem != first.cert_pem and renewed.ca_pem == first.ca_pem
    assert c.WEBHOOK_CA_SECRET in store.reads


OLD = OperatorDeployment("kvo-kvoffload-operator", "uid-old")
NEW = OperatorDeployment("kvo-kvoffload-operator", "uid-new")


def secret_path(name: str) -> str:
    return f"/api/v1/namespaces/{NS}/secrets/{name}"


def test_both_secrets_are_owned_by_the_operators_deployment_and_a_reinstall_takes_them_over() -> None:
    """Owned by the Deployment, the Secrets go with it at ``helm uninstall``; an operator of a later
    install that finds them still there keeps the CA (pods admitted meanwhile stay trusted) and owns them."""
    store = SecretStore()
    first = ensure_tls(store, NS, c.WEBHOOK_TLS_SECRET, HOSTS, owner=OLD)  # type: ignore[arg-type]
    for name in (c.WEBHOOK_TLS_SECRET, c.WEBHOOK_CA_SECRET):
        assert store.objects[secret_path(name)]["metadata"]["ownerReferences"] == [OLD.reference()]
    again = ensure_tls(store, NS, c.WEBHOOK_TLS_SECRET, HOSTS, owner=NEW)  # type: ignore[arg-type]
    assert again.ca_pem == first.ca_pem and again.cert_pem == first.cert_pem
    for name in (c.WEBHOOK_TLS_SECRET, c.WEBHOOK_CA_SECRET):
        assert store.objects[secret_path(name)]["metadata"]["ownerReferences"] == [NEW.reference()]


def test_a_secret_deleted_between_its_read_and_its_update_is_created_again() -> None:
    store = SecretStore()
    ensure_tls(store, NS, c.WEBHOOK_TLS_SECRET, HOSTS, owner=OLD)  # type: ignore[arg-type]
    store.deleted_before_update = {secret_path(c.WEBHOOK_TLS_SECRET), secret_path(c.WEBHOOK_CA_SECRET)}
    tls = ensure_tls(store, NS, c.WEBHOOK_TLS_SECRET, HOSTS, owner=NEW)  # type: ignore[arg-type]
    assert store.data(c.WEBHOOK_TLS_SECRET)["tls.crt"] == tls.cert_pem
    assert store.data(c.WEBHOOK_CA_SECRET)["ca.crt"] == tls.ca_pem
    for name in (c.WEBHOOK_TLS_SECRET, c.WEBHOOK_CA_SECRET):
        assert store.objects[secret_path(name)]["metadata"]["ownerReferences"] == [NEW.reference()]
