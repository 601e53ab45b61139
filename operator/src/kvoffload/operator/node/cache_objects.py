"""Node-shared mode: one LMCache cache pod per node and KVCachePolicy, shared by that policy's
TensorRT-LLM pods on the node.

Pure decisions only (the effects are in ``caches.py``): the engine's pod-template fragment, the
objects of a policy's node cache (its pod, its node-local Service, NetworkPolicy and keys Secret).
Which nodes get a cache pod, what to create and delete to get there and the per-node status are in
``placement.py``. Everything is recomputed from the pods as they are now, so an operator restart
needs no memory to converge.

How an engine reaches its node's cache: a ClusterIP Service with ``internalTrafficPolicy:
Local`` selecting the policy's cache pods; kube-proxy (or the CNI's replacement) sends a pod's
connection only to an endpoint on the pod's own node and drops it when there is none, so an
engine can never reach another node's cache (the L1 it must map lives in that node's /dev/shm).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from typing import Any

from kvoffload import contract as c
from kvoffload.operator import __version__
from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
from kvoffload.operator.intent.workload import read_workload
from kvoffload.operator.plan.containers import (
    CACHE_POD_KEY_FILES,
    RESTRICTED_SECURITY_CONTEXT,
    cache_keys_volume,
    cache_server_container,
)
from kvoffload.operator.plan.fragment import RenderedInjection, render_injection_fragment
from kvoffload.operator.plan.injection_plan import ClusterInfo
from kvoffload.operator.plan.node_wiring import (
    MAX_NAME,
    cache_keys_secret_name,
    cache_service_name,
    name_digest,
    node_cache_wiring,
    node_shm_host_path,
)
from kvoffload.policy_values import PolicyError
from kvoffload.quantity import format_bytes

SCRAPE_ANNOTATIONS = dict(
    zip(c.PROMETHEUS_SCRAPE_ANNOTATIONS, ("true", str(c.SIDECAR_HTTP_PORT), c.PATH_METRICS), strict=True)
)
SHM_PERMISSIONS = "1777"
"""The hostPath is created root-owned 0755; the non-root cache server must create its segment
in it, and engines running as any user must map it (sticky: nobody deletes another's files)."""


def policy_key(policy: Mapping[str, Any]) -> tuple[str, str]:
    """A policy's (namespace, name)."""
    meta = policy.get("metadata") or {}
    return str(meta.get("namespace")), str(meta.get("name"))


def cache_pod_name(policy: str, node: str) -> str:
    """One deterministic name per (policy, node): a second create is refused, never duplicated."""
    name = f"{policy}-cache-{node}"
    if len(name) <= MAX_NAME:
        return name
    return f"{policy[:36].rstrip('-.')}-cache-{name_digest(node)[:12]}"


def render_cache_keys_secret(policy: Mapping[str, Any], keys: Mapping[str, str]) -> dict[str, Any]:
    """The Secret holding a policy's node-cache keys (``keys``: file name -> Z85 key, all four
    ``CACHE_KEY_*``), owned by the policy. The cache pod mounts the server's files, the policy's
    engines the client's: a pod of another policy or namespace, or one that only labels itself,
    mounts none, and the server admits no other key."""
    namespace, name = policy_key(policy)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": cache_keys_secret_name(name),
            "namespace": namespace,
            "labels": {c.LABEL_MANAGED_BY: c.LABEL_MANAGED_BY_VALUE, **cache_pod_selector(name)},
            "ownerReferences": [_owner(policy)],
        },
        "stringData": dict(sorted(keys.items())),
    }


def cache_pod_selector(policy: str) -> dict[str, str]:
    return {c.LABEL_COMPONENT: c.COMPONENT_NODE_CACHE, c.LABEL_CACHE_POLICY: policy}


def _owner(policy: Mapping[str, Any]) -> dict[str, Any]:
    meta = policy.get("metadata") or {}
    owner = {
        "apiVersion": f"{c.API_GROUP}/{c.API_VERSION}",
        "kind": c.POLICY_KIND,
        "name": meta.get("name"),
        "controller": True,
    }
    if meta.get("uid"):
        owner["uid"] = meta["uid"]
    return owner


def cache_settings(policy: Mapping[str, Any], defaults: OperatorDefaults) -> InjectionSettings | PolicyError:
    """The shared cache's settings: operator defaults < the policy (no workload's annotations)."""
    namespace, name = policy_key(policy)
    return resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: name}, policy, defaults, namespace)


def render_node_mode_fragment(
    workload: Mapping[str, Any],
    settings: InjectionSettings,
    cluster: ClusterInfo,
    user_options_yaml: str | None = None,
) -> RenderedInjection | PolicyError:
    """The engine side of node mode: the sidecar-mode fragment without the sidecar, wired to the node's cache pod."""
    wiring = node_cache_wiring(read_workload(workload), settings)
    if isinstance(wiring, PolicyError):
        return wiring
    return render_injection_fragment(workload, settings, cluster, user_options_yaml, node_cache=wiring)


def _cache_container(settings: InjectionSettings) -> dict[str, Any]:
    """The sidecar's cache-server container, shared by the node's engines."""
    return cache_server_container(settings, c.VOLUME_SHM, native=False, node_shared=True)


def _shm_permissions_container(settings: InjectionSettings) -> dict[str, Any]:
    security = copy.deepcopy(RESTRICTED_SECURITY_CONTEXT)
    security.update({"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0})  # owner of the hostPath
    return {
        "name": c.NODE_SHM_PREPARE_CONTAINER,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["chmod", SHM_PERMISSIONS, c.SHM_MOUNT_PATH],
        "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": security,
        "volumeMounts": [{"name": c.VOLUME_SHM, "mountPath": c.SHM_MOUNT_PATH}],
    }


def render_cache_pod(
    policy: Mapping[str, Any], settings: InjectionSettings, node: str, tolerations: Iterable[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """The cache pod for ``node``: owned by the policy, pinned to the node, tolerating only what
    its engine pods there tolerate (``tolerations``), so it lands on no node they could not."""
    namespace, name = policy_key(policy)
    volumes: list[dict[str, Any]] = [
        {"name": c.VOLUME_SHM, "hostPath": {"path": node_shm_host_path(namespace, name), "type": "DirectoryOrCreate"}},
        {"name": c.VOLUME_RUN, "emptyDir": {"sizeLimit": "512Mi"}},
        cache_keys_volume(cache_keys_secret_name(name), CACHE_POD_KEY_FILES),
    ]
    if settings.fs_tier:
        volumes.append({"name": c.VOLUME_L2_FS, "emptyDir": {"sizeLimit": format_bytes(settings.fs_tier.size_bytes)}})
    spec: dict[str, Any] = {
        "initContainers": [_shm_permissions_container(settings)],
        "containers": [_cache_container(settings)],
        "volumes": volumes,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]},
        ]}}},
        "restartPolicy": "Always",
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},  # each container also sets its own
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
    }  # fmt: skip
    if settings.gpu_access == "nvidia-runtime" and settings.runtime_class_name:
        spec["runtimeClassName"] = settings.runtime_class_name
    # The hash covers what makes the pod differ, not the node: one value per policy version.
    digest = name_digest(json.dumps({"spec": {**spec, "affinity": None}}, sort_keys=True))[:16]
    if tolerations:
        # Out of the hash: an engine rollout that changes tolerations must not restart the cache.
        spec["tolerations"] = [dict(t) for t in tolerations]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": cache_pod_name(name, node),
            "namespace": namespace,
            "labels": {c.LABEL_MANAGED_BY: c.LABEL_MANAGED_BY_VALUE, **cache_pod_selector(name)},
            "annotations": {
                c.ANN_CACHE_NODE: node,
                c.ANN_CONFIG_HASH: digest,
                c.ANN_INJECTED_VERSION: __version__,
                **SCRAPE_ANNOTATIONS,
            },
            "ownerReferences": [_owner(policy)],
        },
        "spec": spec,
    }


def _policy_object_meta(policy: Mapping[str, Any]) -> dict[str, Any]:
    """Metadata of a per-policy object (Service, NetworkPolicy): named after the policy, owned by it."""
    namespace, name = policy_key(policy)
    return {
        "name": cache_service_name(name),
        "namespace": namespace,
        "labels": {c.LABEL_MANAGED_BY: c.LABEL_MANAGED_BY_VALUE, **cache_pod_selector(name)},
        "ownerReferences": [_owner(policy)],
    }


def render_cache_service(policy: Mapping[str, Any]) -> dict[str, Any]:
    """The node-local Service the engines dial: only endpoints on the caller's node count."""
    _, name = policy_key(policy)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _policy_object_meta(policy),
        "spec": {
            "type": "ClusterIP",
            "selector": cache_pod_selector(name),
            "internalTrafficPolicy": "Local",
            "ports": [{"name": c.REQUEST_PORT_NAME, "port": c.REQUEST_PORT, "targetPort": c.REQUEST_PORT_NAME,
                       "protocol": "TCP"}],
        },
    }  # fmt: skip


def render_cache_network_policy(policy: Mapping[str, Any], kv_events: bool = False) -> dict[str, Any]:
    """Who may reach a policy's cache pods: its own engines on the request port; anyone on the
    metrics/health port (Prometheus) and, with ``kv_events``, on the KV-event port (routers run
    elsewhere). Without it any pod on the node could dial the cache.
    Enforced only where the cluster's network plugin implements NetworkPolicy."""
    _, name = policy_key(policy)
    anyone = [{"port": c.SIDECAR_HTTP_PORT, "protocol": "TCP"}]
    if kv_events:
        anyone.append({"port": c.KV_EVENTS_PORT, "protocol": "TCP"})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _policy_object_meta(policy),
        "spec": {
            "podSelector": {"matchLabels": cache_pod_selector(name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {c.LABEL_NODE_CACHE_POLICY: name}}}],
                 "ports": [{"port": c.REQUEST_PORT, "protocol": "TCP"}]},
                {"ports": anyone},
            ],
        },
    }  # fmt: skip
