"""The Helm chart: lint, schema, rendering choices, and install/uninstall on the real apiserver."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.localcluster import LocalCluster
from hack.ports import free_port
from hack.workloads import apply, get, list_objects, trtllm_deployment, wait_for
from kvoffload import contract
from kvoffload.operator.admission.webhook_tls import webhook_configuration
from tests.support.audit import AuditWindow
from tests.support.operator_support import (
    OperatorProcess,
    admission_args,
    child_pythonpath,
    events_for,
    is_injected,
    wait_injected,
)
from tests.support.promtool import run_token_source_tests

pytestmark = [pytest.mark.chart]

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "kvoffload"
RULES_FILE = CHART / "files" / "operator-clusterrole-rules.yaml"
NODE_MODE_RULES_FILE = CHART / "files" / "operator-node-mode-rules.yaml"
ADMISSION_RULES_FILE = CHART / "files" / "operator-admission-rules.yaml"
TEMPLATE_RULES_FILE = CHART / "files" / "operator-template-rules.yaml"


def helm(*args: str, kubeconfig: Path | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    argv = ["helm", *args]
    if kubeconfig:
        argv += ["--kubeconfig", str(kubeconfig)]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} failed:\n{result.stderr}")
    return result


RELEASE_NAMESPACE = "kvoffload-system"
RBAC_REFUSAL = 'forbidden: User "system:serviceaccount:'
"""How the apiserver words a 403 that RBAC gave the operator's ServiceAccount."""


def render(*set_args: str) -> list[dict[str, Any]]:
    args = ["template", "kvo", str(CHART), "--namespace", RELEASE_NAMESPACE]
    for s in set_args:
        args += ["--set", s] if not s.startswith("--") else [s]
    docs = yaml.safe_load_all(helm(*args).stdout)
    return [d for d in docs if d]


def kinds(docs: list[dict[str, Any]]) -> set[str]:
    return {d["kind"] for d in docs}


def test_helm_lint_is_clean_in_strict_mode() -> None:
    result = helm("lint", "--strict", str(CHART))
    assert "0 chart(s) failed" in result.stdout


@pytest.mark.parametrize(
    ("setting", "complaint"),
    [
        ("defaults.cache.l1Size=lots", "/defaults/cache/l1Size"),
        ("defaults.mode=everywhere", "/defaults/mode"),
        ("defaults.cache.evictionPolicy=FIFO", "/defaults/cache/evictionPolicy"),
        ("defaults.cache.chunkSize=100", "/defaults/cache/chunkSize"),
        ("operator.replicaCount=-1", "/operator/replicaCount"),
        ("operator.logLevel=loud", "/operator/logLevel"),
        ("operator.events=normal", "/operator/events"),
        ("defaults.connector.lookupTimeoutMs=0", "/defaults/connector/lookupTimeoutMs"),
        ("operator.watchNamespaces[0]=Bad_Name", "/operator/watchNamespaces/0"),
        ("unknownTopLevel=1", "unknownTopLevel"),
        ("nodeMode.enabled=yes", "/nodeMode/enabled"),
        ("defaults.mode=node", "nodeMode.enabled is false"),
        ("operator.healthPort=8080", "must differ: [8080 8080 8443]"),
        ("injection.webhookPort=8081", "must differ: [8080 8081 8081]"),
        ("injection.networkPolicy.podCIDRs[0]=everything", "/injection/networkPolicy/podCIDRs/0"),
        ("defaults.kvEvents.enabled=yes", "/defaults/kvEvents/enabled"),
        ("defaults.kvEvents.topic=kv@ pod", "/defaults/kvEvents/topic"),
    ],
)
def test_values_schema_rejects_bad_values(setting: str, complaint: str) -> None:
    result = helm("template", "kvo", str(CHART), "--set", setting, check=False)
    assert result.returncode != 0
    assert complaint in result.stderr


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a mapping with a key twice (strict parsers and kubeconform -strict do)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(k, deep=deep) for k, _v in node.value]
        repeated = sorted({k for k in keys if keys.count(k) > 1}, key=str)
        if repeated:
            raise yaml.constructor.ConstructorError(None, None, f"repeated keys {repeated}", node.start_mark)
        return super().construct_mapping(node, deep=deep)


@pytest.mark.parametrize(
    "values",
    [(), ("injection.mode=template",), ("nodeMode.enabled=true",),
     ("metrics.serviceMonitor.enabled=true", "metrics.podMonitor.enabled=true", "metrics.prometheusRule.enabled=true",
      "--api-versions=monitoring.coreos.com/v1")],
)  # fmt: skip
def test_no_rendered_object_repeats_a_key(values: tuple[str, ...]) -> None:
    args = ["template", "kvo", str(CHART), "--namespace", RELEASE_NAMESPACE]
    for s in values:
        args += ["--set", s] if not s.startswith("--") else [s]
    docs = [d for d in yaml.load_all(helm(*args).stdout, Loader=_UniqueKeyLoader) if d]
    assert docs


def test_default_render_has_operator_rbac_and_no_prometheus_operator_objects() -> None:
    docs = render()
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Deployment", "Service", "ConfigMap"} <= kinds(docs)
    assert not kinds(docs) & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}


def test_prometheus_operator_objects_need_both_enabled_and_the_crds() -> None:
    enabled = [
        "metrics.serviceMonitor.enabled=true",
        "metrics.podMonitor.enabled=true",
        "metrics.prometheusRule.enabled=true",
    ]
    assert not kinds(render(*enabled)) & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    with_crds = render(*enabled, "--api-versions=monitoring.coreos.com/v1")
    assert {"ServiceMonitor", "PodMonitor", "PrometheusRule"} <= kinds(with_crds)


def test_pod_monitors_scrape_the_sidecar_or_the_connector_and_node_caches_in_node_mode() -> None:
    enabled = ["metrics.podMonitor.enabled=true", "--api-versions=monitoring.coreos.com/v1"]
    (workloads,) = [d for d in render(*enabled) if d["kind"] == "PodMonitor"]
    ports = [e["port"] for e in workloads["spec"]["podMetricsEndpoints"]]
    assert ports == [contract.SIDECAR_PORT_NAME, contract.ENGINE_METRICS_PORT_NAME]
    assert workloads["spec"]["selector"]["matchLabels"] == {contract.LABEL_INJECTED: "true"}
    monitors = [d for d in render(*enabled, "nodeMode.enabled=true") if d["kind"] == "PodMonitor"]
    caches = next(d for d in monitors if d["metadata"]["name"].endswith("-node-caches"))
    assert caches["spec"]["selector"]["matchLabels"] == {
        contract.LABEL_COMPONENT: contract.COMPONENT_NODE_CACHE,
        contract.LABEL_MANAGED_BY: contract.LABEL_MANAGED_BY_VALUE,
    }
    assert [e["port"] for e in caches["spec"]["podMetricsEndpoints"]] == [contract.SIDECAR_PORT_NAME]


def operator_args(docs: list[dict[str, Any]]) -> list[str]:
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]  # type: ignore[no-any-return]


def test_cluster_role_is_exactly_the_shared_rules_files_and_never_writes_pods() -> None:
    docs = render()
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert role["rules"] == yaml.safe_load(RULES_FILE.read_text()) + yaml.safe_load(ADMISSION_RULES_FILE.read_text())
    pod_rules = [r for r in role["rules"] if {"pods", "services"} & set(r["resources"])]
    assert pod_rules == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert "--node-mode=false" in operator_args(docs) and "--injection=admission" in operator_args(docs)
    template_mode = render("injection.mode=template")
    role = next(d for d in template_mode if d["kind"] == "ClusterRole")
    assert role["rules"] == yaml.safe_load(RULES_FILE.read_text()) + yaml.safe_load(TEMPLATE_RULES_FILE.read_text())
    assert not [d for d in template_mode if d["kind"] == "Service" and d["metadata"]["name"].endswith("-webhook")]
    assert "--injection=template" in operator_args(template_mode)


def test_admission_mode_passes_the_webhook_service_or_the_url_given() -> None:
    args = operator_args(render())
    assert "--webhook-service=kvo-kvoffload-operator-webhook" in args
    url = "https://127.0.0.1:9443/mutate-pods"
    docs = render(f"injection.webhookUrl={url}")
    assert f"--webhook-url={url}" in operator_args(docs)
    assert not any(a.startswith("--webhook-service") for a in operator_args(docs))
    assert not [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-webhook")]


def test_in_admission_mode_the_operator_is_ready_while_its_webhook_answers_on_the_webhook_port() -> None:
    def readiness(*set_args: str) -> dict[str, Any]:
        deployment = next(d for d in render(*set_args) if d["kind"] == "Deployment")
        return deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]

    assert readiness() == {"path": contract.PATH_READY, "port": "webhook", "scheme": "HTTPS"}
    assert readiness("injection.mode=template") == {"path": "/healthz", "port": "health"}


def _operator_network_policy(docs: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == "kvo-kvoffload-operator"),
                None)  # fmt: skip


def test_the_webhook_port_takes_only_the_allowed_peers_and_the_operators_other_ports_stay_open() -> None:
    docs = render()
    netpol = _operator_network_policy(docs)
    assert netpol is not None, "on by default in admission mode"
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert netpol["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert netpol["spec"]["policyTypes"] == ["Ingress"]
    webhook, others = netpol["spec"]["ingress"]
    assert webhook["ports"] == [{"port": 8443, "protocol": "TCP"}]
    operators = {"podSelector": {"matchLabels": netpol["spec"]["podSelector"]["matchLabels"]}}
    assert webhook["from"] == [{"ipBlock": {"cidr": "0.0.0.0/0"}}, {"ipBlock": {"cidr": "::/0"}}, operators]
    assert others == {"ports": [{"port": 8080, "protocol": "TCP"}, {"port": 8081, "protocol": "TCP"}]}
    declared = {p["containerPort"] for c in deployment["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
    assert declared == {8443, 8080, 8081}, "every port the operator listens on is named by the policy"

    pods_out = _operator_network_policy(render("injection.networkPolicy.podCIDRs={10.244.0.0/16,fd00:10:244::/56}"))
    assert pods_out is not None
    assert pods_out["spec"]["ingress"][0]["from"] == [
        {"ipBlock": {"cidr": "0.0.0.0/0", "except": ["10.244.0.0/16"]}},
        {"ipBlock": {"cidr": "::/0", "except": ["fd00:10:244::/56"]}},
        operators,  # the replicas reach each other: reviews forwarded to the Lease holder
    ]
    control_plane = _operator_network_policy(
        render("injection.networkPolicy.webhookFrom[0].ipBlock.cidr=172.16.0.0/28")
    )
    assert control_plane is not None
    assert control_plane["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "172.16.0.0/28"}}, operators]
    assert _operator_network_policy(render("injection.networkPolicy.enabled=false")) is None
    assert _operator_network_policy(render("injection.mode=template")) is None


def test_the_operator_posts_warning_events_only_unless_all_are_asked_for() -> None:
    assert "--events=warnings" in operator_args(render())
    assert "--events=all" in operator_args(render("operator.events=all"))


def test_kv_events_are_off_in_the_default_values_and_the_switch_reaches_the_operators_defaults() -> None:
    from kvoffload.operator.intent.settings import OperatorDefaults, resolve_settings

    def default_spec(*set_args: str) -> dict[str, Any]:
        cm = next(
            d for d in render(*set_args) if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-defaults")
        )
        return json.loads(cm["data"]["defaults.json"])  # type: ignore[no-any-return]

    for set_args, enabled in (((), False), (("defaults.kvEvents.enabled=true",), True)):
        spec = default_spec(*set_args)
        settings = resolve_settings({contract.ANN_ENABLED: "true"}, None, OperatorDefaults(spec=spec), "ns")
        assert getattr(settings, "kv_events", None) is enabled, (set_args, settings)


def test_node_mode_adds_exactly_its_rules_file_and_turns_the_operator_flag_on() -> None:
    docs = render("nodeMode.enabled=true", "defaults.mode=node", "injection.mode=template")
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    assert role["rules"] == (yaml.safe_load(RULES_FILE.read_text()) + yaml.safe_load(NODE_MODE_RULES_FILE.read_text())
                             + yaml.safe_load(TEMPLATE_RULES_FILE.read_text()))  # fmt: skip
    assert "--node-mode=true" in operator_args(docs)


def test_operator_pod_is_hardened() -> None:
    deployment = next(d for d in render() if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["resources"]["limits"]["memory"]
    assert container["livenessProbe"] and container["readinessProbe"]
    assert "topologySpreadConstraints" not in pod
    spread = next(d for d in render("operator.replicaCount=2") if d["kind"] == "Deployment")
    assert spread["spec"]["template"]["spec"]["topologySpreadConstraints"]


def test_alert_rules_pass_promtool(tmp_path: Path) -> None:
    docs = render("metrics.prometheusRule.enabled=true", "--api-versions=monitoring.coreos.com/v1")
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r}
    assert {
        "KvoffloadSidecarDown",
        "KvoffloadLookupHitRateCollapsed",
        "KvoffloadTransferErrors",
        "KvoffloadOperatorReconcileErrors",
        "KvoffloadPromptReuseCollapsed",
    } <= alerts
    rules_file = tmp_path / "rules.yaml"
    rules_file.write_text(yaml.safe_dump(rule["spec"]))
    result = subprocess.run(["promtool", "check", "rules", str(rules_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_token_source_rules_split_the_prompt_tokens_and_alert_on_a_collapse(tmp_path: Path) -> None:
    docs = render("metrics.prometheusRule.enabled=true", "--api-versions=monitoring.coreos.com/v1")
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    split = {("device", "none"): 1024.0, ("cache", "none"): 2048.0, ("computed", "partial_chunk"): 96.0,
             ("computed", "not_cached"): 512.0, ("computed", "final_block"): 32.0}  # fmt: skip
    result = run_token_source_tests(rule["spec"], split, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dashboard_is_valid_json_with_the_promised_panels() -> None:
    configmap = next(d for d in render() if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-dashboard"))
    dashboard = json.loads(configmap["data"]["kvoffload.json"])
    titles = {p["title"] for p in dashboard["panels"]}
    assert {"Lookup hit rate (tokens)", "Retrieve / store throughput", "L1 cache usage",
            "Where prompt tokens came from"} <= titles  # fmt: skip
    # every recording rule a panel reads is one the chart's PrometheusRule defines
    docs = render("metrics.prometheusRule.enabled=true", "--api-versions=monitoring.coreos.com/v1")
    rule = next(d for d in docs if d["kind"] == "PrometheusRule")
    recorded = {r["record"] for g in rule["spec"]["groups"] for r in g["rules"] if "record" in r}
    used = {
        m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"kvoffload:[a-z0-9_:]+", t["expr"])
    }
    assert used and used <= recorded, used - recorded
    assert any("restarts" in t.lower() for t in titles)


@pytest.mark.controlplane
def test_install_upgrade_uninstall_on_the_real_apiserver(cluster: LocalCluster) -> None:
    kubeconfig = cluster.admin_kubeconfig
    ns = "kvoffload-system"
    cluster.kubectl("create", "namespace", ns, check=False)
    cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted", "--overwrite")
    install = helm("install", "kvo", str(CHART), "-n", ns, "--wait=false", kubeconfig=kubeconfig)
    assert "kubectl annotate deployment" in install.stdout  # NOTES tells the user what to do next

    crd = json.loads(cluster.kubectl("get", "crd", "kvcachepolicies.kvoffload.io", "-o", "json").stdout)
    assert crd["spec"]["names"]["kind"] == "KVCachePolicy"
    role = json.loads(cluster.kubectl("get", "clusterrole", "kvo-kvoffload-operator", "-o", "json").stdout)
    assert role["rules"] == yaml.safe_load(RULES_FILE.read_text()) + yaml.safe_load(ADMISSION_RULES_FILE.read_text())

    # The operator's pods pass PodSecurity "restricted": the ReplicaSet creates them.
    def operator_pods() -> list[dict[str, Any]]:
        out = cluster.kubectl("get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=operator", "-o", "json")
        return json.loads(out.stdout)["items"]  # type: ignore[no-any-return]

    wait_for(operator_pods, timeout=60, what="operator pods admitted under PodSecurity restricted")

    helm("upgrade", "kvo", str(CHART), "-n", ns, "--set", "defaults.cache.l1Size=40Gi", kubeconfig=kubeconfig)
    defaults = json.loads(cluster.kubectl("get", "configmap", "kvo-kvoffload-defaults", "-n", ns, "-o", "json").stdout)
    assert json.loads(defaults["data"]["defaults.json"])["cache"]["l1Size"] == "40Gi"

    helm("uninstall", "kvo", "-n", ns, "--wait", kubeconfig=kubeconfig)
    leftovers = cluster.kubectl(
        "get", "deployment,service,configmap,serviceaccount,clusterrole,clusterrolebinding", "-A",
        "-l", "app.kubernetes.io/instance=kvo", "-o", "name",
    ).stdout.strip()  # fmt: skip
    assert leftovers == ""
    # Helm never deletes CRDs from crds/ (policies users created stay); docs/operator.md says so.
    assert cluster.kubectl("get", "crd", "kvcachepolicies.kvoffload.io", check=False).returncode == 0


def test_watch_namespaces_bind_the_rules_in_those_namespaces_only() -> None:
    docs = render("operator.watchNamespaces[0]=team-a", "operator.watchNamespaces[1]=team-b")
    cluster_scoped = ("-webhook", "-nodes")
    bindings = [
        d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding") and d["roleRef"]["kind"] != "Role"
        and not d["metadata"]["name"].endswith(cluster_scoped)
    ]  # fmt: skip
    # The webhook's registration and the nodes are cluster-scoped: each its own ClusterRole, bound
    # cluster-wide (a RoleBinding cannot grant them), and nothing else is.
    cluster_bindings = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    cluster_roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    granted = {(r["resources"][0], tuple(r["verbs"])) for d in cluster_bindings
               for r in cluster_roles[d["roleRef"]["name"]]["rules"]}  # fmt: skip
    assert granted == {("mutatingwebhookconfigurations", ("get", "patch", "delete")), ("nodes", ("list",))}
    assert sorted((d["kind"], d["metadata"]["namespace"]) for d in bindings) == [
        ("RoleBinding", "team-a"), ("RoleBinding", "team-b")
    ]  # fmt: skip
    assert all(d["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                "name": "kvo-kvoffload-operator"} for d in bindings)  # fmt: skip
    assert {"--namespace=team-a", "--namespace=team-b"} <= set(operator_args(docs))


def test_the_lease_and_the_webhook_secret_are_granted_in_the_release_namespace_only() -> None:
    docs = render()
    role = next(d for d in docs if d["kind"] == "Role")
    binding = next(d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["kind"] == "Role")
    lease = [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]},
             {"apiGroups": ["apps"], "resources": ["deployments"], "resourceNames": ["kvo-kvoffload-operator"],
              "verbs": ["get"]}]  # its own Deployment: the owner of the Lease and the Secrets  # fmt: skip
    assert role["rules"] == [
        *lease,
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"],
         "resourceNames": [contract.WEBHOOK_TLS_SECRET, contract.WEBHOOK_CA_SECRET], "verbs": ["get", "update"]},
    ]  # fmt: skip
    template_mode = next(d for d in render("injection.mode=template") if d["kind"] == "Role")
    assert template_mode["rules"] == lease
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == RELEASE_NAMESPACE
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert {"--leader-election=true", f"--leader-election-namespace={RELEASE_NAMESPACE}",
            "--operator-deployment=kvo-kvoffload-operator"} <= set(operator_args(docs))  # fmt: skip


@pytest.mark.controlplane
def test_a_namespace_scoped_install_works_with_only_its_rolebindings(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    """watchNamespaces: the operator's ServiceAccount can act in the watched namespace only, and
    the template-mode operator injects there with exactly those rights; it can still list nodes
    (a ClusterRoleBinding of its own), so an L1 no GPU node can hold is refused there too."""
    release_ns = "kvo-scoped-system"
    other = f"{namespace}-unwatched"
    for ns in (release_ns, other):
        cluster.kubectl("create", "namespace", ns, check=False)
    helm("install", "kvo-scoped", str(CHART), "-n", release_ns, "--wait=false", "--set", "injection.mode=template",
         "--set", f"operator.watchNamespaces[0]={namespace}", kubeconfig=cluster.admin_kubeconfig)  # fmt: skip
    try:
        sa = "kvo-scoped-kvoffload"
        user = f"system:serviceaccount:{release_ns}:{sa}"

        def can(*args: str) -> bool:
            out = cluster.kubectl("auth", "can-i", *args, f"--as={user}", check=False).stdout.strip()
            return out == "yes"

        assert can("patch", "deployments", "-n", namespace) and can("create", "configmaps", "-n", namespace)
        assert not can("patch", "deployments", "-n", other) and not can("get", "configmaps", "-n", other)
        assert not can("list", "deployments", "--all-namespaces")
        assert can("list", "nodes") and not can("get", "nodes") and not can("patch", "nodes")

        operator.stop()  # one operator at a time; the next test restarts the session one
        kubeconfig = cluster.service_account_kubeconfig(release_ns, sa, tmp_path / "scoped.kubeconfig")
        scoped = OperatorProcess(
            kubeconfig=kubeconfig, workdir=tmp_path, extra_args=["--namespace", namespace], lease_namespace=release_ns
        )  # the chart's Role grants the Lease there
        scoped.start()
        try:
            for ns in (namespace, other):
                apply(cluster, trtllm_deployment("llm", ns, replicas=0, annotations={contract.ANN_ENABLED: "true"}))
            apply(cluster, {"apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}", "kind": contract.POLICY_KIND,
                            "metadata": {"name": "huge", "namespace": namespace},
                            "spec": {"cache": {"l1Size": "600Gi"}}})  # fmt: skip
            apply(cluster, trtllm_deployment("huge", namespace, replicas=0,
                                             annotations={contract.ANN_ENABLED: "true", contract.ANN_POLICY: "huge"}))  # fmt: skip
            wait_injected(cluster, "deployment", "llm", namespace)
            refused = wait_for(lambda: events_for(cluster, namespace, "huge", "KvoffloadInvalid"), 30,
                               what="the fit check's KvoffloadInvalid Warning")  # fmt: skip
            assert "largest GPU node allocates 512Gi" in refused[0]["message"], refused[0]["message"]
            assert not is_injected(get(cluster, "deployment", "huge", namespace))
            time.sleep(3)
            assert not is_injected(get(cluster, "deployment", "llm", other)), "an unwatched namespace is left alone"
            assert " 403 " not in scoped.log() and "Forbidden" not in scoped.log(), scoped.log()[-3000:]
        finally:
            scoped.stop()
    finally:
        helm("uninstall", "kvo-scoped", "-n", release_ns, "--wait", kubeconfig=cluster.admin_kubeconfig)
        cluster.kubectl("delete", "namespace", other, release_ns, "--wait=false", check=False)


def user_pods(cluster: LocalCluster, name: str, namespace: str) -> list[dict[str, Any]]:
    return [p for p in list_objects(cluster, "pods", namespace, f"app={name}")
            if not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def all_running(cluster: LocalCluster, name: str, namespace: str, injected: bool) -> list[dict[str, Any]] | None:
    """The workload's 2 pods once both run, all with or all without the injection."""
    found = [p for p in user_pods(cluster, name, namespace) if p.get("status", {}).get("phase") == "Running"
             and (p["metadata"].get("labels", {}).get(contract.LABEL_INJECTED) == "true") == injected]  # fmt: skip
    return found if len(found) == 2 == len(user_pods(cluster, name, namespace)) else None


@pytest.mark.controlplane
def test_helm_uninstall_in_helms_order_leaves_every_workload_as_the_user_wrote_it(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    """Helm's real order: the pre-delete hook (run as its Job spec says, with the release's own
    ServiceAccount; pods never run here, so the test starts the hook container's command itself)
    while the admission-mode operator still runs, then the release's objects deleted. No workload
    is re-injected; every template is the user's again, byte for byte; new pods are plain; nothing
    the operator made for itself (its Lease, the webhook's CA and serving Secrets) stays."""
    release_ns = "kvo-uninstall-system"
    names = ["llm-a", "llm-b"]
    cluster.kubectl("create", "namespace", release_ns, check=False)
    port = free_port()  # the chart's registration points at the operator the test runs on 127.0.0.1
    helm("install", "kvo-un", str(CHART), "-n", release_ns, "--wait=false",
         "--set", f"injection.webhookUrl=https://127.0.0.1:{port}{contract.WEBHOOK_PATH}",
         kubeconfig=cluster.admin_kubeconfig)  # fmt: skip
    released = None
    try:
        kubeconfig = cluster.service_account_kubeconfig(release_ns, "kvo-un-kvoffload", tmp_path / "sa.kubeconfig")
        operator.stop()  # one operator at a time; the next test restarts the session one
        released = OperatorProcess(kubeconfig=kubeconfig, workdir=tmp_path, lease_namespace=release_ns,
                                   extra_args=admission_args(port) + chart_operator_args(cluster, release_ns))  # fmt: skip
        originals = {}
        for name in names:
            apply(cluster, trtllm_deployment(name, namespace, replicas=2))
            originals[name] = get(cluster, "deployment", name, namespace)["spec"]["template"]
        released.start()
        for name in names:
            cluster.kubectl("annotate", "deployment", name, "-n", namespace, f"{contract.ANN_ENABLED}=true")
        for name in names:
            wait_for(lambda n=name: all_running(cluster, n, namespace, injected=True), 120, what=f"{name} injected")
        hooks = [d for d in yaml.safe_load_all(helm("get", "hooks", "kvo-un", "-n", release_ns,
                                                    kubeconfig=cluster.admin_kubeconfig).stdout) if d]  # fmt: skip
        job = next(d for d in hooks if d["kind"] == "Job")
        assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
        pod = job["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == "kvo-un-kvoffload"
        assert released.popen is not None and released.popen.poll() is None, "the operator runs during the hook"
        run = subprocess.run([sys.executable, "-m", "kvoffload.operator", "--kubeconfig", str(kubeconfig),
                              *pod["containers"][0]["args"]], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "PYTHONPATH": child_pythonpath()})  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        for name in names:
            assert f"Deployment/{namespace}/{name}: removed" in run.stdout, run.stdout
        # Admission mode under the chart's own RBAC (no ConfigMap writes): RBAC refused nothing it tried
        # (other 403s, e.g. an Event into another test's terminating namespace, are not RBAC's).
        assert RBAC_REFUSAL not in released.log_path.read_text(errors="replace"), released.log()
        revisions = {n: get(cluster, "deployment", n, namespace)["metadata"]["annotations"][REVISION] for n in names}
        assert leftovers_of_the_operator(cluster, release_ns) == OPERATOR_OBJECTS, "the operator made its three"
        audit = AuditWindow(cluster.audit_log).mark()
        helm("uninstall", "kvo-un", "-n", release_ns, "--wait", kubeconfig=cluster.admin_kubeconfig)
        time.sleep(8)  # more than a lease renewal and a background tick: a running operator would have acted
        for name in names:
            after = get_live(cluster, name, namespace)
            assert after["spec"]["template"] == originals[name], f"{name}: not back on the user's own template"
            assert contract.ANN_INJECTION_RECORD not in after["metadata"].get("annotations", {})
            assert contract.FIELD_MANAGER not in {m.get("manager") for m in after["metadata"]["managedFields"]}
            assert after["metadata"]["annotations"][REVISION] == revisions[name], f"{name} was rolled again"
            wait_for(lambda n=name: all_running(cluster, n, namespace, injected=False), 120, what=f"{name} plain")
            victim = user_pods(cluster, name, namespace)[0]["metadata"]["name"]
            cluster.kubectl("delete", "pod", victim, "-n", namespace, "--wait=false")
        for name in names:  # a pod created after the uninstall is the user's own
            for pod_ in wait_for(lambda n=name: all_running(cluster, n, namespace, injected=False), 120,
                                 what=f"{name}'s replacement pod"):  # fmt: skip
                assert not any(k.startswith(contract.ANNOTATION_PREFIX) for k in pod_["metadata"].get("labels", {}))
                assert [x["name"] for x in pod_["spec"]["containers"]] == ["trtllm"]
                assert not pod_["spec"].get("initContainers")
        assert cluster.kubectl("get", "mutatingwebhookconfiguration", contract.WEBHOOK_CONFIGURATION_NAME,
                               check=False).returncode != 0, "the webhook's registration is deleted"  # fmt: skip
        # Nothing of kvoffload's stays: the Lease (held by the hook until Helm deleted the operator)
        # and the webhook's two Secrets are owned by the operator's Deployment, and the garbage
        # collector deletes them with it (before: all three stayed, the CA's key among them).
        wait_for(lambda: not leftovers_of_the_operator(cluster, release_ns), 60,
                 what="the Lease and the webhook's Secrets deleted with the operator's Deployment")  # fmt: skip
        collected = {(w.resource, w.name) for w in audit.writes(GARBAGE_COLLECTOR, release_ns)
                     if w.verb == "delete" and w.code == 200}  # fmt: skip
        assert collected >= {("leases", contract.OPERATOR_LEASE_NAME), ("secrets", contract.WEBHOOK_TLS_SECRET),
                             ("secrets", contract.WEBHOOK_CA_SECRET)}, collected  # fmt: skip
    finally:
        if released is not None:
            released.stop()
        helm("uninstall", "kvo-un", "-n", release_ns, "--wait", kubeconfig=cluster.admin_kubeconfig, check=False)
        cluster.kubectl("delete", "mutatingwebhookconfiguration", contract.WEBHOOK_CONFIGURATION_NAME, check=False)
        cluster.kubectl("delete", "namespace", release_ns, "--wait=false", check=False)


REINSTALL_BOUND_S = 45
"""How long a reinstall's operator may take to act again (before: 91-111 s, the hook's 120 s hold)."""


@pytest.mark.controlplane
def test_a_reinstall_right_after_helm_uninstall_acts_at_once_instead_of_waiting_out_the_hooks_hold(
    cluster: LocalCluster, namespace: str, operator: OperatorProcess, tmp_path: Path
) -> None:
    """``helm uninstall`` (its hook holds the Lease so that the operator stops), then at once ``helm
    install`` again: the new operator takes the Lease (owned by the deleted Deployment, if the garbage
    collector has not deleted it yet) and injects the still opted-in workload again, within a bound far
    below the hook's 120 s hold; its first Lease write is in the audit log."""
    release_ns = "kvo-reinstall-system"
    name = "llm-again"
    cluster.kubectl("create", "namespace", release_ns, check=False)
    sa = "kvo-re-kvoffload"
    operator.stop()  # one operator at a time; the next test restarts the session one
    apply(cluster, trtllm_deployment(name, namespace, replicas=2))
    procs: list[OperatorProcess] = []

    def install_and_run(round_: str) -> OperatorProcess:
        port = free_port()
        helm("install", "kvo-re", str(CHART), "-n", release_ns, "--wait=false",
             "--set", f"injection.webhookUrl=https://127.0.0.1:{port}{contract.WEBHOOK_PATH}",
             kubeconfig=cluster.admin_kubeconfig)  # fmt: skip
        workdir = tmp_path / round_
        workdir.mkdir()
        kubeconfig = cluster.service_account_kubeconfig(release_ns, sa, workdir / "sa.kubeconfig")
        proc = OperatorProcess(kubeconfig=kubeconfig, workdir=workdir, lease_namespace=release_ns,
                               extra_args=admission_args(port) + chart_operator_args(cluster, release_ns))  # fmt: skip
        procs.append(proc)
        proc.start()
        return proc

    try:
        first = install_and_run("first")
        cluster.kubectl("annotate", "deployment", name, "-n", namespace, f"{contract.ANN_ENABLED}=true")
        wait_for(lambda: all_running(cluster, name, namespace, injected=True), 120, what=f"{name} injected")
        hooks = [d for d in yaml.safe_load_all(helm("get", "hooks", "kvo-re", "-n", release_ns,
                                                    kubeconfig=cluster.admin_kubeconfig).stdout) if d]  # fmt: skip
        job = next(d for d in hooks if d["kind"] == "Job")
        run = subprocess.run([sys.executable, "-m", "kvoffload.operator", "--kubeconfig", str(first.kubeconfig),
                              *job["spec"]["template"]["spec"]["containers"][0]["args"]], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "PYTHONPATH": child_pythonpath()})  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        helm("uninstall", "kvo-re", "-n", release_ns, "--wait", kubeconfig=cluster.admin_kubeconfig)
        first.stop()  # Helm deleted its pod
        wait_for(lambda: all_running(cluster, name, namespace, injected=False), 120, what=f"{name} plain")

        audit = AuditWindow(cluster.audit_log).mark()
        second = install_and_run("second")
        user = f"system:serviceaccount:{release_ns}:{sa}"
        wait_for(lambda: [w for w in audit.writes(user, release_ns) if w.resource == "leases" and w.code < 300],
                 REINSTALL_BOUND_S, what="the reinstalled operator's Lease write")  # fmt: skip
        lease = json.loads(cluster.kubectl("get", "lease", contract.OPERATOR_LEASE_NAME, "-n", release_ns,
                                           "-o", "json").stdout)  # fmt: skip
        assert lease["spec"]["holderIdentity"] == f"operator-{second.workdir.name}"
        (dep,) = list_objects(cluster, "deployment", release_ns, "app.kubernetes.io/component=operator")
        assert lease["metadata"]["ownerReferences"] == [
            {"apiVersion": "apps/v1", "kind": "Deployment", "name": dep["metadata"]["name"],
             "uid": dep["metadata"]["uid"]}
        ]  # fmt: skip
        wait_for(lambda: all_running(cluster, name, namespace, injected=True), REINSTALL_BOUND_S,
                 what=f"{name} injected again by the reinstalled operator")  # fmt: skip
    finally:
        for proc in procs:
            proc.stop()
        helm("uninstall", "kvo-re", "-n", release_ns, "--wait", kubeconfig=cluster.admin_kubeconfig, check=False)
        cluster.kubectl("delete", "mutatingwebhookconfiguration", contract.WEBHOOK_CONFIGURATION_NAME, check=False)
        cluster.kubectl("delete", "namespace", release_ns, "--wait=false", check=False)


REVISION = "deployment.kubernetes.io/revision"
GARBAGE_COLLECTOR = "system:serviceaccount:kube-system:generic-garbage-collector"
OPERATOR_OBJECTS = {("lease", contract.OPERATOR_LEASE_NAME), ("secret", contract.WEBHOOK_TLS_SECRET),
                    ("secret", contract.WEBHOOK_CA_SECRET)}  # fmt: skip
"""What the admission-mode operator makes for itself in the release namespace."""


def leftovers_of_the_operator(cluster: LocalCluster, release_ns: str) -> set[tuple[str, str]]:
    """Which of ``OPERATOR_OBJECTS`` are in the release namespace."""
    return {(kind, name) for kind, name in OPERATOR_OBJECTS
            if cluster.kubectl("get", kind, name, "-n", release_ns, check=False).returncode == 0}  # fmt: skip


def chart_operator_args(cluster: LocalCluster, release_ns: str) -> list[str]:
    """The flags the chart's operator Deployment passes that a test operator needs as they are (its own
    Deployment's name: the Lease and the webhook's Secrets name it as their owner)."""
    (dep,) = list_objects(cluster, "deployment", release_ns, "app.kubernetes.io/component=operator")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    return [a for a in args if a.startswith("--operator-deployment=")]


def get_live(cluster: LocalCluster, name: str, namespace: str) -> dict[str, Any]:
    """The Deployment with its managedFields."""
    out = cluster.kubectl("get", "deployment", name, "-n", namespace, "-o", "json", "--show-managed-fields")
    return json.loads(out.stdout)  # type: ignore[no-any-return]


@pytest.mark.parametrize(
    ("settings", "client"),
    [
        ((), {"service": {"namespace": RELEASE_NAMESPACE, "name": "kvo-kvoffload-operator-webhook", "port": 8443,
                          "path": contract.WEBHOOK_PATH}}),
        (("operator.watchNamespaces={team-b,team-a}",), {"service": {"namespace": RELEASE_NAMESPACE,
         "name": "kvo-kvoffload-operator-webhook", "port": 8443, "path": contract.WEBHOOK_PATH}}),
        (("injection.webhookUrl=https://hooks.example:9443/mutate-pods",),
         {"url": "https://hooks.example:9443/mutate-pods"}),
    ],
)  # fmt: skip
def test_the_chart_ships_the_webhook_registration_the_operator_only_patches(
    settings: tuple[str, ...], client: dict[str, Any]
) -> None:
    """The chart's MutatingWebhookConfiguration is the operator's own description of it, less the
    caBundle the operator patches in (it has no right to create one)."""
    docs = render(*settings)
    (mwc,) = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    namespaces = ["team-a", "team-b"] if settings and "watchNamespaces" in settings[0] else []
    expected = webhook_configuration(contract.WEBHOOK_CONFIGURATION_NAME, b"", client, namespaces, RELEASE_NAMESPACE)
    for hook in expected["webhooks"]:
        del hook["clientConfig"]["caBundle"]
    assert mwc["metadata"]["name"] == expected["metadata"]["name"]
    assert mwc["webhooks"] == expected["webhooks"]
    assert not [d for d in render("injection.mode=template") if d["kind"] == "MutatingWebhookConfiguration"]
