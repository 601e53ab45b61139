"""The containers and env kvoffload injects: the engine's connector env, the cache server, the bundle copy.

Pure: settings in, container bodies out. The sidecar and the node-shared cache pod run the same
cache-server container (:func:`cache_server_container`), configured by the policy file or by env.
"""

from __future__ import annotations

import copy
import json
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.plan.pod_memory import sidecar_resources
from kvoffload.policy_values import KV_EVENTS_FORMATS, PolicyError, RedisTier
from kvoffload.quantity import format_bytes

RUN_VOLUME_SIZE = "512Mi"
BUNDLE_VOLUME_SIZE = "1Gi"
SIDECAR_UID = 65532
STARTUP_PROBE_BUDGET_S = 600
"""Pinning a large L1 can take minutes; the startup probe allows this long before a restart."""
REQUIRED_ENGINE_ENV = (c.ENV_SERVER_URL, c.ENV_PYTHONHASHSEED, c.ENV_PROMETHEUS_MULTIPROC_DIR, c.ENV_PYTHONPATH)
"""Engine env the connector cannot work without; a different user value is an error. The user
may override any other injected variable, and then the user's value stays."""
RESTRICTED_SECURITY_CONTEXT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "runAsNonRoot": True,
    "runAsUser": SIDECAR_UID,
    "runAsGroup": SIDECAR_UID,
    "seccompProfile": {"type": "RuntimeDefault"},
    "readOnlyRootFilesystem": True,
}
"""kvoffload's containers write only to their volumes (the cache server's temporary files and
numba's cache go to the run volume: ``TMPDIR``, ``NUMBA_CACHE_DIR``)."""


def env_var(name: str, value: str) -> dict[str, Any]:
    return {"name": name, "value": value}


ENGINE_KEY_FILES = (c.CACHE_KEY_CLIENT_PUBLIC, c.CACHE_KEY_CLIENT_SECRET, c.CACHE_KEY_SERVER_PUBLIC)
"""Node mode: the key files a policy's engine pods mount (never the server's secret)."""
CACHE_POD_KEY_FILES = (c.CACHE_KEY_SERVER_PUBLIC, c.CACHE_KEY_SERVER_SECRET, c.CACHE_KEY_CLIENT_PUBLIC)
"""Node mode: the key files the node cache pod mounts (never the client's secret)."""
CACHE_KEYS_MOUNT = {"name": c.VOLUME_CACHE_KEYS, "mountPath": c.CACHE_KEYS_MOUNT_PATH, "readOnly": True}
KEY_FILE_MODE = 0o444
"""Readable by the container's non-root user whatever its uid (the pod's own containers only)."""


def cache_keys_volume(secret_name: str, files: Sequence[str]) -> dict[str, Any]:
    """The volume mounting ``files`` of a policy's key Secret, and nothing else of it."""
    return {
        "name": c.VOLUME_CACHE_KEYS,
        "secret": {"secretName": secret_name, "defaultMode": KEY_FILE_MODE,
                   "items": [{"key": f, "path": f} for f in files]},
    }  # fmt: skip


def engine_env(
    settings: InjectionSettings, server_url: str, serve_metrics: bool, cache_keys: bool = False
) -> list[dict[str, Any]]:
    """The connector's settings; ``serve_metrics``: no sidecar in the pod, the connector serves /metrics;
    ``cache_keys``: node mode, the connector authenticates with the keys mounted at CACHE_KEYS_MOUNT_PATH."""
    env = []
    if settings.backend == c.BACKEND_SIDECAR:
        env.append(env_var(c.ENV_SERVER_URL, server_url))
    if cache_keys:
        env.append(env_var(c.ENV_CACHE_KEYS_DIR, c.CACHE_KEYS_MOUNT_PATH))
    env += [
        env_var(c.ENV_BACKEND, settings.backend),
        env_var(c.ENV_PYTHONHASHSEED, "0"),
        env_var(c.ENV_PROMETHEUS_MULTIPROC_DIR, c.METRICS_DIR),
        env_var(c.ENV_METRICS_ENABLED, "true"),
        env_var(c.ENV_CHUNK_SIZE, str(settings.chunk_size)),
        env_var(c.ENV_LOOKUP_TIMEOUT_MS, str(settings.lookup_timeout_ms)),
        env_var(c.ENV_RETRIEVE_TIMEOUT_MS, str(settings.retrieve_timeout_ms)),
        env_var(c.ENV_STORE_TIMEOUT_MS, str(settings.store_timeout_ms)),
        env_var(c.ENV_SAVE_DECODE_TOKENS, "true" if settings.save_decode_tokens else "false"),
        # lmcache runs inside the engine too (always its client; the whole cache with backend
        # inprocess) and sends usage telemetry unless told not to: nothing leaves the pod by default.
        env_var(c.ENV_LMCACHE_TRACK_USAGE, "false"),
        env_var(c.ENV_TMPDIR, c.RUN_MOUNT_PATH),
        env_var(c.ENV_NUMBA_CACHE_DIR, c.NUMBA_CACHE_PATH),
    ]
    if settings.kv_events:
        env.append(env_var(c.ENV_KV_EVENTS, "true"))
    if settings.backend == c.BACKEND_INPROCESS:  # the engine hosts the cache: the policy's L1 is its
        env.append(env_var(c.ENV_L1_SIZE, format_bytes(settings.l1_bytes)))
    if serve_metrics:
        env.append(env_var(c.ENV_METRICS_PORT, str(c.ENGINE_METRICS_PORT)))
    if settings.connector_source == "init-container":
        env.append(env_var(c.ENV_PYTHONPATH, c.BUNDLE_PYTHONPATH))
    return env


def merge_engine_env(ours: list[dict[str, Any]], user_env: Sequence[Mapping[str, Any]], container: str
                      ) -> tuple[list[dict[str, Any]], PolicyError | None]:  # fmt: skip
    """Our env entries next to the user's: equal values are shared, a user override wins for
    tunables, and a different value of a required variable is an error."""
    users = {str(e.get("name")): e for e in user_env}
    result = []
    for entry in ours:
        name = entry["name"]
        if name not in users:
            result.append(entry)
            continue
        user_value = users[name].get("value")
        if "valueFrom" not in users[name] and user_value == entry["value"]:
            result.append(entry)  # same value: co-owned, survives our removal untouched
            continue
        if name == c.ENV_PYTHONPATH and isinstance(user_value, str):
            if user_value.split(":")[0] == c.BUNDLE_PYTHONPATH:
                result.append({"name": name, "value": user_value})
                continue
            return result, PolicyError(
                f"container {container} env {name}", user_value,
                f"kvoffload needs {c.BUNDLE_PYTHONPATH} first on it: set {name}={c.BUNDLE_PYTHONPATH}:{user_value} "
                f"yourself, or put the connector in your image and set {c.ANN_CONNECTOR_SOURCE}: image",
                reason="conflict",
            )  # fmt: skip
        if name in REQUIRED_ENGINE_ENV:
            return result, PolicyError(
                f"container {container} env {name}", user_value if "valueFrom" not in users[name] else "valueFrom",
                f"kvoffload needs {name}={entry['value']}; remove your setting", reason="conflict",
            )  # fmt: skip
        # A tunable the user set on purpose: leave it to them.
    return result, None


def _http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": c.SIDECAR_PORT_NAME, "scheme": "HTTP"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 2,
    }


def shm_size_limit(settings: InjectionSettings) -> int:
    """Bytes for the pod's /dev/shm: the engine's own share plus LMCache's L1.

    LMCache's server (the sidecar, or with backend inprocess the one inside the engine) keeps L1
    in a POSIX shared-memory segment that the connector maps to copy KV blocks in and out
    (LMCache's engine-driven transfer); LMCache only uses shared memory when /dev/shm can hold all
    of L1, and otherwise falls back to a pickle path ~100x slower, where no load can be secured.
    """
    return settings.shm_bytes + settings.l1_bytes


def _node_shared_env(settings: InjectionSettings) -> list[dict[str, Any]]:
    """A node's shared cache pod has no per-workload policy file: its policy comes by env."""
    env = [
        env_var(c.ENV_REQUEST_HOST, "0.0.0.0"),
        env_var(c.ENV_CACHE_KEYS_DIR, c.CACHE_KEYS_MOUNT_PATH),
        env_var(c.ENV_EVICTION_POLICY, settings.eviction_policy),
        env_var(c.ENV_CHUNK_SIZE, str(settings.chunk_size)),
        env_var(c.ENV_MAX_WORKERS, str(settings.max_workers)),
    ]
    if settings.fs_tier:
        env += [
            env_var(c.ENV_L2_FS_PATH, settings.fs_tier.path),
            env_var(c.ENV_L2_FS_SIZE, format_bytes(settings.fs_tier.size_bytes)),
        ]
    if settings.redis_tier:
        env.append(redis_url_env(settings.redis_tier))
    return env


def redis_url_env(redis: RedisTier) -> dict[str, Any]:
    """The cache server's Redis URL: the value, or a reference to the Secret holding it."""
    if redis.url is not None:
        return env_var(c.ENV_L2_REDIS_URL, redis.url)
    return secret_env(c.ENV_L2_REDIS_URL, redis.url_secret_name, redis.url_secret_key)


def secret_env(name: str, secret: str | None, key: str | None) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def kv_events_env(settings: InjectionSettings) -> list[dict[str, Any]]:
    """The cache server's event publisher (with events on): its port, and its topic, which may name the
    pod as ``$(KVOFFLOAD_POD_IP)`` (Kubernetes expands a reference to an env var defined before it)."""
    if not settings.kv_events:
        return []
    env = [
        {"name": c.ENV_POD_IP, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}},
        env_var(c.ENV_KV_EVENTS_PORT, str(c.KV_EVENTS_PORT)),
    ]
    if settings.kv_events_topic:
        env.append(env_var(c.ENV_KV_EVENTS_TOPIC, settings.kv_events_topic))
    if settings.kv_events_format != KV_EVENTS_FORMATS[0]:  # only when set: pods of the default roll for nothing
        env.append(env_var(c.ENV_KV_EVENTS_FORMAT, settings.kv_events_format))
    return env


def cache_server_container(
    settings: InjectionSettings, shm_volume: str, native: bool, node_shared: bool = False
) -> dict[str, Any]:
    """The cache-server container: beside one engine (policy file mounted), or ``node_shared`` by a
    node's engines (policy by env, request port open to the node)."""
    env = [
        env_var(c.ENV_POLICY_FILE, posixpath.join(c.POLICY_MOUNT_PATH, c.POLICY_FILE)),
        {"name": c.ENV_INSTANCE_ID, "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
        env_var(c.ENV_L1_SIZE, format_bytes(settings.l1_bytes)),
        env_var(c.ENV_REQUEST_PORT, str(c.REQUEST_PORT)),
        env_var(c.ENV_LMCACHE_HTTP_PORT, str(c.LMCACHE_HTTP_PORT)),
        env_var(c.ENV_SIDECAR_HTTP_PORT, str(c.SIDECAR_HTTP_PORT)),
        env_var(c.ENV_PROMETHEUS_MULTIPROC_DIR, c.METRICS_DIR),
        env_var(c.ENV_LMCACHE_TRACK_USAGE, "false"),
        env_var(c.ENV_TMPDIR, c.RUN_MOUNT_PATH),
        env_var(c.ENV_NUMBA_CACHE_DIR, c.NUMBA_CACHE_PATH),
        *kv_events_env(settings),
    ]
    redis = settings.redis_tier
    if redis and redis.url is None and not node_shared:  # the URL from its Secret (node mode's env adds it)
        env.append(redis_url_env(redis))
    if redis and redis.password_secret_name:
        env.append(secret_env(c.ENV_L2_REDIS_PASSWORD, redis.password_secret_name, redis.password_secret_key))
    if settings.gpu_access == "nvidia-runtime":
        # Sees the engine's GPU through the NVIDIA runtime without requesting one (CUDA IPC needs it).
        env += [
            env_var(c.ENV_NVIDIA_VISIBLE_DEVICES, "all"),
            env_var(c.ENV_NVIDIA_DRIVER_CAPABILITIES, "compute,utility"),
        ]
    mounts: list[dict[str, Any]] = [
        {"name": shm_volume, "mountPath": c.SHM_MOUNT_PATH},
        {"name": c.VOLUME_RUN, "mountPath": c.RUN_MOUNT_PATH},
        {"name": c.VOLUME_POLICY, "mountPath": c.POLICY_MOUNT_PATH, "readOnly": True},
    ]
    if node_shared:
        env = [e for e in env if e["name"] != c.ENV_POLICY_FILE] + _node_shared_env(settings)
        mounts = [m for m in mounts if m["name"] != c.VOLUME_POLICY] + [dict(CACHE_KEYS_MOUNT)]
    if settings.fs_tier:
        mounts.append({"name": c.VOLUME_L2_FS, "mountPath": settings.fs_tier.path})
    ports = [
        {"name": c.SIDECAR_PORT_NAME, "containerPort": c.SIDECAR_HTTP_PORT, "protocol": "TCP"},
        {"name": c.REQUEST_PORT_NAME, "containerPort": c.REQUEST_PORT, "protocol": "TCP"},
    ]
    if settings.kv_events:
        ports.append({"name": c.KV_EVENTS_PORT_NAME, "containerPort": c.KV_EVENTS_PORT, "protocol": "TCP"})
    sidecar: dict[str, Any] = {
        "name": c.SIDECAR_CONTAINER,
        "image": settings.sidecar_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": ["kvoffload-sidecar"],
        "env": env,
        "ports": ports,
        "startupProbe": _http_probe(c.PATH_STARTUP, 2, STARTUP_PROBE_BUDGET_S // 2),
        "readinessProbe": _http_probe(c.PATH_READY, 5, 3),
        "livenessProbe": _http_probe(c.PATH_LIVE, 10, 6),
        "resources": sidecar_resources(settings),
        "securityContext": copy.deepcopy(RESTRICTED_SECURITY_CONTEXT),
        "volumeMounts": mounts,
    }
    if native:
        sidecar["restartPolicy"] = "Always"
    return sidecar


def bundle_container(settings: InjectionSettings) -> dict[str, Any]:
    return {
        "name": c.BUNDLE_INIT_CONTAINER,
        "image": settings.bundle_image,
        "imagePullPolicy": settings.image_pull_policy,
        "command": list(c.BUNDLE_COPY_COMMAND),
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": copy.deepcopy(RESTRICTED_SECURITY_CONTEXT),
        "volumeMounts": [{"name": c.VOLUME_BUNDLE, "mountPath": c.BUNDLE_MOUNT_PATH}],
    }


OPTIONS_VOLUME_SIZE = "1Mi"
"""The emptyDir the options init step writes the engine's options file into (a few KiB)."""


def options_init_container(settings: InjectionSettings, engine: Mapping[str, Any], ours: Mapping[str, Any],
                           user_file: tuple[Mapping[str, Any], str, str | None] | None) -> dict[str, Any]:  # fmt: skip
    """The init container (admission mode) that writes the engine's options file into the options
    volume: kvoffload's options ``ours`` merged over the user's file, where ``user_file`` = (the
    engine's mount of the user's ConfigMap volume, the file's path, the digest the operator planned
    with). Runs with the engine's image (python3 and PyYAML), the connector bundle on its path in
    ``connector_source: init-container`` (kvoffload baked into the image otherwise); as uid
    ``SIDECAR_UID``, since the engine's image may default to root."""
    args = ["--ours", json.dumps(dict(ours), sort_keys=True, separators=(",", ":")),
            "--out", posixpath.join(c.TRTLLM_OPTIONS_MOUNT_PATH, c.TRTLLM_OPTIONS_FILE)]  # fmt: skip
    mounts: list[dict[str, Any]] = [{"name": c.VOLUME_TRTLLM_OPTIONS, "mountPath": c.TRTLLM_OPTIONS_MOUNT_PATH}]
    if user_file is not None:
        mount, path, digest = user_file
        args += ["--user-file", path, *(["--user-digest", digest] if digest else [])]
        mounts.append(dict(mount))
    env = []
    if settings.connector_source == "init-container":
        mounts.append({"name": c.VOLUME_BUNDLE, "mountPath": c.BUNDLE_MOUNT_PATH, "readOnly": True})
        env.append(env_var(c.ENV_PYTHONPATH, c.BUNDLE_PYTHONPATH))
    container: dict[str, Any] = {
        "name": c.OPTIONS_INIT_CONTAINER,
        "image": engine.get("image"),
        "command": list(c.OPTIONS_INIT_COMMAND),
        "args": args,
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "256Mi"}},
        "securityContext": copy.deepcopy(RESTRICTED_SECURITY_CONTEXT),
        "volumeMounts": mounts,
    }
    if engine.get("imagePullPolicy"):
        container["imagePullPolicy"] = engine["imagePullPolicy"]
    if env:
        container["env"] = env
    return container
