"""``kvoffload-operator``'s command line: its flags (each with an environment variable, shown in
``--help``, so the Helm chart can pass values either way), their checks (a bad flag stops the
operator with one line naming it), and the choice between ``--remove-all`` (``uninstall``) and a
run of the operator (``run_loop``).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

import yaml

from kvoffload import contract as c
from kvoffload.operator import PROG, __version__
from kvoffload.operator.admission.acting_replica import planning_inputs
from kvoffload.operator.admission.webhook_tls import ReviewScope, WebhookRegistrationMissing
from kvoffload.operator.api.kube import Kube, load_configuration
from kvoffload.operator.api.operator_deployment import OperatorDeployment, read_operator_deployment
from kvoffload.operator.control.leadership import Leadership
from kvoffload.operator.intent.settings import OperatorDefaults, base_settings
from kvoffload.operator.plan.injection_plan import ClusterInfo
from kvoffload.operator.run_loop import RunSettings, WebhookSettings, run_operator
from kvoffload.operator.uninstall import remove_all, uninstall_lease
from kvoffload.policy_values import EVICTION_POLICIES, GPU_ACCESS_MODES, PolicyError
from kvoffload.quantity import QuantityError, parse_bytes

NATIVE_SIDECAR_MIN = (1, 29)


def _env(name: str, default: str) -> str:
    return os.environ.get(name, default)


def build_parser() -> argparse.ArgumentParser:
    d = OperatorDefaults()
    p = argparse.ArgumentParser(
        prog=PROG, description="Injects the kvoffload KV-cache sidecar into TensorRT-LLM workloads."
    )

    def add(flag: str, env: str, default: str, help_: str, **kw: object) -> None:
        p.add_argument(flag, default=_env(env, default), help=f"{help_} (env {env}, default {default!r})", **kw)  # type: ignore[arg-type]

    add("--sidecar-image", "KVOFFLOAD_SIDECAR_IMAGE", d.sidecar_image, "LMCache sidecar image")
    add("--bundle-image", "KVOFFLOAD_BUNDLE_IMAGE", d.bundle_image, "connector-bundle image")
    add("--image-pull-policy", "KVOFFLOAD_IMAGE_PULL_POLICY", d.image_pull_policy, "pull policy of injected images")
    add("--default-l1-size", "KVOFFLOAD_DEFAULT_L1_SIZE", "20Gi", "default L1 (pinned host RAM) size")
    add("--default-shm-size", "KVOFFLOAD_DEFAULT_SHM_SIZE", "8Gi", "default /dev/shm size")
    add("--default-chunk-size", "KVOFFLOAD_DEFAULT_CHUNK_SIZE", str(d.chunk_size), "default LMCache chunk size")
    add("--default-eviction-policy", "KVOFFLOAD_DEFAULT_EVICTION_POLICY", d.eviction_policy,
        "default eviction policy: " + "|".join(EVICTION_POLICIES))  # fmt: skip
    add("--default-max-workers", "KVOFFLOAD_DEFAULT_MAX_WORKERS", str(d.max_workers), "default LMCache workers")
    add("--gpu-access", "KVOFFLOAD_GPU_ACCESS", d.gpu_access, "default GPU access: " + "|".join(GPU_ACCESS_MODES))
    add("--runtime-class-name", "KVOFFLOAD_RUNTIME_CLASS_NAME", "", "runtimeClassName for injected pods (empty: none)")
    add("--sidecar-memory-overhead", "KVOFFLOAD_SIDECAR_MEMORY_OVERHEAD", "2Gi", "sidecar memory on top of L1")
    add("--sidecar-cpu-request", "KVOFFLOAD_SIDECAR_CPU_REQUEST", d.sidecar_cpu_request, "sidecar CPU request")
    add("--native-sidecars", "KVOFFLOAD_NATIVE_SIDECARS", "auto",
        "auto (from the apiserver's /version, >= 1.29), true or false")  # fmt: skip
    add("--metrics-port", "KVOFFLOAD_OPERATOR_METRICS_PORT", str(c.OPERATOR_METRICS_PORT), "Prometheus /metrics port")
    add("--health-port", "KVOFFLOAD_OPERATOR_HEALTH_PORT", str(c.OPERATOR_HEALTH_PORT), "kopf liveness port (/healthz)")
    add("--namespaces", "KVOFFLOAD_WATCH_NAMESPACES", "", "comma-separated namespaces to watch (empty: all)")
    p.add_argument(
        "--namespace", action="append", default=[], help="a namespace to watch (repeatable; adds to --namespaces)"
    )
    add("--defaults-file", "KVOFFLOAD_DEFAULTS_FILE", "",
        "JSON/YAML KVCachePolicy spec laid over the flag defaults (the chart's `defaults` value)")  # fmt: skip
    add("--leader-election", "KVOFFLOAD_LEADER_ELECTION", "true",
        "true: one operator acts at a time, holding a Lease (others wait, live); false: act alone")  # fmt: skip
    add("--leader-election-namespace", "POD_NAMESPACE", "", "namespace of the operator's Lease (its own)")
    add("--operator-deployment", "KVOFFLOAD_OPERATOR_DEPLOYMENT", "",
        "the operator's own Deployment (in its namespace): its Lease and the webhook's Secrets name it as "
        "their owner, so they are deleted with it (empty: they get no owner and stay)")  # fmt: skip
    add("--node-mode", "KVOFFLOAD_NODE_MODE", "false",
        "true: keep per-node cache pods for mode: node policies (needs the pod rights of the chart's "
        "nodeMode.enabled); false: such workloads get a KvoffloadInvalid Warning")  # fmt: skip
    add("--injection", "KVOFFLOAD_INJECTION", "template",
        "where the injection lands: template (the workload's pod template, by Server-Side Apply) or admission "
        "(each pod as it is created, by the operator's webhook; the template gets one label)")  # fmt: skip
    add("--webhook-port", "KVOFFLOAD_WEBHOOK_PORT", str(c.WEBHOOK_PORT), "HTTPS port of the injection webhook")
    add("--webhook-service", "KVOFFLOAD_WEBHOOK_SERVICE", "",
        "admission mode: the operator's Service (in its namespace) the apiserver calls")  # fmt: skip
    add("--webhook-url", "KVOFFLOAD_WEBHOOK_URL", "",
        "admission mode: an https URL the apiserver calls instead (an operator outside the cluster)")  # fmt: skip
    add("--webhook-client-ca", "KVOFFLOAD_WEBHOOK_CLIENT_CA", "",
        "admission mode: a PEM CA file; reviews are answered only for callers with a client certificate it "
        "signed (the apiserver's, from its AdmissionConfiguration kubeConfigFile); empty: any caller")  # fmt: skip
    add("--webhook-advertise-host", "POD_IP", "",
        "admission mode: this replica's address (the chart passes the pod's IP), published in the Lease while "
        "it holds it so that a replica of another version forwards reviews to it during an upgrade; empty: "
        "not published")  # fmt: skip
    add("--events", "KVOFFLOAD_EVENTS", c.EVENTS_WARNINGS,
        "Events on workloads: warnings (what needs attention) or all (also KvoffloadInjected and "
        "KvoffloadRemoved, one more write per injected workload)")  # fmt: skip
    add("--resync-seconds", "KVOFFLOAD_RESYNC_SECONDS", "600", "full re-reconcile period (0: off)")
    add("--workers", "KVOFFLOAD_OPERATOR_WORKERS", "8", "threads running reconciles")
    add("--kubeconfig", "KUBECONFIG", "", "kubeconfig (empty: in-cluster service account)")
    add("--log-level", "KVOFFLOAD_LOG_LEVEL", "INFO", "log level")
    p.add_argument("--remove-all", action="store_true",
                   help="take kvoffload out of every watched workload and exit (the chart's pre-delete hook)")  # fmt: skip
    p.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    return p


def defaults_from(args: argparse.Namespace) -> OperatorDefaults:
    """Operator defaults from the command line; raises ``SystemExit`` naming a bad flag."""
    spec: dict[str, object] = {}
    if args.defaults_file:
        try:
            with open(args.defaults_file, encoding="utf-8") as fh:
                loaded = yaml.safe_load(fh)
        except (OSError, yaml.YAMLError) as exc:
            raise SystemExit(f"{PROG}: --defaults-file {args.defaults_file!r}: {exc}") from None
        if not isinstance(loaded, dict):
            raise SystemExit(f"{PROG}: --defaults-file {args.defaults_file!r}: must hold a KVCachePolicy spec object")
        spec = loaded
    try:
        defaults = OperatorDefaults(
            sidecar_image=args.sidecar_image,
            bundle_image=args.bundle_image,
            image_pull_policy=args.image_pull_policy,
            l1_bytes=parse_bytes(args.default_l1_size, "--default-l1-size"),
            shm_bytes=parse_bytes(args.default_shm_size, "--default-shm-size"),
            chunk_size=int(args.default_chunk_size),
            eviction_policy=args.default_eviction_policy,
            max_workers=int(args.default_max_workers),
            gpu_access=args.gpu_access,
            runtime_class_name=args.runtime_class_name or None,
            sidecar_memory_overhead_bytes=parse_bytes(args.sidecar_memory_overhead, "--sidecar-memory-overhead"),
            sidecar_cpu_request=args.sidecar_cpu_request,
            spec=spec,
        )
    except (QuantityError, ValueError) as exc:
        raise SystemExit(f"{PROG}: {exc}") from None
    checked = base_settings(defaults)
    if isinstance(checked, PolicyError):
        raise SystemExit(f"{PROG}: {checked.message}")
    return defaults


def main(argv: Sequence[str] | None = None) -> int:
    """Parse and check the command line, then uninstall (``--remove-all``) or run the operator.
    Every bad flag stops it with one line naming the flag (``SystemExit``)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    defaults = defaults_from(args)
    if args.default_eviction_policy not in EVICTION_POLICIES or args.gpu_access not in GPU_ACCESS_MODES:
        raise SystemExit(f"{PROG}: --default-eviction-policy or --gpu-access has a value that is not allowed")
    if args.events not in c.EVENT_LEVELS:
        raise SystemExit(f"{PROG}: --events {args.events!r}: allowed " + ", ".join(c.EVENT_LEVELS))
    _check_listener_ports(args)
    args.webhook_advertise_host = _advertised_host(args.webhook_advertise_host)
    kubeconfig = args.kubeconfig or None
    if kubeconfig:
        os.environ["KUBECONFIG"] = kubeconfig  # kopf's own login reads it too
    kube = Kube(load_configuration(kubeconfig))
    native = _native_sidecars(args.native_sidecars, kube)
    if args.node_mode not in ("true", "false"):
        raise SystemExit(f"{PROG}: --node-mode {args.node_mode!r}: allowed true, false")
    namespaces = tuple(sorted({n.strip() for n in [*args.namespaces.split(","), *args.namespace] if n.strip()}))
    admission = _injection_mode(args) == "admission"
    owner = _owner(args, kube)
    if args.remove_all:
        return remove_all(kube, namespaces, admission, _uninstall_lease(args, kube, owner))
    cluster = _cluster_info(args, native)
    leadership = _leadership(args, kube, owner, planning_inputs(defaults, cluster))
    run = RunSettings(
        defaults=defaults, cluster=cluster, namespaces=namespaces, node_mode=args.node_mode == "true",
        kubeconfig=kubeconfig, metrics_port=int(args.metrics_port), health_port=int(args.health_port),
        all_events=args.events == c.EVENTS_ALL, workers=int(args.workers), resync_seconds=float(args.resync_seconds),
        leader_election=args.leader_election, webhook=_webhook(args) if admission else None,
    )  # fmt: skip
    try:
        return run_operator(kube, run, leadership, owner)
    except WebhookRegistrationMissing as exc:
        raise SystemExit(f"{PROG}: {exc}") from None


def _native_sidecars(flag: str, kube: Kube) -> bool:
    """``--native-sidecars``: auto asks the apiserver's version (native sidecars from 1.29)."""
    if flag == "auto":
        return kube.server_version() >= NATIVE_SIDECAR_MIN
    if flag in ("true", "false"):
        return flag == "true"
    raise SystemExit(f"{PROG}: --native-sidecars {flag!r}: allowed auto, true, false")


def _owner(args: argparse.Namespace, kube: Kube) -> OperatorDeployment | None:
    """``--operator-deployment`` read once (None when unset)."""
    if not args.operator_deployment:
        return None
    if not args.leader_election_namespace:
        raise SystemExit(f"{PROG}: --operator-deployment needs --leader-election-namespace (or POD_NAMESPACE): "
                         "the namespace the Deployment is in")  # fmt: skip
    return read_operator_deployment(kube, args.leader_election_namespace, args.operator_deployment)


def _uninstall_lease(args: argparse.Namespace, kube: Kube, owner: OperatorDeployment | None) -> Leadership | None:
    """``--remove-all`` with leader election: the operator's Lease, for the hook to seize (None: leader
    election is off)."""
    if args.leader_election == "false":
        return None
    if args.leader_election != "true" or not args.leader_election_namespace:
        raise SystemExit(f"{PROG}: --remove-all with --leader-election true needs --leader-election-namespace "
                         "(the operator's namespace, where its Lease is)")  # fmt: skip
    return uninstall_lease(kube, args.leader_election_namespace, owner)


def _check_listener_ports(args: argparse.Namespace) -> None:
    """Each of the operator's listeners on a port of its own: the second on a shared port would
    stop the operator with 'Address already in use' after it started."""
    ports = {"--metrics-port": int(args.metrics_port), "--health-port": int(args.health_port)}
    if args.injection == "admission":
        ports["--webhook-port"] = int(args.webhook_port)
    seen: dict[int, str] = {}
    for flag, port in ports.items():
        if port in seen:
            raise SystemExit(f"{PROG}: {seen[port]} and {flag} are both {port}: each needs a port of its own")
        seen[port] = flag


def _injection_mode(args: argparse.Namespace) -> str:
    """``--injection`` checked with what admission mode needs: where the apiserver reaches the webhook
    and a namespace for its certificate's Secret."""
    if args.injection not in c.INJECTION_MODES:
        raise SystemExit(f"{PROG}: --injection {args.injection!r}: allowed " + ", ".join(c.INJECTION_MODES))
    if args.injection == "admission" and not args.remove_all:
        if bool(args.webhook_service) == bool(args.webhook_url):
            raise SystemExit(f"{PROG}: --injection admission needs exactly one of --webhook-service and --webhook-url")
        url = urlparse(args.webhook_url)
        if args.webhook_url and (url.scheme != "https" or not url.hostname):
            raise SystemExit(f"{PROG}: --webhook-url {args.webhook_url!r}: an https URL is required")
        if not args.leader_election_namespace:
            raise SystemExit(f"{PROG}: --injection admission needs --leader-election-namespace (or POD_NAMESPACE): "
                             "the webhook's certificate is kept in a Secret there")  # fmt: skip
    return str(args.injection)


def _cluster_info(args: argparse.Namespace, native: bool) -> ClusterInfo:
    """What the cluster and the injection mode decide; admission mode leaves out the namespaces its
    webhook registration excludes (the chart's: kube-system and the release's own)."""
    excluded = (
        ReviewScope.of_registration(args.leader_election_namespace).excluded
        if args.injection == "admission"
        else frozenset()
    )
    return ClusterInfo(native_sidecars=native, injection=args.injection, webhook_excluded_namespaces=excluded)


def _webhook(args: argparse.Namespace) -> WebhookSettings:
    """Admission mode's webhook from the flags ``_injection_mode`` checked: the names its certificate
    is for, and the client CA it checks callers against."""
    if args.webhook_url:
        hosts: tuple[str, ...] = (str(urlparse(args.webhook_url).hostname),)
    else:
        service, namespace = args.webhook_service, args.leader_election_namespace
        hosts = (f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local")
    return WebhookSettings(namespace=args.leader_election_namespace, hosts=hosts, port=int(args.webhook_port),
                           read_client_ca=lambda: _client_ca(args.webhook_client_ca),
                           advertise_host=args.webhook_advertise_host)  # fmt: skip


def _advertised_host(value: str) -> str:
    """``--webhook-advertise-host`` as an IP address ("" when unset), checked before any request."""
    try:
        return str(ipaddress.ip_address(value)) if value else ""
    except ValueError:
        raise SystemExit(f"{PROG}: --webhook-advertise-host (or POD_IP) {value[:60]!r} is not an IP address") from None


def _client_ca(path: str) -> bytes | None:
    """``--webhook-client-ca``'s PEM, checked to load as CA certificates; None when unset."""
    if not path:
        return None
    try:
        pem = Path(path).read_bytes()
        ssl.create_default_context(cadata=pem.decode())
    except (OSError, ValueError, ssl.SSLError) as exc:
        raise SystemExit(f"{PROG}: --webhook-client-ca {path!r}: not a readable PEM CA certificate: {exc}") from None
    return pem


def _leadership(args: argparse.Namespace, kube: Kube, owner: OperatorDeployment | None,
                planning: str) -> Leadership | None:  # fmt: skip
    """The operator's claim on its Lease, not yet taken, to publish ``planning`` in (None: leader
    election is off)."""
    if args.leader_election not in ("true", "false"):
        raise SystemExit(f"{PROG}: --leader-election {args.leader_election!r}: allowed true, false")
    if args.leader_election == "false":
        return None
    if not args.leader_election_namespace:
        raise SystemExit(f"{PROG}: --leader-election needs --leader-election-namespace (or POD_NAMESPACE), "
                         "or --leader-election false")  # fmt: skip
    identity = os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"
    return Leadership(kube, args.leader_election_namespace, c.OPERATOR_LEASE_NAME, identity, owner, planning)
