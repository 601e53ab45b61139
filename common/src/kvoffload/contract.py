"""The contract between operator, sidecar and connector.

Every annotation key, env var name, port, mount path and metric name that more
than one component spells lives here, and nowhere else. This module imports
only the standard library, so the operator can use it without torch or lmcache.
"""

from __future__ import annotations

from typing import Final

# --- Kubernetes API -----------------------------------------------------------
API_GROUP: Final = "kvoffload.io"
API_VERSION: Final = "v1alpha1"
POLICY_KIND: Final = "KVCachePolicy"
POLICY_PLURAL: Final = "kvcachepolicies"
FIELD_MANAGER: Final = "kvoffload-operator"
"""Server-Side Apply field manager: owns exactly what the operator injected."""

# --- Annotations on the user's workload (Deployment / StatefulSet) -----------
ANNOTATION_PREFIX: Final = "kvoffload.io/"
ANN_ENABLED: Final = "kvoffload.io/enabled"
ANN_POLICY: Final = "kvoffload.io/policy"
ANN_CONTAINER: Final = "kvoffload.io/container"
ANN_CONNECTOR_SOURCE: Final = "kvoffload.io/connector-source"
ANN_MODE: Final = "kvoffload.io/mode"
ANN_CPU_CACHE_SIZE: Final = "kvoffload.io/cpu-cache-size"
ANN_SHM_SIZE: Final = "kvoffload.io/shm-size"
ANN_BACKEND: Final = "kvoffload.io/backend"

# --- Annotations/labels the operator stamps on the pod template ---------------
ANN_INJECTED_VERSION: Final = "kvoffload.io/injected-version"
ANN_CONFIG_HASH: Final = "kvoffload.io/config-hash"
LABEL_MANAGED_BY: Final = "app.kubernetes.io/managed-by"
LABEL_MANAGED_BY_VALUE: Final = "kvoffload"
LABEL_INJECTED: Final = "kvoffload.io/injected"
PROMETHEUS_SCRAPE_ANNOTATIONS: Final = (
    "prometheus.io/scrape",
    "prometheus.io/port",
    "prometheus.io/path",
)

# --- Names of what gets injected into the pod ---------------------------------
SIDECAR_CONTAINER: Final = "kvoffload-cache"
BUNDLE_INIT_CONTAINER: Final = "kvoffload-connector-bundle"
OPTIONS_INIT_CONTAINER: Final = "kvoffload-trtllm-options"
"""Admission mode: the init container (engine's image) that writes the engine's options file in the pod."""
OPTIONS_INIT_COMMAND: Final = ("python3", "-m", "kvoffload.trtllm_options_init")
"""Its command (the module ships in the connector bundle and in an image with kvoffload baked in)."""
VOLUME_SHM: Final = "kvoffload-shm"
VOLUME_RUN: Final = "kvoffload-run"
VOLUME_BUNDLE: Final = "kvoffload-connector"
VOLUME_TRTLLM_OPTIONS: Final = "kvoffload-trtllm-options"
VOLUME_POLICY: Final = "kvoffload-policy"

# --- Ports (all containers of a pod share one network namespace) -------------
REQUEST_PORT: Final = 5555
"""LMCache MP server's ZMQ request port, reached by the connector on 127.0.0.1."""
LMCACHE_HTTP_PORT: Final = 5580
"""LMCache's unauthenticated admin HTTP API: bound to 127.0.0.1 only."""
SIDECAR_HTTP_PORT: Final = 9455
"""The sidecar's own health and /metrics endpoint, reachable on the pod IP."""
SIDECAR_PORT_NAME: Final = "kvo-metrics"
ENGINE_METRICS_PORT: Final = 9456
"""Without a sidecar in the pod (node mode, in-process backend) the connector itself serves the
pod's connector metrics here (one TensorRT-LLM process binds it; the others write files)."""
ENGINE_METRICS_PORT_NAME: Final = "kvo-connector"
REQUEST_PORT_NAME: Final = "kvo-cache"
KV_EVENTS_PORT: Final = 5570
"""The cache server's KV-event publisher (ZMQ PUB, on the pod IP) where a policy turns KV events on.
Not 5557 (TensorRT-LLM's and vLLM's own event port, which an engine in the same pod may bind), nor
5556/5558/5559 (llm-d's and vLLM's event and replay ports)."""
KV_EVENTS_PORT_NAME: Final = "kvo-events"
OPERATOR_METRICS_PORT: Final = 8080
OPERATOR_HEALTH_PORT: Final = 8081

# --- HTTP paths served by the sidecar -----------------------------------------
PATH_METRICS: Final = "/metrics"
PATH_STARTUP: Final = "/startupz"
PATH_READY: Final = "/readyz"
PATH_LIVE: Final = "/livez"
LMCACHE_PATH_STATUS: Final = "/status"
"""The LMCache server's own status page on its loopback HTTP port (read by the sidecar's metrics)."""

# --- Mount paths --------------------------------------------------------------
SHM_MOUNT_PATH: Final = "/dev/shm"
RUN_MOUNT_PATH: Final = "/var/run/kvoffload"
METRICS_DIR: Final = "/var/run/kvoffload/metrics"
NUMBA_CACHE_PATH: Final = "/var/run/kvoffload/numba"
METRICS_LIVE_LOCK_TEMPLATE: Final = "live_{pid}.lock"
"""In METRICS_DIR: a process writing multiprocess metrics holds ``flock(LOCK_EX)`` on this
file (``pid`` as in prometheus_client's file names) for its whole life. Containers have
separate PID namespaces, so this lock is how the sidecar tells a dead writer's files."""
BUNDLE_MOUNT_PATH: Final = "/opt/kvoffload"
BUNDLE_PYTHON_DIR: Final = "python"
"""In the bundle: kvoffload and lmcache (no dependencies); the operator puts it first on PYTHONPATH."""
BUNDLE_DEPS_DIR: Final = "deps"
"""In the bundle, beside BUNDLE_PYTHON_DIR: the third-party packages lmcache imports that TensorRT-LLM
images lack. The connector appends it to the END of sys.path, so the image's own packages win."""
BUNDLE_MANIFEST: Final = "bundle.json"
"""In the bundle: what it was built with (Python ABI, lmcache version), checked by the connector at start."""
BUNDLE_PYTHONPATH: Final = f"{BUNDLE_MOUNT_PATH}/{BUNDLE_PYTHON_DIR}"
BUNDLE_IMAGE_PATH: Final = "/kvoffload-bundle"
"""Where the connector-bundle image keeps the files its init container copies."""
BUNDLE_COPY_COMMAND: Final = ("cp", "-R", f"{BUNDLE_IMAGE_PATH}/.", f"{BUNDLE_MOUNT_PATH}/")
"""The init container's copy: the operator's command and the bundle image's ENTRYPOINT are this argv."""
TRTLLM_OPTIONS_MOUNT_PATH: Final = "/etc/kvoffload/trtllm"
TRTLLM_OPTIONS_FILE: Final = "extra-llm-api-options.yaml"
POLICY_MOUNT_PATH: Final = "/etc/kvoffload/policy"
POLICY_FILE: Final = "policy.json"
SIDECAR_VENV_PATH: Final = "/opt/venv"
"""The sidecar image's Python (Dockerfile): a volume mounted there would hide it."""
RESERVED_MOUNT_PATHS: Final = (SHM_MOUNT_PATH, RUN_MOUNT_PATH, BUNDLE_MOUNT_PATH, "/etc/kvoffload", SIDECAR_VENV_PATH)
"""Paths kvoffload mounts (or ships) in the pods it injects: no user directory may be one of them,
lie inside one, or hold one (``/etc/kvoffload`` holds the options and policy mounts)."""

# --- Rules every side applies -------------------------------------------------
REDIS_URL_PATTERN: Final = (
    r"^redis://(?:[^\s/@:?#\[\]]+@)?(?:\[[0-9A-Fa-f:.]+\]|[^\s/@:?#\[\]]+)"
    r"(?::(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3}))?(?:/0?)?$"
)
"""Redis L2 URLs: ``redis://[user@]host[:port][/0]``. LMCache's Redis adapter speaks plain Redis to
database 0; the password goes in a Secret. The CRD's CEL rule (RE2), the operator and the sidecar
accept exactly these, so a policy the apiserver admits never crash-loops its sidecar."""

MIN_L1_SIZE: Final = "64Mi"
"""The smallest L1 any side accepts (two 256-token chunks of Llama-3-8B in bf16, 32 MiB each): below
it LMCache cannot hold a useful prefix, so a smaller value is a typo (``1Ki``), not a choice."""

# --- Environment variables ----------------------------------------------------
# Read by the connector (set on the TensorRT-LLM container).
ENV_SERVER_URL: Final = "KVOFFLOAD_SERVER_URL"
ENV_BACKEND: Final = "KVOFFLOAD_BACKEND"
ENV_MODEL_NAME: Final = "KVOFFLOAD_MODEL_NAME"
ENV_CHUNK_SIZE: Final = "KVOFFLOAD_CHUNK_SIZE"
ENV_TOKENS_PER_BLOCK: Final = "KVOFFLOAD_TOKENS_PER_BLOCK"
ENV_LOOKUP_TIMEOUT_MS: Final = "KVOFFLOAD_LOOKUP_TIMEOUT_MS"
ENV_RETRIEVE_TIMEOUT_MS: Final = "KVOFFLOAD_RETRIEVE_TIMEOUT_MS"
ENV_STORE_TIMEOUT_MS: Final = "KVOFFLOAD_STORE_TIMEOUT_MS"
ENV_SAVE_DECODE_TOKENS: Final = "KVOFFLOAD_SAVE_DECODE_TOKENS"
ENV_METRICS_ENABLED: Final = "KVOFFLOAD_METRICS_ENABLED"
ENV_HEARTBEAT_INTERVAL_MS: Final = "KVOFFLOAD_HEARTBEAT_INTERVAL_MS"
ENV_ASYNC_SAVE: Final = "KVOFFLOAD_ASYNC_SAVE"
ENV_ASYNC_LOAD_MIN_TOKENS: Final = "KVOFFLOAD_ASYNC_LOAD_MIN_TOKENS"
"""Loads of at least this many tokens run asynchronously (the request waits, the batch does not); 0: never."""
ENV_LOAD_COST_GUARD: Final = "KVOFFLOAD_LOAD_COST_GUARD"
"""On by default: a hit is computed instead where its load is measured slower (``load_cost``)."""
ENV_LAYERWISE_LOADS: Final = "KVOFFLOAD_LAYERWISE_LOADS"
"""On by default: a synchronous load is copied span of layers by span, each layer of the forward
pass waiting only for its own span (one rank; once the engine was seen calling every layer's hook)."""
ENV_RECOMPUTE_TOKENS_PER_S: Final = "KVOFFLOAD_RECOMPUTE_TOKENS_PER_S"
"""The engine's prefill rate, given instead of measured (the cost guard compares loads with it)."""
ENV_METRICS_PORT: Final = "KVOFFLOAD_METRICS_PORT"
"""Set (by the operator, where no sidecar serves the pod's /metrics): the port the connector serves them on."""
ENV_PROMETHEUS_MULTIPROC_DIR: Final = "PROMETHEUS_MULTIPROC_DIR"
ENV_PYTHONHASHSEED: Final = "PYTHONHASHSEED"
ENV_PYTHONPATH: Final = "PYTHONPATH"
# Read by the sidecar.
ENV_REQUEST_PORT: Final = "KVOFFLOAD_REQUEST_PORT"
ENV_LMCACHE_HTTP_PORT: Final = "KVOFFLOAD_LMCACHE_HTTP_PORT"
ENV_SIDECAR_HTTP_PORT: Final = "KVOFFLOAD_SIDECAR_HTTP_PORT"
ENV_L1_SIZE: Final = "KVOFFLOAD_L1_SIZE"
"""L1 (pinned host RAM) size as a Kubernetes quantity, e.g. ``20Gi``."""
ENV_EVICTION_POLICY: Final = "KVOFFLOAD_EVICTION_POLICY"
ENV_MAX_WORKERS: Final = "KVOFFLOAD_MAX_WORKERS"
ENV_L2_FS_PATH: Final = "KVOFFLOAD_L2_FS_PATH"
ENV_L2_REDIS_URL: Final = "KVOFFLOAD_L2_REDIS_URL"
ENV_L2_REDIS_PASSWORD: Final = "KVOFFLOAD_L2_REDIS_PASSWORD"
ENV_L2_FS_SIZE: Final = "KVOFFLOAD_L2_FS_SIZE"
ENV_POLICY_FILE: Final = "KVOFFLOAD_POLICY_FILE"
ENV_INSTANCE_ID: Final = "KVOFFLOAD_INSTANCE_ID"
ENV_SHM_NAME: Final = "KVOFFLOAD_SHM_NAME"
ENV_GRACE_SECONDS: Final = "KVOFFLOAD_GRACE_SECONDS"
ENV_LMCACHE_TRACK_USAGE: Final = "LMCACHE_TRACK_USAGE"
ENV_TMPDIR: Final = "TMPDIR"
ENV_NUMBA_CACHE_DIR: Final = "NUMBA_CACHE_DIR"
"""LMCache's CPU kernels are numba functions with ``cache=True``: without a writable cache
directory they fail to load (``no locator available``), and the root filesystem is read-only."""
ENV_WARM_STANDBY: Final = "KVOFFLOAD_WARM_STANDBY"
"""Sidecar: keep a standby process with LMCache's server imported, which forks a new server at once after a crash."""
ENV_KV_EVENTS_PORT: Final = "KVOFFLOAD_KV_EVENTS_PORT"
"""Sidecar: publish KV events for routers on this port (ZMQ PUB, all addresses); unset: no events."""
ENV_KV_EVENTS: Final = "KVOFFLOAD_KV_EVENTS"
"""Connector: report committed stores to the cache server's KV-event module (true/false, default false)."""
ENV_KV_EVENTS_TOPIC: Final = "KVOFFLOAD_KV_EVENTS_TOPIC"
"""Sidecar: the ZMQ topic of every event batch (default empty; llm-d's index wants ``kv@<pod>@<model>``)."""
ENV_KV_EVENTS_FORMAT: Final = "KVOFFLOAD_KV_EVENTS_FORMAT"
"""Sidecar: the events' wire format (``policy_values.KV_EVENTS_FORMATS``; unset: ``vllm``, vLLM >= 0.24's maps)."""
KV_EVENTS_JOURNAL: Final = "kv-events.journal"
"""Sidecar: the KV-event journal's file name, ``<instance id>.`` before it, beside ``METRICS_DIR`` in
``RUN_MOUNT_PATH`` (which outlives a server restart): a restarted server withdraws what it lists."""
ENV_POD_IP: Final = "KVOFFLOAD_POD_IP"
"""Set by the operator beside the events topic (the downward API's ``status.podIP``), so that a
topic can name the pod as ``$(KVOFFLOAD_POD_IP)``, which Kubernetes expands; read by no component."""

# --- Connector entry points named in TensorRT-LLM's kv_connector_config ------
CONNECTOR_MODULE: Final = "kvoffload.connector.trtllm"
CONNECTOR_SCHEDULER_CLASS: Final = "KvoffloadConnectorScheduler"
CONNECTOR_WORKER_CLASS: Final = "KvoffloadConnectorWorker"
BACKEND_SIDECAR: Final = "sidecar"
BACKEND_INPROCESS: Final = "inprocess"

# --- The cache server's wire, beyond LMCache's own ------------------------------
WORKER_SILENCE_LIMIT_S: Final = 120
"""Seconds a registered worker may stay silent before the cache server reaps it (the sidecar's
``--worker-reap-timeout-seconds``): it is dead, and what it held is released."""
MAX_PING_INTERVAL_S: Final = 30
"""The connector PINGs at least this often whatever its heartbeat interval, well inside the silence limit."""

STORE_ABORT_PAYLOAD: Final = b"kvoffload:abort-store"
"""The payload of a COMMIT_STORE that aborts its PREPARE_STORE's reservation instead of publishing it:
sent by the connector for a store it will not finish, read by the server's transfer guard
(``lmcache_guard.install_transfer_guard``), which discards the reservation. LMCache 0.5.6 has no
abort call; a server without the guard fails such a COMMIT (it tries to unpickle the payload)."""

# --- Metric names (as exposed; counters carry prometheus_client's _total) ----

# Connector (labels: model, backend; errors also operation, reason).
M_LOOKUP_REQUESTS: Final = "kvoffload_connector_lookup_requests"
M_LOOKUP_QUERIED_TOKENS: Final = "kvoffload_connector_lookup_queried_tokens"
M_LOOKUP_HIT_TOKENS: Final = "kvoffload_connector_lookup_hit_tokens"
M_LOOKUP_SECONDS: Final = "kvoffload_connector_lookup_duration_seconds"
M_RETRIEVE_REQUESTS: Final = "kvoffload_connector_retrieve_requests"
M_RETRIEVE_TOKENS: Final = "kvoffload_connector_retrieve_tokens"
M_RETRIEVE_BYTES: Final = "kvoffload_connector_retrieve_bytes"
M_RETRIEVE_SECONDS: Final = "kvoffload_connector_retrieve_duration_seconds"
M_STORE_REQUESTS: Final = "kvoffload_connector_store_requests"
M_STORE_TOKENS: Final = "kvoffload_connector_store_tokens"
M_STORE_BYTES: Final = "kvoffload_connector_store_bytes"
M_STORE_SECONDS: Final = "kvoffload_connector_store_duration_seconds"
M_CONNECTOR_ERRORS: Final = "kvoffload_connector_errors"
M_BACKEND_UP: Final = "kvoffload_connector_backend_up"
M_STORES_ABORTED: Final = "kvoffload_connector_stores_aborted"
"""Stores the connector abandoned after PREPARE_STORE (a copy that raised, a timeout, a reset, the
engine's close before COMMIT): their reservations were aborted, never published."""
M_LOOKUPS_ABANDONED: Final = "kvoffload_connector_lookups_abandoned"
"""Lookups whose answer came too late (counted a miss); the server's prefetch of each is consumed and
its read locks released before the session's next lookup and at its end."""
M_PROMPT_TOKENS: Final = "kvoffload_connector_prompt_tokens"
"""Prompt tokens the engine scheduled, by ``source`` (PROMPT_TOKEN_SOURCES) and, for computed ones,
the ``reason`` they were not reused (COMPUTED_REASONS; ``none`` for the other sources)."""
PROMPT_TOKEN_SOURCES: Final = ("device", "cache", "computed")
"""device: TensorRT-LLM's own block reuse matched them; cache: loaded from kvoffload's cache server
(its L1, after an L2 prefetch where the server had to: LMCache's own counters split that);
computed: the engine computed them."""
COMPUTED_REASONS: Final = (
    "not_cached", "partial_chunk", "final_block", "declined", "lookup_timeout", "cache_unavailable", "no_lookup",
    "uncacheable", "slower_to_load",
)  # fmt: skip
"""Why prompt tokens were computed: the cache server held no KV for them; they lie past the last
whole cache chunk (LMCache keeps whole chunks); they are the prompt's final block, which the engine
computes for its logits even on a hit; a hit whose load could not be secured; the lookup timed
out; the cache server was unreachable or failed; the request was never looked up; the request's
keys cannot name what its KV depends on (a multimodal request without content hashes), so it is
neither looked up nor saved; a hit the cost guard computed, its load measured slower than its
prefill (``KVOFFLOAD_LOAD_COST_GUARD``)."""

# Sidecar.
M_SIDECAR_SERVER_RESTARTS: Final = "kvoffload_sidecar_server_restarts"
M_SIDECAR_SERVER_UP: Final = "kvoffload_sidecar_server_up"
M_SIDECAR_CONFIG_INFO: Final = "kvoffload_sidecar_config"
M_SIDECAR_SERVER_READ_LOCKED_CHUNKS: Final = "kvoffload_sidecar_server_read_locked_chunks"
"""L1 chunks the cache server holds read-locked now (lookups, prefetches and loads not released)."""
M_SIDECAR_SERVER_RESERVED_CHUNKS: Final = "kvoffload_sidecar_server_reserved_chunks"
"""L1 chunks reserved for a store and not yet committed or dropped (live write reservations)."""
M_SIDECAR_SERVER_PREFETCH_JOBS: Final = "kvoffload_sidecar_server_prefetch_jobs"
"""Prefetch jobs the cache server keeps whose result nobody took yet."""

# Operator.
M_OPERATOR_RECONCILES: Final = "kvoffload_operator_reconciles"
M_OPERATOR_RECONCILE_SECONDS: Final = "kvoffload_operator_reconcile_duration_seconds"
M_OPERATOR_INJECTED_WORKLOADS: Final = "kvoffload_operator_injected_workloads"
M_OPERATOR_ERRORS: Final = "kvoffload_operator_errors"
M_OPERATOR_RETRY_QUEUE: Final = "kvoffload_operator_retry_queue"

LMCACHE_SERVER_METRIC_PREFIX: Final = "lmcache_mp_"
"""Prefix of the LMCache MP server's own series, re-exported by the sidecar."""


def server_url(port: int = REQUEST_PORT) -> str:
    """The URL the connector uses to reach the sidecar in the same pod."""
    return f"tcp://127.0.0.1:{port}"


# --- Operator (appended by the operator; only the operator spells these) ------
FIELD_MANAGER_HANDOFF: Final = "kvoffload-operator-handoff"
"""Field manager that keeps the user's own args when the operator lets go of them on removal."""
ANN_ORIGINAL_OPTIONS_PATH: Final = "kvoffload.io/original-options-path"
"""Pod-template annotation: the user's options-file path the operator replaced by its merged copy."""
GENERATED_CONFIGMAP_SUFFIX: Final = "-kvoffload"
"""The generated ConfigMap is ``<workload name><suffix>``."""
VOLUME_L2_FS: Final = "kvoffload-l2-fs"
ENV_NVIDIA_VISIBLE_DEVICES: Final = "NVIDIA_VISIBLE_DEVICES"
ENV_NVIDIA_DRIVER_CAPABILITIES: Final = "NVIDIA_DRIVER_CAPABILITIES"

# --- Node-shared mode (one cache pod per node and policy) --------------------
ENV_REQUEST_HOST: Final = "KVOFFLOAD_REQUEST_HOST"
"""Address the cache server's ZMQ request port binds: loopback beside the engine (sidecar
mode), all addresses in a node-shared cache pod that engines reach through a Service."""
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
COMPONENT_NODE_CACHE: Final = "node-cache"
LABEL_NODE_CACHE_POLICY: Final = "kvoffload.io/node-cache-policy"
"""On node-mode engine pods: the KVCachePolicy whose node cache they use."""
LABEL_CACHE_POLICY: Final = "kvoffload.io/cache-policy"
"""On node cache pods: the KVCachePolicy they serve."""
NODE_SHM_HOST_ROOT: Final = "/dev/shm/kvoffload"
"""On the node: ``<root>/<namespace>-<policy>`` is the /dev/shm that one policy's engines and
cache pod share (a hostPath)."""
NODE_SHM_PREPARE_CONTAINER: Final = "kvoffload-shm-permissions"
ANN_CACHE_NODE: Final = "kvoffload.io/cache-node"
"""On node cache pods: the node the pod is for (set before the scheduler binds it)."""
ENV_CACHE_KEYS_DIR: Final = "KVOFFLOAD_CACHE_KEYS_DIR"
"""Node mode: the directory holding the policy's CURVE keys (Z85 text files ``CACHE_KEY_*``). Set by
the operator on the node cache pod (the sidecar's server accepts only the policy's client key) and
on the policy's engines (the connector dials with the client key); unset: no authentication
(sidecar mode, on the pod's loopback)."""
CACHE_KEYS_MOUNT_PATH: Final = "/etc/kvoffload/cache-keys"
VOLUME_CACHE_KEYS: Final = "kvoffload-cache-keys"
CACHE_KEY_SERVER_PUBLIC: Final = "server.public"
CACHE_KEY_SERVER_SECRET: Final = "server.secret"
"""Only in the node cache pod."""
CACHE_KEY_CLIENT_PUBLIC: Final = "client.public"
CACHE_KEY_CLIENT_SECRET: Final = "client.secret"
"""Only in the policy's engine pods."""
CACHE_KEYS_SECRET_SUFFIX: Final = "-cache-keys"
"""The policy's key Secret is ``<node-local Service name><suffix>`` in the policy's namespace."""

OPERATOR_LEASE_NAME: Final = "kvoffload-operator"
"""The coordination.k8s.io Lease the acting operator holds (in its own namespace)."""
ANN_LEASE_PLANNING: Final = "kvoffload.io/planning"
"""On that Lease, written by its holder: what its admission plans depend on besides the API
(version, defaults, cluster facts) as JSON, sealed with an HMAC under a key derived from the
webhook's serving key. A replica not holding the Lease plans at admission with these inputs, only
when their seal checks and the holder runs its own operator version."""
ANN_LEASE_WEBHOOK: Final = "kvoffload.io/webhook"
"""On that Lease, written by its holder beside its planning inputs: where its webhook listens
(``<pod IP>:<port>``), sealed as they are. A replica that cannot plan with the holder's inputs (another
operator version, during an upgrade) forwards the reviews it gets there, so the holder answers them."""
HEADER_FORWARDED_REVIEW: Final = "X-Kvoffload-Forwarded"
"""On a review one replica forwards to the Lease's holder: the receiver answers it itself, never
forwarding it again."""

# --- Injection at pod admission (the operator's mutating webhook) ------------
LABEL_INJECT: Final = "kvoffload.io/inject"
"""The one field the operator writes into a workload's pod template in admission mode: the hash of
the injection record its pods are created with. The webhook's objectSelector matches it, and a
new value rolls the pods exactly once."""
ANN_INJECTION_RECORD: Final = "kvoffload.io/injection-record"
"""On the workload itself (admission mode, written in the same apply as ``LABEL_INJECT``): the
injection record (JSON) the webhook renders the workload's pods from."""
ANN_INJECTED_FROM: Final = "kvoffload.io/injected-from"
"""On each pod the webhook injects: the hash of the record it was injected from (the value
``LABEL_INJECT`` has on a template of that record). A pod of an older ReplicaSet created during a
rollout carries its template's old label and the current record's hash here."""
FILE_ANNOTATIONS: Final = {
    POLICY_FILE: "kvoffload.io/policy.json",
}
"""Admission mode: the pod annotation holding each of the pod's files, mounted through a
downward API volume (no generated ConfigMap). The TensorRT-LLM options file is not one: the pod's
``OPTIONS_INIT_CONTAINER`` writes it, so no webhook answer carries the user's options text."""
WEBHOOK_PORT: Final = 8443
WEBHOOK_PATH: Final = "/mutate-pods"
WEBHOOK_WORKLOADS_PATH: Final = "/mutate-workloads"
"""Deployments and StatefulSets at CREATE (one that arrives opted in gets its template label there)
and at UPDATE (an injected one keeps kvoffload's record and label, as the plan gives them)."""
WEBHOOK_CONFIGURATION_NAME: Final = "kvoffload-pod-injection"
"""The MutatingWebhookConfiguration the operator keeps (its caBundle, rules and client config)."""
WEBHOOK_TLS_SECRET: Final = "kvoffload-webhook-tls"
"""Secret in the operator's namespace holding the webhook's serving certificate and key (and the CA's certificate)."""
WEBHOOK_CA_SECRET: Final = "kvoffload-webhook-ca"
"""Secret beside it holding the webhook CA's certificate and key (read only to issue or renew)."""
INJECTION_MODES: Final = ("template", "admission")
EVENTS_WARNINGS: Final = "warnings"
EVENTS_ALL: Final = "all"
EVENT_LEVELS: Final = (EVENTS_WARNINGS, EVENTS_ALL)
"""The operator's ``--events``: Warning Events only (default: one write per workload fewer at scale;
the injection record, the policy's status and the metrics show what was injected) or Normal ones too
(``KvoffloadInjected``, ``KvoffloadRemoved``)."""
M_OPERATOR_ADMISSIONS: Final = "kvoffload_operator_admissions"
M_OPERATOR_EVICTIONS: Final = "kvoffload_operator_evictions"
M_OPERATOR_EVICTION_REFUSALS: Final = "kvoffload_operator_eviction_refusals"
"""Evictions of pods created without the injection that a PodDisruptionBudget refused (429)."""
