"""Effects of node mode: fetch the policy and its pods, call the pure planners (``placement``, ``cache_objects``),
create and delete cache pods, apply the node-local Service and NetworkPolicy where they drifted.

Level-triggered: every pass lists the pods as they are now, so an operator that restarts, or
misses events, converges on the next pass (kopf's initial listing triggers one per pod).
Deterministic cache-pod names make a concurrent or repeated create fail instead of duplicate.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kvoffload import contract as c
from kvoffload.cache_keys import z85_encode
from kvoffload.operator.api.kube import Kube, KubeApiError, namespaced_path, policy_path
from kvoffload.operator.intent.settings import OperatorDefaults
from kvoffload.operator.node.cache_objects import (
    cache_keys_secret_name,
    cache_pod_selector,
    cache_service_name,
    cache_settings,
    render_cache_keys_secret,
    render_cache_network_policy,
    render_cache_service,
)
from kvoffload.operator.node.placement import (
    desired_cache_pods,
    keys_in_use,
    node_cache_status,
    plan_cache_pods,
)
from kvoffload.operator.plan.drift import object_carries
from kvoffload.policy_values import PolicyError

log = logging.getLogger("kvoffload.operator")


def pods_path(namespace: str, name: str = "") -> str:
    return namespaced_path("/api/v1", "pods", namespace, name)


def network_policies_path(namespace: str, name: str = "") -> str:
    return namespaced_path("/apis/networking.k8s.io/v1", "networkpolicies", namespace, name)


def services_path(namespace: str, name: str = "") -> str:
    return namespaced_path("/api/v1", "services", namespace, name)


def secrets_path(namespace: str, name: str = "") -> str:
    return namespaced_path("/api/v1", "secrets", namespace, name)


def new_cache_keys() -> dict[str, str]:
    """Two fresh CURVE keypairs (Curve25519, as libzmq's), server's and client's, as Z85 text by file name."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

    keys: dict[str, str] = {}
    for secret_file, public_file in (
        (c.CACHE_KEY_SERVER_SECRET, c.CACHE_KEY_SERVER_PUBLIC),
        (c.CACHE_KEY_CLIENT_SECRET, c.CACHE_KEY_CLIENT_PUBLIC),
    ):
        private = X25519PrivateKey.generate()
        keys[secret_file] = z85_encode(private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))
        keys[public_file] = z85_encode(private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw))
    return keys


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


@dataclass
class NodeCaches:
    """Keeps one cache pod per (node, policy) with engine pods; thread-safe per policy."""

    kube: Kube
    defaults: OperatorDefaults
    _locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _policy_lock(self, key: tuple[str, str]) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(key, threading.Lock())

    def cache_pods(self, namespace: str, policy: str) -> list[dict[str, Any]]:
        params = {"labelSelector": _selector(cache_pod_selector(policy))}
        return list(self.kube.request("GET", pods_path(namespace), params=params).get("items") or [])

    def status(self, namespace: str, policy: str) -> list[dict[str, Any]]:
        return node_cache_status(self.cache_pods(namespace, policy))

    def _apply_if_drifted(self, path: str, body: dict[str, Any]) -> None:
        """Apply ``body`` unless the live object already carries all of it (a read, not a write, per pass)."""
        if not object_carries(body, self.kube.get(path)):
            self.kube.apply(path, body, c.FIELD_MANAGER)

    def _ensure_keys(self, policy: dict[str, Any]) -> None:
        """Create the policy's key Secret; a 409 says it exists (kept: running pods use its keys).
        Never reads it: the operator has no right to."""
        meta = policy.get("metadata") or {}
        namespace, name = str(meta.get("namespace")), str(meta.get("name"))
        try:
            self.kube.create(secrets_path(namespace), render_cache_keys_secret(policy, new_cache_keys()))
            log.info("node cache: created key Secret %s/%s", namespace, cache_keys_secret_name(name))
        except KubeApiError as exc:
            if exc.status != 409:
                raise

    def sync(self, namespace: str, policy_name: str) -> bool:
        """One pass for one policy; True when it created or deleted something."""
        with self._policy_lock((namespace, policy_name)):
            policy = self.kube.get(policy_path(namespace, policy_name))
            existing = self.cache_pods(namespace, policy_name)
            desired: dict[str, dict[str, Any]] = {}
            if policy is not None:
                settings = cache_settings(policy, self.defaults)
                if isinstance(settings, PolicyError):
                    log.warning("node caches %s/%s: %s (cache pods left as they are)", namespace, policy_name,
                                settings.message)  # fmt: skip
                    return False
                engines = (
                    self.kube.request(
                        "GET",
                        pods_path(namespace),
                        params={"labelSelector": f"{c.LABEL_NODE_CACHE_POLICY}={policy_name}"},
                    ).get("items")
                    or []
                )
                desired = desired_cache_pods(policy, settings, engines)
                if desired:
                    if not keys_in_use(existing):  # a ready cache pod mounted them: they exist
                        self._ensure_keys(policy)
                    name = cache_service_name(policy_name)
                    self._apply_if_drifted(services_path(namespace, name), render_cache_service(policy))
                    self._apply_if_drifted(
                        network_policies_path(namespace, name), render_cache_network_policy(policy, settings.kv_events)
                    )
            plan = plan_cache_pods(desired, existing)
            for name in plan.delete:
                log.info("node cache: deleting pod %s/%s", namespace, name)
                self.kube.delete(pods_path(namespace, name))
            for manifest in plan.create:
                log.info("node cache: creating pod %s/%s for node %s", namespace, manifest["metadata"]["name"],
                         manifest["metadata"]["annotations"][c.ANN_CACHE_NODE])  # fmt: skip
                try:
                    self.kube.create(pods_path(namespace), manifest)
                except KubeApiError as exc:
                    if exc.status != 409:  # AlreadyExists: another pass got there first
                        raise
            return bool(plan.delete or plan.create)
