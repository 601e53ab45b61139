"""The webhook's TLS and registration: a serving certificate kept in one Secret in the operator's
namespace (every replica serves with the same one), the CA that signs it in another (read only to
issue or renew), and the MutatingWebhookConfiguration that sends opted-in pods to it, with that CA
as its caBundle. Both Secrets name the operator's Deployment as their owner, so they go with it.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse, urlunparse

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvoffload import contract as c
from kvoffload.operator.api.kube import Kube, KubeApiError, namespaced_path
from kvoffload.operator.api.operator_deployment import OperatorDeployment

log = logging.getLogger("kvoffload.operator")
CA_DAYS = 3650
SERVING_DAYS = 365
RENEW_BEFORE_DAYS = 30
WEBHOOK_TIMEOUT_S = 5
MWC_PATH = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


@dataclass(frozen=True)
class TlsMaterial:
    ca_pem: bytes
    ca_key_pem: bytes
    cert_pem: bytes
    key_pem: bytes


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())  # fmt: skip


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def issue(hosts: Sequence[str], ca_pem: bytes | None = None, ca_key_pem: bytes | None = None,
          now: datetime.datetime | None = None) -> TlsMaterial:  # fmt: skip
    """A serving certificate for ``hosts``, signed by the given CA or a new one."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if ca_pem is None or ca_key_pem is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvoffload-webhook-ca")])
        ca_cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(ca_key, hashes.SHA256())
        )  # fmt: skip
        ca_pem, ca_key_pem = ca_cert.public_bytes(serialization.Encoding.PEM), _key_pem(ca_key)
    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    ca_key_loaded = serialization.load_pem_private_key(ca_key_pem, password=None)
    assert isinstance(ca_key_loaded, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=SERVING_DAYS))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key_loaded, hashes.SHA256())
    )  # fmt: skip
    return TlsMaterial(ca_pem, ca_key_pem, cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def still_good(material: TlsMaterial, hosts: Sequence[str], now: datetime.datetime | None = None) -> bool:
    """Whether the serving certificate covers ``hosts`` and is not due for renewal."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    cert = x509.load_pem_x509_certificate(material.cert_pem)
    if cert.not_valid_after_utc - now < datetime.timedelta(days=RENEW_BEFORE_DAYS):
        return False
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    covered = {str(n.value) for n in names}
    return all(h in covered for h in hosts)


_SERVING_KEYS = ("ca.crt", "tls.crt", "tls.key")
_CA_KEYS = ("ca.crt", "ca.key")


def _decoded(secret: Mapping[str, Any] | None, keys: Sequence[str]) -> tuple[bytes, ...] | None:
    data = (secret or {}).get("data") or {}
    if not all(k in data for k in keys):
        return None
    return tuple(base64.b64decode(data[k]) for k in keys)


def _serving_from_secret(secret: Mapping[str, Any] | None) -> TlsMaterial | None:
    """The serving certificate a Secret holds (its ``ca_key_pem`` empty: it is kept elsewhere)."""
    values = _decoded(secret, _SERVING_KEYS)
    return None if values is None else TlsMaterial(values[0], b"", values[1], values[2])


def _secret_body(namespace: str, name: str, data: Mapping[str, bytes], owners: object = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": name, "namespace": namespace, "labels": {c.LABEL_MANAGED_BY: c.LABEL_MANAGED_BY_VALUE}},
        "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
    }  # fmt: skip
    if owners:
        body["metadata"]["ownerReferences"] = owners
    return body


def _owned(secret: Mapping[str, Any] | None, owner: OperatorDeployment | None) -> bool:
    """Whether the Secret needs no write for its owner (``owner`` None: its owners are left as they are)."""
    return owner is None or owner.owns(secret)


def _write(kube: Kube, namespace: str, name: str, data: Mapping[str, bytes],
           current: Mapping[str, Any] | None, owner: OperatorDeployment | None = None) -> Mapping[str, Any] | None:  # fmt: skip
    """Create or replace the Secret, owned by ``owner`` (None: the owners it has stay); when another
    replica wrote it first (409), theirs (None if gone). One deleted since it was read (the garbage
    collector taking an earlier install's) is created again."""
    owners = (current or {}).get("metadata", {}).get("ownerReferences")
    body = _secret_body(namespace, name, data, owner.with_reference(owners) if owner else owners)
    try:
        if current is not None:
            body["metadata"]["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion")
            try:
                kube.request("PUT", namespaced_path("/api/v1", "secrets", namespace, name), body=body)
                return body
            except KubeApiError as exc:
                if exc.status != 404:
                    raise
                del body["metadata"]["resourceVersion"]
                if owner is None:
                    body["metadata"].pop("ownerReferences", None)  # the owner it had may be gone too
        kube.create(namespaced_path("/api/v1", "secrets", namespace), body)
    except KubeApiError as exc:
        if exc.status != 409:
            raise
        return kube.get(namespaced_path("/api/v1", "secrets", namespace, name))
    return body


def _ensure_ca(kube: Kube, namespace: str, name: str, owner: OperatorDeployment | None = None) -> tuple[bytes, bytes]:
    """(CA certificate, CA key) from the CA's own Secret, a new CA when missing (and given ``owner``
    when it names another)."""
    secret = kube.get(namespaced_path("/api/v1", "secrets", namespace, name))
    found = _decoded(secret, _CA_KEYS)
    if found is not None and _owned(secret, owner):
        return found[0], found[1]
    if found is not None:
        seed = (found[0], found[1])  # an earlier install's CA: kept, owned by this operator from now on
    else:
        fresh = issue(["kvoffload-webhook-ca"])
        seed = (fresh.ca_pem, fresh.ca_key_pem)
    data = dict(zip(_CA_KEYS, seed, strict=True))
    written = _decoded(_write(kube, namespace, name, data, secret, owner), _CA_KEYS)
    if written is None:
        raise RuntimeError(f"Secret {namespace}/{name}: the webhook CA could not be stored")
    return written[0], written[1]


def ensure_tls(kube: Kube, namespace: str, name: str, hosts: Sequence[str],
               ca_name: str = c.WEBHOOK_CA_SECRET, owner: OperatorDeployment | None = None) -> TlsMaterial:  # fmt: skip
    """The serving certificate in Secret ``name``, issued (or renewed) when missing, stale or for other
    hosts by the CA kept apart in Secret ``ca_name``, which is read only then. Both Secrets are
    owned by ``owner``, the operator's Deployment (an earlier install's are taken over). The result
    carries no CA key. Replicas racing to write a Secret agree on whichever lands first."""
    path = namespaced_path("/api/v1", "secrets", namespace, name)
    secret = kube.get(path)
    current = _serving_from_secret(secret)
    if current is not None and still_good(current, hosts) and _owned(secret, owner):
        return current
    ca_pem, ca_key_pem = _ensure_ca(kube, namespace, ca_name, owner)
    if current is not None and still_good(current, hosts) and current.ca_pem == ca_pem:
        material = current  # only the owner changes
    else:
        material = issue(hosts, ca_pem, ca_key_pem)
        log.info("webhook certificate issued for %s", ", ".join(hosts))
    data = dict(zip(_SERVING_KEYS, (material.ca_pem, material.cert_pem, material.key_pem), strict=True))
    winner = _serving_from_secret(_write(kube, namespace, name, data, secret, owner))
    if winner is None:
        raise RuntimeError(f"Secret {namespace}/{name}: the webhook certificate could not be stored")
    return winner


WEBHOOK_NAMES = ("pods.kvoffload.io", "workloads.kvoffload.io")
"""The registration's two webhooks (pods, then Deployments and StatefulSets)."""
NEVER_INJECTED_NAMESPACES = ("kube-system",)
"""Namespaces whose pods are never sent to the webhook, besides the operator's own: the cluster's
own components must not wait on (or be changed by) it."""


@dataclass(frozen=True)
class ReviewScope:
    """The namespaces the registration sends reviews from: none of ``excluded``, and only ``watched``
    when that is set. The webhook answers nothing about any other namespace, whoever asks."""

    excluded: frozenset[str]
    watched: frozenset[str] = frozenset()

    @classmethod
    def of_registration(cls, own_namespace: str, watched: Sequence[str] = ()) -> ReviewScope:
        return cls(frozenset({*NEVER_INJECTED_NAMESPACES, own_namespace} - {""}), frozenset(watched))

    def covers(self, namespace: str) -> bool:
        return namespace not in self.excluded and (not self.watched or namespace in self.watched)


def _carries_ours(obj: str) -> str:
    """CEL: ``obj`` (``object`` or ``oldObject``) carries an annotation of kvoffload's or its template label."""
    return (f"({obj} != null && ((has({obj}.metadata.annotations) && {obj}.metadata.annotations.exists(k, "
            f"k.startsWith('{c.ANNOTATION_PREFIX}'))) || (has({obj}.spec.template.metadata.labels) && "
            f"'{c.LABEL_INJECT}' in {obj}.spec.template.metadata.labels)))")  # fmt: skip


WORKLOAD_MATCH_CONDITIONS = (
    {"name": "kvoffload-workloads", "expression": f"{_carries_ours('object')} || {_carries_ours('oldObject')}"},
)
"""The workloads webhook is called only for a Deployment or StatefulSet that carries (or carried, before
the write) a ``kvoffload.io/`` annotation or kvoffload's template label: a webhook that cannot answer
costs every other write in the cluster nothing."""


def webhook_configuration(name: str, ca_pem: bytes, client: Mapping[str, Any], namespaces: Sequence[str],
                          own_namespace: str) -> dict[str, Any]:  # fmt: skip
    """The MutatingWebhookConfiguration: only pods whose template carries the operator's label are
    sent, at creation, never from kube-system or the operator's own namespace; a webhook that
    cannot be reached admits them as the user wrote them. A second entry sees each Deployment and
    StatefulSet CREATE there (``new_workloads``: one created opted in gets its label at once) and
    UPDATE (``workload_updates``: kvoffload's record and label stay kvoffload's)."""
    hook: dict[str, Any] = {
        "name": WEBHOOK_NAMES[0],
        "admissionReviewVersions": ["v1"],
        "sideEffects": "None",
        "failurePolicy": "Ignore",
        "reinvocationPolicy": "Never",
        "matchPolicy": "Equivalent",
        "timeoutSeconds": WEBHOOK_TIMEOUT_S,
        "objectSelector": {"matchExpressions": [{"key": c.LABEL_INJECT, "operator": "Exists"}]},
        "rules": [
            {
                "operations": ["CREATE"],
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ],
        "clientConfig": {**client, "caBundle": base64.b64encode(ca_pem).decode()},
    }
    scope = ReviewScope.of_registration(own_namespace, namespaces)
    selector = [{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": sorted(scope.excluded)}]
    if scope.watched:
        selector.append({"key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(scope.watched)})
    hook["namespaceSelector"] = {"matchExpressions": selector}
    workloads = {
        **hook, "name": WEBHOOK_NAMES[1],
        "rules": [{"operations": ["CREATE", "UPDATE"], "apiGroups": ["apps"], "apiVersions": ["v1"],
                   "resources": ["deployments", "statefulsets"], "scope": "Namespaced"}],
        "clientConfig": {**_client_at(client, c.WEBHOOK_WORKLOADS_PATH), "caBundle": hook["clientConfig"]["caBundle"]},
    }  # fmt: skip
    del workloads["objectSelector"]  # the opt-in is an annotation, which no selector can match: a condition does
    workloads["matchConditions"] = [dict(condition) for condition in WORKLOAD_MATCH_CONDITIONS]
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name, "labels": {c.LABEL_MANAGED_BY: c.LABEL_MANAGED_BY_VALUE}},
        "webhooks": [hook, workloads],
    }  # fmt: skip


def _client_at(client: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The same client config with another path (a URL's, or the Service's)."""
    if "url" in client:
        return {"url": urlunparse(urlparse(str(client["url"]))._replace(path=path))}
    return {"service": {**client["service"], "path": path}}


STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class WebhookRegistrationMissing(RuntimeError):
    """The chart's MutatingWebhookConfiguration is not there to patch (the operator cannot create one)."""


def ca_bundle_patch(ca_pem: bytes) -> dict[str, Any]:
    """A strategic merge patch setting only each webhook's caBundle (entries merged by name)."""
    bundle = base64.b64encode(ca_pem).decode()
    return {"webhooks": [{"name": name, "clientConfig": {"caBundle": bundle}} for name in WEBHOOK_NAMES]}


def patch_ca_bundle(kube: Kube, name: str, ca_pem: bytes) -> None:
    """Put the webhook CA into the registration the chart shipped (``webhook_configuration`` less
    its caBundle): the operator may get and patch it by name, never create one."""
    try:
        kube.request("PATCH", f"{MWC_PATH}/{name}", body=ca_bundle_patch(ca_pem), content_type=STRATEGIC_MERGE_PATCH)
    except KubeApiError as exc:
        if exc.status != 404:
            raise
        raise WebhookRegistrationMissing(
            f"MutatingWebhookConfiguration {name} does not exist: the Helm chart installs it with "
            "injection.mode=admission (the operator only patches its caBundle)"
        ) from None


def delete_webhook_configuration(kube: Kube, name: str) -> bool:
    return kube.delete(f"{MWC_PATH}/{name}")
