"""Node mode, the engine's side: how an engine reaches its node's shared cache pod, and the names
that pod's objects go by (the cache objects themselves are :mod:`kvoffload.operator.node.cache_objects`'s)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.workload import Workload
from kvoffload.policy_values import PolicyError

MAX_NAME = 63
CACHE_SETTING_ANNOTATIONS = (c.ANN_CPU_CACHE_SIZE,)
"""Workload annotations that would size the shared cache: in node mode the policy alone does."""


@dataclass(frozen=True)
class NodeCacheWiring:
    """Node mode: the engine uses its node's shared cache pod instead of a sidecar."""

    server_url: str
    """The cache pods' node-local Service (``internalTrafficPolicy: Local``)."""
    shm_host_path: str
    """The node directory mounted at /dev/shm in the engine and in the node's cache pod."""
    pod_labels: Mapping[str, str]
    """Labels on the engine pods by which the operator finds the nodes needing a cache pod."""
    keys_secret: str
    """The policy's CURVE key Secret: the engine mounts its client files (``ENGINE_KEY_FILES``)."""


def name_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def cache_service_name(policy: str) -> str:
    """The node-local Service of a policy's cache pods (a DNS-1035 label)."""
    name = f"kvoffload-{policy}".replace(".", "-")
    if len(name) <= MAX_NAME:
        return name
    return f"kvoffload-{policy[:40].replace('.', '-').rstrip('-')}-{name_digest(policy)[:8]}"


def cache_keys_secret_name(policy: str) -> str:
    """The policy's CURVE key Secret (in the policy's namespace)."""
    return cache_service_name(policy) + c.CACHE_KEYS_SECRET_SUFFIX


def node_shm_host_path(namespace: str, policy: str) -> str:
    """The node directory a policy's engines and cache pod share as /dev/shm."""
    return f"{c.NODE_SHM_HOST_ROOT}/{namespace}/{policy}"


def cache_server_url(namespace: str, policy: str) -> str:
    """What the connector dials: the Service name resolves the same everywhere; the traffic
    policy makes it land on the dialling pod's own node."""
    return f"tcp://{cache_service_name(policy)}.{namespace}.svc:{c.REQUEST_PORT}"


def node_cache_wiring(workload: Workload, settings: InjectionSettings) -> NodeCacheWiring | PolicyError:
    """How a node-mode engine reaches its node's cache pod (Service URL, the node's shared
    /dev/shm, the policy label), or why its annotations conflict with a shared cache."""
    annotations = workload.annotations
    for key in CACHE_SETTING_ANNOTATIONS:
        if key in annotations:
            return PolicyError(
                key, annotations[key],
                "in mode node the cache is shared by the policy's workloads on a node; set it in the "
                f"KVCachePolicy {settings.policy_name} (spec.cache.l1Size) and remove the annotation",
            )  # fmt: skip
    assert settings.policy_name is not None  # resolve_settings requires one in node mode
    namespace = workload.ref.namespace
    return NodeCacheWiring(
        server_url=cache_server_url(namespace, settings.policy_name),
        shm_host_path=node_shm_host_path(namespace, settings.policy_name),
        pod_labels={c.LABEL_NODE_CACHE_POLICY: settings.policy_name},
        keys_secret=cache_keys_secret_name(settings.policy_name),
    )
