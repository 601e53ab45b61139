"""``kvoffload-operator``: run the kopf operator with metrics and a liveness endpoint.

Every flag has an environment variable (shown in ``--help``) so the Helm chart can pass
values either way.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

import kopf
import yaml

from kvoffload import contract as c
from kvoffload.operator import __version__
from kvoffload.operator.admission.acting_replica import plan_while_acting
from kvoffload.operator.admission.new_workloads import Planner, planner, planning_digest
from kvoffload.operator.admission.pod_alignment import PodAlignment
from kvoffload.operator.admission.webhook import WebhookServer
from kvoffload.operator.admission.webhook_tls import (
    ReviewScope,
    WebhookRegistrationMissing,
    delete_webhook_configuration,
    ensure_tls,
    patch_ca_bundle,
)
from kvoffload.operator.api.events import EventRecorder
from kvoffload.operator.api.kube import Kube, load_configuration
from kvoffload.operator.api.operator_deployment import OperatorDeployment, read_operator_deployment
from kvoffload.operator.control.leadership import RENEW_INTERVAL_S, Leadership, serve_health_while_waiting
from kvoffload.operator.control.reconcile import Reconciler
from kvoffload.operator.control.workload_writes import LEFT_ALONE, remove_every_injection
from kvoffload.operator.intent.settings import OperatorDefaults, base_settings
from kvoffload.operator.metrics import OperatorMetrics
from kvoffload.operator.node.caches import NodeCaches
from kvoffload.operator.plan.injection_plan import ClusterInfo
from kvoffload.policy_values import EVICTION_POLICIES, GPU_ACCESS_MODES, PolicyError
from kvoffload.quantity import QuantityError, parse_bytes

PROG = "kvoffload-operator"
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
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    defaults = defaults_from(args)
    if args.default_eviction_policy not in EVICTION_POLICIES or args.gpu_access not in GPU_ACCESS_MODES:
        raise SystemExit(f"{PROG}: --default-eviction-policy or --gpu-access has a value that is not allowed")
    if args.events not in c.EVENT_LEVELS:
        raise SystemExit(f"{PROG}: --events {args.events!r}: allowed " + ", ".join(c.EVENT_LEVELS))
    _check_listener_ports(args)
    kubeconfig = args.kubeconfig or None
    if kubeconfig:
        os.environ["KUBECONFIG"] = kubeconfig  # kopf's own login reads it too
    kube = Kube(load_configuration(kubeconfig))
    native = _native_sidecars(args.native_sidecars, kube)
    if args.node_mode not in ("true", "false"):
        raise SystemExit(f"{PROG}: --node-mode {args.node_mode!r}: allowed true, false")
    node_mode = args.node_mode == "true"
    namespaces = sorted({n.strip() for n in [*args.namespaces.split(","), *args.namespace] if n.strip()})
    admission = _injection_mode(args) == "admission"
    owner = _owner(args, kube)
    if args.remove_all:
        return _remove_all(kube, tuple(namespaces), admission, _uninstall_lease(args, kube, owner))
    metrics = OperatorMetrics()
    metrics.serve(int(args.metrics_port))
    events = EventRecorder(kube, normal=args.events == c.EVENTS_ALL)
    reconciler = Reconciler(
        kube=kube, defaults=defaults, cluster=_cluster_info(args, native),
        metrics=metrics, events=events, namespaces=tuple(namespaces),
        node_caches=NodeCaches(kube, defaults) if node_mode else None,
        pod_alignment=PodAlignment(kube, events, metrics, tuple(namespaces)) if admission else None,
    )  # fmt: skip
    memo = kopf.Memo(reconciler=reconciler, max_workers=int(args.workers), resync_seconds=float(args.resync_seconds))

    from kvoffload.operator.control import handlers  # registers the workload and policy handlers

    if node_mode:
        handlers.register_node_mode_handlers()  # pods are watched only when node mode may use them
    leadership = _leadership(args, kube, owner, planning_digest(defaults, reconciler.cluster))
    if admission:
        handlers.register_admission_handlers()
        plan = planner(kube, defaults, reconciler.cluster)
        if leadership is not None:  # a replica of another version or defaults answers no plan of its own
            plan = plan_while_acting(plan, leadership.may_plan)
        _serve_webhook(args, kube, metrics, tuple(namespaces), plan, owner)  # on every replica, the standby too

    @kopf.on.login()
    def login(**kwargs: object) -> kopf.ConnectionInfo | None:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            return kopf.login_with_service_account(**kwargs)  # type: ignore[arg-type]
        return kopf.login_with_kubeconfig(**kwargs)  # type: ignore[arg-type]

    logging.getLogger(__name__).info(
        "starting version=%s native_sidecars=%s namespaces=%s leader_election=%s node_mode=%s", __version__, native,
        namespaces or "all", args.leader_election, node_mode,
    )  # fmt: skip
    if leadership is not None and not _lead(leadership, args, threading.Event()):
        return 0  # asked to stop while waiting for the Lease
    try:
        kopf.run(
            standalone=True,  # one operator acts at a time through the Lease, not kopf peering
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=f"http://0.0.0.0:{int(args.health_port)}/healthz",
            memo=memo,
        )
    finally:
        if leadership is not None:
            leadership.release()
    return 1 if leadership is not None and leadership.lost else 0


def _native_sidecars(flag: str, kube: Kube) -> bool:
    """``--native-sidecars``: auto asks the apiserver's version (native sidecars from 1.29)."""
    if flag == "auto":
        return kube.server_version() >= NATIVE_SIDECAR_MIN
    if flag in ("true", "false"):
        return flag == "true"
    raise SystemExit(f"{PROG}: --native-sidecars {flag!r}: allowed auto, true, false")


UNINSTALL_IDENTITY = "kvoffload-uninstall"
UNINSTALL_HOLD_S = 120
"""How long the uninstall hook's hold on the Lease lasts after its last step: Helm deletes the
operator within it, so no operator pod (a restarted container, a standby) acts again before it goes."""
HANDOVER_WAIT_S = 2 * RENEW_INTERVAL_S
"""After taking the Lease from a running operator: it sees that at its next renewal and stops."""
REMOVAL_PASSES = 3


def _owner(args: argparse.Namespace, kube: Kube) -> OperatorDeployment | None:
    """``--operator-deployment`` read once (None when unset)."""
    if not args.operator_deployment:
        return None
    if not args.leader_election_namespace:
        raise SystemExit(f"{PROG}: --operator-deployment needs --leader-election-namespace (or POD_NAMESPACE): "
                         "the namespace the Deployment is in")  # fmt: skip
    return read_operator_deployment(kube, args.leader_election_namespace, args.operator_deployment)


def _uninstall_lease(args: argparse.Namespace, kube: Kube, owner: OperatorDeployment | None) -> Leadership | None:
    """``--remove-all`` with leader election: the operator's Lease, for the hook to seize (owned by the
    operator's Deployment, so it goes when Helm deletes that)."""
    if args.leader_election == "false":
        return None
    if args.leader_election != "true" or not args.leader_election_namespace:
        raise SystemExit(f"{PROG}: --remove-all with --leader-election true needs --leader-election-namespace "
                         "(the operator's namespace, where its Lease is)")  # fmt: skip
    return Leadership(kube, args.leader_election_namespace, c.OPERATOR_LEASE_NAME, UNINSTALL_IDENTITY, owner)


def _remove_all(kube: Kube, namespaces: tuple[str, ...], admission: bool, lease: Leadership | None) -> int:
    """``--remove-all``: one line per workload, exit 1 if any could not be returned to the user's pods;
    then the webhook's registration goes (no pod of the workloads asks for it any more).

    Helm runs this hook while the operator still runs, and a running operator re-injects every
    workload still opted in: with ``lease`` the hook first seizes the operator's Lease (the
    operator stops acting at its next renewal), and holds it until Helm has deleted the operator."""
    if lease is not None and lease.seize(UNINSTALL_HOLD_S):
        print(f"{PROG}: took Lease {lease.namespace}/{lease.name} from the acting operator; "
              f"waiting {HANDOVER_WAIT_S:.0f} s for it to stop", flush=True)  # fmt: skip
        time.sleep(HANDOVER_WAIT_S)
    results: dict[str, str] = {}
    for _pass in range(REMOVAL_PASSES):  # a write the stopping operator had in flight may land after a pass
        found = remove_every_injection(kube, namespaces, generated_configmaps=not admission)
        for ref, result in found:
            if result != "noop" or ref not in results:
                results[ref] = result
        if all(result == "noop" for _ref, result in found):
            break
    for ref, result in results.items():
        print(f"{PROG}: {ref}: {result}", flush=True)
    left = [ref for ref, result in results.items()
            if result not in ("removed", "noop") and not result.startswith(LEFT_ALONE)]  # fmt: skip
    alone = [ref for ref, result in results.items() if result.startswith(LEFT_ALONE)]
    print(f"{PROG}: removed kvoffload from {len(results) - len(left) - len(alone)} workload(s); {len(left)} left"
          + (f"; {len(alone)} left alone (holding what kvoffload did not write)" if alone else ""), flush=True)  # fmt: skip
    if not left and admission and delete_webhook_configuration(kube, c.WEBHOOK_CONFIGURATION_NAME):
        print(f"{PROG}: deleted MutatingWebhookConfiguration {c.WEBHOOK_CONFIGURATION_NAME}", flush=True)
    if lease is not None:
        lease.seize(UNINSTALL_HOLD_S)  # the hold runs from now: Helm deletes the operator next
    return 1 if left else 0


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


def _serve_webhook(args: argparse.Namespace, kube: Kube, metrics: OperatorMetrics, namespaces: tuple[str, ...],
                   plan: Planner, owner: OperatorDeployment | None) -> WebhookServer:  # fmt: skip
    """Start the webhook's HTTPS server, then put its CA into the chart's registration (the
    registration itself, rules and client config, is the chart's: ``webhook_configuration``)."""
    namespace = args.leader_election_namespace
    if args.webhook_url:
        hosts = [str(urlparse(args.webhook_url).hostname)]
    else:
        service = args.webhook_service
        hosts = [f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]
    tls = ensure_tls(kube, namespace, c.WEBHOOK_TLS_SECRET, hosts, owner=owner)
    scope = ReviewScope.of_registration(namespace, namespaces)
    server = WebhookServer(kube, metrics, tls, int(args.webhook_port), plan=plan, scope=scope,
                           client_ca_pem=_client_ca(args.webhook_client_ca))  # fmt: skip
    server.start()
    try:
        patch_ca_bundle(kube, c.WEBHOOK_CONFIGURATION_NAME, tls.ca_pem)
    except WebhookRegistrationMissing as exc:
        server.stop()
        raise SystemExit(f"{PROG}: {exc}") from None
    logging.getLogger(__name__).info("injection webhook serving on :%d for %s", server.port, ", ".join(hosts))
    return server


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


def _lead(leadership: Leadership, args: argparse.Namespace, stop: threading.Event) -> bool:
    """Hold the operator's Lease before acting (False: stopped while waiting).

    While it waits the process answers /healthz, so a standby pod stays live and ready.
    """
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with serve_health_while_waiting(int(args.health_port)):
        held = leadership.acquire(stop)
    signal.signal(signal.SIGTERM, previous)
    if not held:
        return False
    # Lost the Lease: stop as on SIGTERM (kopf's own graceful shutdown). A stop_flag would do the
    # same, but kopf waits on one with an executor thread that blocks its loop's shutdown.
    leadership.hold(on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))
    return True


if __name__ == "__main__":
    sys.exit(main())
