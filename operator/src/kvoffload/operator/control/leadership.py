"""One operator acts at a time: a coordination.k8s.io Lease, held while the operator runs.

A new operator pod (a RollingUpdate, a ``helm upgrade`` or ``rollback``, a second replica) waits,
live and ready, until the Lease is free: released by the old pod when it stops, or expired
``LEASE_DURATION_S`` after its last renewal if it died. The holder renews every
``RENEW_INTERVAL_S``; one that finds the Lease taken, or is refused for a whole term
(``keep_renewing``), stops its handlers. The same identity (the pod's name, kept across container
restarts) takes its own Lease back at once.

``helm uninstall``'s hook seizes the Lease (``Leadership.seize``) whoever holds it: the acting
operator stops at its next renewal, standbys keep waiting, and no operator acts until the hook's
long term has run out, by when Helm has deleted the operator.

The Lease names the operator's Deployment as its owner (``api.operator_deployment``): the garbage collector deletes
it with the Deployment, and an operator of a later install (another Deployment uid) finds a Lease
still there (the collector not done yet) free at once, whatever term its holder wrote.

Every replica serves the admission webhook, and plans there only as the holder does
(``holders_inputs``): the holder writes what its plans depend on into the Lease
(``c.ANN_LEASE_PLANNING``, ``admission.acting_replica.planning_inputs``), sealed under a key derived
from the webhook's serving key (``sealed``), and a replica that does not hold the Lease plans with a
running holder's published inputs whose seal it checks. Had each replica planned with its
own (the old one of a ``helm upgrade`` and the new one waiting, with other defaults), a user's
write answered by one and the other's reconcile would take a workload back and forth, and an app
created opted in would roll once more for the holder's label. The holder also publishes where its
webhook listens (``c.ANN_LEASE_WEBHOOK``, sealed alike): a replica of another operator version, which
cannot plan with the holder's inputs, forwards its reviews there (``admission.review_forwarding``).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import http.server
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvoffload import contract as c
from kvoffload.httpreply import BoundedHTTPServer
from kvoffload.operator.api.kube import Kube, KubeApiError
from kvoffload.operator.api.operator_deployment import OperatorDeployment, earlier_install

log = logging.getLogger("kvoffload.operator")
LEASE_DURATION_S = 15
RENEW_INTERVAL_S = 5.0
RETRY_INTERVAL_S = 1.0
MICROTIME = "%Y-%m-%dT%H:%M:%S.%fZ"


def lease_path(namespace: str, name: str = "") -> str:
    base = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
    return f"{base}/{name}" if name else base


def _parse_time(text: object) -> datetime.datetime | None:
    if not isinstance(text, str):
        return None
    for fmt in (MICROTIME, "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return datetime.datetime.strptime(text, fmt).replace(tzinfo=datetime.timezone.utc)
        except ValueError:
            continue
    return None


def lease_state(
    lease: Mapping[str, Any] | None, identity: str, now: datetime.datetime, owner_gone: bool = False
) -> Literal["free", "ours", "held"]:
    """Whether ``identity`` may take the Lease: nobody holds it (or the holder let it expire, or the
    operator Deployment owning it is gone: an earlier install's), it holds it already, or another
    holder's term is still running."""
    spec = (lease or {}).get("spec") or {}
    holder = spec.get("holderIdentity") or ""
    if not holder or owner_gone:
        return "free"
    if holder == identity:
        return "ours"
    renewed = _parse_time(spec.get("renewTime")) or _parse_time(spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds") or LEASE_DURATION_S
    if renewed is None or now - renewed > datetime.timedelta(seconds=float(duration)):
        return "free"
    return "held"


def lease_body(
    name: str,
    namespace: str,
    identity: str,
    now: datetime.datetime,
    previous: Mapping[str, Any] | None,
    duration_s: int = LEASE_DURATION_S,
    owner: OperatorDeployment | None = None,
    planning: str = "",
    webhook: str = "",
) -> dict[str, Any]:
    """The Lease as ``identity`` holds it from ``now`` for ``duration_s`` (a takeover counts a
    transition), owned by ``owner`` (None: the owners it had stay), naming ``planning`` as the
    holder's planning inputs and ``webhook`` as its webhook's address (empty: none, as the uninstall
    hook holds it)."""
    spec = dict((previous or {}).get("spec") or {})
    taking_over = spec.get("holderIdentity") != identity
    stamp = now.strftime(MICROTIME)
    spec.update({"holderIdentity": identity, "leaseDurationSeconds": duration_s, "renewTime": stamp})
    if taking_over:
        spec["acquireTime"] = stamp
        spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if previous else 0)
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    previous_meta = (previous or {}).get("metadata") or {}
    if previous is not None:
        metadata["resourceVersion"] = previous_meta.get("resourceVersion")
    owners = previous_meta.get("ownerReferences")
    if owner is not None:
        owners = owner.with_reference(owners)
    if owners:
        metadata["ownerReferences"] = owners
    published = {c.ANN_LEASE_PLANNING: planning, c.ANN_LEASE_WEBHOOK: webhook}
    annotations = {k: v for k, v in (previous_meta.get("annotations") or {}).items() if k not in published}
    annotations.update({k: v for k, v in published.items() if v})
    if annotations:
        metadata["annotations"] = annotations
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata, "spec": spec}


def unanswered(status: int) -> bool:
    """Whether a failed request means the apiserver did not judge it (unreachable, 5xx), as
    opposed to refusing it."""
    return status == 0 or status >= 500


def keep_renewing(status: int, refused_since: datetime.datetime | None, now: datetime.datetime) -> bool:
    """Whether a holder whose renewal failed with ``status`` retries (every second) or gives up.

    Unreachable or failing (0, 5xx), the apiserver lets nobody write or take the Lease through
    it: retry. A refusal (a 403 while a restarted apiserver warms its RBAC cache) is retried for a
    lease term counted from the first refusal (``refused_since``), not from the last renewal: an
    apiserver that was down longer than a term must not cost the operator its life the moment it
    answers; rights really taken away end it after one term. Every retry also sees at once a Lease
    another operator took meanwhile.
    """
    if unanswered(status):
        return True
    return refused_since is not None and (now - refused_since).total_seconds() < LEASE_DURATION_S


def still_held(renewed_at: float | None, now: float, stopped: bool) -> bool:
    """Whether a holder may still act as one at monotonic ``now``: it took or renewed the Lease at
    ``renewed_at`` (read before that write went out, so never later than the term's start the
    others count from), less than a term ago, and has neither stopped renewing nor lost it."""
    return not stopped and renewed_at is not None and now - renewed_at < LEASE_DURATION_S


def planning_seal_key(serving_key_pem: bytes) -> bytes:
    """The key that seals the planning inputs a holder publishes, derived from the webhook's serving
    key: every replica of one install reads it from the same Secret, and a writer of the Lease who
    cannot read that Secret cannot seal inputs of its own (images, sizes) for the replicas to plan with."""
    return hashlib.sha256(b"kvoffload planning inputs\0" + serving_key_pem).digest()


def sealed(inputs: str, key: bytes) -> str:
    """``inputs`` as the holder publishes them: the text, a newline, its HMAC-SHA256 under ``key``."""
    return f"{inputs}\n{hmac.new(key, inputs.encode(), hashlib.sha256).hexdigest()}"


def unsealed(published: str, key: bytes) -> str | None:
    """The inputs ``published`` carries when sealed under ``key``, else None."""
    inputs, _, seal = published.rpartition("\n")
    expected = hmac.new(key, inputs.encode(), hashlib.sha256).hexdigest()
    return inputs if inputs and hmac.compare_digest(seal, expected) else None


WEBHOOK_SEAL_PREFIX = "webhook "
"""Sealed before the address, so that no sealed planning text reads as an address."""


@dataclass(frozen=True)
class Publication:
    """What another holder published in the Lease, sealed, while its term runs (each None: absent,
    or not sealed under this install's key)."""

    planning: str | None = None
    webhook: str | None = None


def holders_publication(lease: Mapping[str, Any] | None, identity: str, now: datetime.datetime,
                        key: bytes = b"") -> Publication:  # fmt: skip
    """The planning inputs and webhook address another holder published in ``lease`` sealed under
    ``key``, while its term runs (nothing: nobody else holds it, its holder published none, as the
    uninstall hook does, or what it carries is not sealed under ``key``)."""
    if lease_state(lease, identity, now) != "held":
        return Publication()
    annotations = ((lease or {}).get("metadata") or {}).get("annotations") or {}

    def read(name: str) -> str | None:
        value = annotations.get(name)
        return unsealed(value, key) if isinstance(value, str) else None

    webhook = read(c.ANN_LEASE_WEBHOOK)
    address = webhook[len(WEBHOOK_SEAL_PREFIX) :] if webhook and webhook.startswith(WEBHOOK_SEAL_PREFIX) else None
    return Publication(read(c.ANN_LEASE_PLANNING), address or None)


def holders_inputs(lease: Mapping[str, Any] | None, identity: str, now: datetime.datetime,
                   key: bytes = b"") -> str | None:  # fmt: skip
    """The planning inputs of ``holders_publication``."""
    return holders_publication(lease, identity, now, key).planning


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def holder_of(lease: Mapping[str, Any] | None) -> str:
    """Who holds the Lease and since when, as the waiting operator logs it."""
    spec = (lease or {}).get("spec") or {}
    return (f"{spec.get('holderIdentity') or 'nobody'} (renewed {spec.get('renewTime') or spec.get('acquireTime')}, "
            f"term {spec.get('leaseDurationSeconds')} s)")  # fmt: skip


@dataclass
class Leadership:
    """This process's claim on the operator's Lease."""

    kube: Kube
    namespace: str
    name: str
    identity: str
    owner: OperatorDeployment | None = None
    """The operator's Deployment: the Lease names it as its owner (None: the owners it has stay)."""
    planning: str = ""
    """What this operator's admission plans depend on (``acting_replica.planning_inputs``), published
    while it holds the Lease, sealed under ``seal_key``."""
    seal_key: bytes = b""
    """``planning_seal_key`` of the webhook's serving key (admission mode)."""
    webhook_address: str = ""
    """Where this replica's webhook listens (``<pod IP>:<port>``), published beside ``planning`` (empty:
    not known, nothing published; other replicas then answer every review themselves)."""
    lost: bool = False
    """The Lease could not be kept; the operator stopped acting."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _renewer: threading.Thread | None = None
    _seen: Mapping[str, Any] | None = None
    """The Lease as the last attempt read it."""
    _renewed_at: float | None = None
    """``time.monotonic()`` before the last write that took or renewed the Lease."""

    def holds_lease(self) -> bool:
        """Whether this process holds the Lease now (``still_held``)."""
        return still_held(self._renewed_at, time.monotonic(), self.lost or self._stop.is_set())

    def holders_inputs(self) -> str | None:
        """The planning inputs the webhook plans with now: this process's own while it holds the
        Lease, else those a running holder published (``holders_inputs``, the Lease read now; a
        failed read: None, no plan)."""
        if self.holds_lease():
            return self.planning or None
        return self.others_publication().planning

    def others_publication(self) -> Publication:
        """What another holder published (``holders_publication``, the Lease read now); nothing
        while this process holds the Lease or when the read fails."""
        if self.holds_lease():
            return Publication()
        try:
            lease = self.kube.get(lease_path(self.namespace, self.name))
        except KubeApiError:
            return Publication()
        return holders_publication(lease, self.identity, _now(), self.seal_key)

    def _try(self) -> bool:
        """One attempt to take or renew the Lease; True when this process holds it now."""
        started = time.monotonic()
        if self._attempt():
            self._renewed_at = started
            return True
        return False

    def _attempt(self) -> bool:
        path = lease_path(self.namespace, self.name)
        current = self._seen = self.kube.get(path)
        stale = earlier_install(self.kube, self.namespace, current, self.owner)
        if lease_state(current, self.identity, _now(), stale) == "held":
            return False
        if stale and ((current or {}).get("spec") or {}).get("holderIdentity"):
            log.info("leader election: lease %s/%s belongs to an earlier install's operator (held by %s): taking it",
                     self.namespace, self.name, holder_of(current))  # fmt: skip
        webhook = WEBHOOK_SEAL_PREFIX + self.webhook_address if self.webhook_address else ""
        body = lease_body(self.name, self.namespace, self.identity, _now(), current, owner=self.owner,
                          planning=sealed(self.planning, self.seal_key) if self.planning else "",
                          webhook=sealed(webhook, self.seal_key) if webhook else "")  # fmt: skip
        return self._write(path, current, body)  # False: someone else wrote it first, look again

    def _write(self, path: str, current: dict[str, Any] | None, body: dict[str, Any]) -> bool:
        """Create or replace the Lease as read in ``current``; False when another writer got there first."""
        try:
            if current is None:
                self.kube.create(lease_path(self.namespace), body)
            else:
                self.kube.request("PUT", path, body)
        except KubeApiError as exc:
            if exc.status in (409, 422):
                return False
            if exc.status == 404 and current is not None:
                return False  # deleted since it was read (the garbage collector): look again, then create it
            raise
        return True

    def seize(self, duration_s: int) -> bool:
        """Take the Lease whoever holds it and hold it ``duration_s`` from now (the uninstall hook:
        no operator may act while it hands workloads back, nor until Helm has deleted the operator).
        True when another holder's term was running: it stops at its next renewal."""
        path = lease_path(self.namespace, self.name)
        for _attempt in range(10):
            current = self.kube.get(path)
            active = lease_state(current, self.identity, _now()) == "held"
            body = lease_body(self.name, self.namespace, self.identity, _now(), current, duration_s, self.owner)
            if self._write(path, current, body):
                return active
            # the holder renewed meanwhile: take it from the new version
        raise KubeApiError(409, {"message": "the Lease kept changing"}, "PUT", path)

    def acquire(self, stop: threading.Event) -> bool:
        """Wait until this process holds the Lease (True) or ``stop`` is set (False)."""
        logged_holder = None
        while not stop.is_set():
            try:
                if self._try():
                    log.info("leader election: holding lease %s/%s as %s", self.namespace, self.name, self.identity)
                    return True
            except KubeApiError as exc:
                log.warning("leader election: %s (retrying)", exc)
            holder = ((self._seen or {}).get("spec") or {}).get("holderIdentity")
            if holder != logged_holder:  # once per holder: a standby waits quietly
                log.info("leader election: lease %s/%s is held by %s; waiting until it is released or its term "
                         "runs out", self.namespace, self.name, holder_of(self._seen))  # fmt: skip
                logged_holder = holder
            stop.wait(RETRY_INTERVAL_S)
        return False

    def hold(self, on_lost: Callable[[], None]) -> None:
        """Renew in the background; ``on_lost`` runs once if the Lease cannot be kept."""

        def renew() -> None:
            interval, refused_since = RENEW_INTERVAL_S, None
            while not self._stop.wait(interval):
                interval = RENEW_INTERVAL_S
                try:
                    if self._try():
                        refused_since = None
                        continue
                    log.error("leader election: lease %s/%s taken by another operator", self.namespace, self.name)
                except KubeApiError as exc:
                    if not unanswered(exc.status):
                        refused_since = refused_since or _now()
                    if keep_renewing(exc.status, refused_since, _now()):
                        log.warning("leader election: renewal failed, retrying: %s", exc)
                        interval = RETRY_INTERVAL_S
                        continue
                    log.error("leader election: renewal refused for a whole lease term: %s", exc)
                self.lost = True  # the webhook stops planning before the handlers stop
                on_lost()
                return

        self._renewer = threading.Thread(target=renew, name="kvoffload-lease", daemon=True)
        self._renewer.start()

    def release(self) -> None:
        """Stop renewing (and planning in the webhook) and free the Lease at once, so a waiting
        operator takes over without delay."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=RENEW_INTERVAL_S + 1)
        path = lease_path(self.namespace, self.name)
        try:
            current = self.kube.get(path)
            if current is not None and lease_state(current, self.identity, _now()) == "ours":
                spec = {**(current.get("spec") or {}), "holderIdentity": "", "renewTime": None, "acquireTime": None}
                self.kube.request("PUT", path, {**current, "spec": spec})
                log.info("leader election: released lease %s/%s", self.namespace, self.name)
        except KubeApiError as exc:
            log.warning("leader election: release failed (the lease expires by itself): %s", exc)


class _Live(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # quiet: probes every few seconds
        pass


@contextlib.contextmanager
def serve_health_while_waiting(port: int) -> Iterator[None]:
    """Answer /healthz on ``port`` until kopf's own liveness endpoint takes the port over (a
    bounded server, like every listener of the operator)."""
    server = BoundedHTTPServer(("0.0.0.0", port), _Live)
    thread = threading.Thread(target=server.serve_forever, name="kvoffload-standby-health", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
