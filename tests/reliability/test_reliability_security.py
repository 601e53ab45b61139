"""Security on the real apiserver: least privilege (SubjectAccessReviews), Pod Security, namespace isolation.

The operator's ServiceAccount is bound to the chart's ``files/operator-clusterrole-rules.yaml``
(fixture ``operator_kubeconfig``), so the SubjectAccessReviews judge exactly what a Helm install grants.
Tenant isolation inside the cache (different ``cache_salt`` never hit each other's KV) is proven at
the connector level by tests/integration/connector/test_connector_sidecar.py::test_tenants_with_different_salts_never_share.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.localcluster import LocalCluster
from hack.workloads import apply, get, list_objects, trtllm_deployment, wait_for, wait_for_default_service_account
from kvoffload import contract as c
from tests.support.cluster_operator_fixtures import bind_rules
from tests.support.operator_support import (
    ADMISSION_NAMESPACE_RULES_FILE,
    ADMISSION_RULES_FILE,
    ADMISSION_WEBHOOK_RULES_FILE,
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    OperatorProcess,
    events_for,
    wait_injected,
)

pytestmark = [pytest.mark.reliability, pytest.mark.controlplane]
CHART = Path(__file__).resolve().parents[2] / "charts" / "kvoffload"
SA_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"
SA_GROUPS = ["system:serviceaccounts", f"system:serviceaccounts:{OPERATOR_NAMESPACE}", "system:authenticated"]

# (verb, group, resource, subresource, namespace or "" for cluster-wide, allowed?, why)
ACCESS: list[tuple[str, str, str, str, str, bool, str]] = [
    # What it needs.
    ("watch", "apps", "deployments", "", "", True, "watch opted-in workloads"),
    ("list", "apps", "statefulsets", "", "", True, "watch opted-in workloads"),
    ("patch", "apps", "deployments", "", "team-a", True, "Server-Side Apply of the fragment"),
    ("patch", "apps", "statefulsets", "", "team-a", True, "Server-Side Apply of the fragment"),
    ("create", "", "configmaps", "", "team-a", True, "generated <workload>-kvoffload ConfigMap"),
    ("patch", "", "configmaps", "", "team-a", True, "generated ConfigMap updates"),
    ("delete", "", "configmaps", "", "team-a", True, "removal deletes the generated ConfigMap"),
    ("get", "", "configmaps", "", "team-a", True, "reads the user's TensorRT-LLM options ConfigMap"),
    ("create", "", "events", "", "team-a", True, "Warning/Normal Events on workloads"),
    ("watch", "kvoffload.io", "kvcachepolicies", "", "", True, "policies"),
    ("patch", "kvoffload.io", "kvcachepolicies", "status", "team-a", True, "policy status"),
    # What it must not do.
    ("get", "", "secrets", "", "", False, "no Secrets cluster-wide"),
    ("list", "", "secrets", "", "team-a", False, "no Secrets in a namespace"),
    ("watch", "", "secrets", "", "", False, "no Secrets"),
    ("create", "", "pods", "exec", "team-a", False, "no exec into pods"),
    ("get", "", "pods", "exec", "team-a", False, "no exec into pods"),
    ("create", "", "pods", "attach", "team-a", False, "no attach"),
    ("create", "", "pods", "portforward", "team-a", False, "no port-forward"),
    ("get", "", "pods", "log", "team-a", False, "no pod logs (may hold prompts)"),
    ("create", "", "pods", "", "team-a", False, "no pods: node mode's rights come only with nodeMode.enabled"),
    ("list", "", "pods", "", "", False, "no pods: node mode's rights come only with nodeMode.enabled"),
    ("delete", "", "pods", "", "team-a", False, "no pods: node mode's rights come only with nodeMode.enabled"),
    ("patch", "", "pods", "", "team-a", False, "never changes running pods"),
    ("create", "", "services", "", "team-a", False, "node mode's Service only with nodeMode.enabled"),
    ("delete", "", "services", "", "team-a", False, "the policy's ownerReference removes it"),
    ("create", "networking.k8s.io", "networkpolicies", "", "team-a", False, "node mode's only with nodeMode.enabled"),
    ("create", "", "secrets", "", "team-a", False, "node mode's key Secrets only with nodeMode.enabled"),
    ("patch", "", "nodes", "", "", False, "no node writes"),
    ("update", "", "nodes", "status", "", False, "no node writes"),
    ("delete", "", "nodes", "", "", False, "no node writes"),
    ("create", "apps", "deployments", "", "team-a", False, "never creates workloads"),
    ("delete", "apps", "deployments", "", "team-a", False, "never deletes workloads"),
    ("update", "apps", "deployments", "", "team-a", False, "patch (SSA) only"),
    ("patch", "apps", "daemonsets", "", "team-a", False, "does not manage DaemonSets"),
    ("list", "", "configmaps", "", "", False, "no cluster-wide ConfigMap listing"),
    ("create", "kvoffload.io", "kvcachepolicies", "", "team-a", False, "policies belong to users"),
    ("patch", "kvoffload.io", "kvcachepolicies", "", "team-a", False, "only the status subresource"),
    ("escalate", "rbac.authorization.k8s.io", "clusterroles", "", "", False, "no RBAC"),
    ("bind", "rbac.authorization.k8s.io", "clusterrolebindings", "", "", False, "no RBAC"),
    ("create", "", "serviceaccounts", "token", "kube-system", False, "no token minting"),
    ("impersonate", "", "users", "", "", False, "no impersonation"),
    ("create", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "", False, "no webhooks"),
    ("patch", "apiextensions.k8s.io", "customresourcedefinitions", "", "", False, "CRDs come with the chart"),
    ("create", "certificates.k8s.io", "certificatesigningrequests", "", "", False, "no certificates"),
]


def _review(verb: str, group: str, resource: str, sub: str, namespace: str, name: str = "") -> dict[str, Any]:
    attrs = {"verb": verb, "group": group, "resource": resource}
    if sub:
        attrs["subresource"] = sub
    if namespace:
        attrs["namespace"] = namespace
    if name:
        attrs["name"] = name
    return {"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
            "spec": {"user": SA_USER, "groups": SA_GROUPS, "resourceAttributes": attrs}}  # fmt: skip


def _wrong_answers(cluster: LocalCluster, access: list[tuple[str, ...]], expected_allowed: list[bool],
                   whys: list[str]) -> list[str]:  # fmt: skip
    """SubjectAccessReviews for ``access`` (verb, group, resource, subresource, namespace[, name]):
    the ones whose answer differs from ``expected_allowed``."""
    reviews = [_review(*a) for a in access]
    out = cluster.kubectl("create", "-o", "json", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List",
                                                                                  "items": reviews}))  # fmt: skip
    items, text, decoder = [], out.stdout.strip(), json.JSONDecoder()
    while text:  # kubectl prints one JSON object per created review
        obj, end = decoder.raw_decode(text)
        items.append(obj)
        text = text[end:].strip()
    assert len(items) == len(access)
    wrong = []
    for attrs, expected, why, answer in zip(access, expected_allowed, whys, items, strict=True):
        verb, group, resource, sub, ns, *name = attrs
        allowed = bool(answer["status"].get("allowed"))
        target = (f"{verb} {group or 'core'}/{resource}{'/' + sub if sub else ''}{' ' + name[0] if name else ''} "
                  f"in {ns or 'all namespaces'}")  # fmt: skip
        print(f"| {target} | {'allowed' if allowed else 'denied'} | {why} |")
        if allowed != expected:
            wrong.append(f"{target}: allowed={allowed}, expected {expected} ({why})")
    return wrong


def test_operator_rbac_is_least_privilege(cluster: LocalCluster, operator_kubeconfig: Path) -> None:
    wrong = _wrong_answers(cluster, [a[:5] for a in ACCESS], [a[5] for a in ACCESS], [a[6] for a in ACCESS])
    assert not wrong, "\n".join(wrong)
    # The same answer from the operator's own credentials (a real request, not a review).
    secrets = cluster.kubectl("get", "secrets", "-A", kubeconfig=operator_kubeconfig, check=False)
    assert secrets.returncode != 0 and "forbidden" in secrets.stderr


MWC = "kvoffload-pod-injection"
TLS_SECRET = "kvoffload-webhook-tls"
CA_SECRET = "kvoffload-webhook-ca"
# Admission mode adds these rules (files/operator-admission-*.yaml; the Secret rules as a Role in the
# release namespace). (verb, group, resource, subresource, namespace, name, allowed?, why)
ADMISSION_ACCESS: list[tuple[str, str, str, str, str, str, bool, str]] = [
    ("get", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "", MWC, True, "its own webhook"),
    ("patch", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "", MWC, True, "its caBundle"),
    (
        "create",
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        "",
        "",
        "",
        False,
        "the chart ships the registration: no webhook of any name can be created",
    ),
    (
        "patch",
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        "",
        "",
        "someone-elses",
        False,
        "no other webhook",
    ),
    (
        "delete",
        "admissionregistration.k8s.io",
        "mutatingwebhookconfigurations",
        "",
        "",
        "someone-elses",
        False,
        "no other webhook",
    ),
    ("list", "admissionregistration.k8s.io", "mutatingwebhookconfigurations", "", "", "", False, "no listing"),
    (
        "patch",
        "admissionregistration.k8s.io",
        "validatingwebhookconfigurations",
        "",
        "",
        MWC,
        False,
        "no validating webhooks",
    ),
    ("get", "", "secrets", "", OPERATOR_NAMESPACE, TLS_SECRET, True, "the webhook's certificate"),
    ("update", "", "secrets", "", OPERATOR_NAMESPACE, TLS_SECRET, True, "renewal"),
    ("get", "", "secrets", "", OPERATOR_NAMESPACE, CA_SECRET, True, "the CA, read only to issue or renew"),
    ("create", "", "secrets", "", OPERATOR_NAMESPACE, "", True, "first issue (create cannot be limited to a name)"),
    ("get", "", "secrets", "", OPERATOR_NAMESPACE, "another-secret", False, "no other Secret of its namespace"),
    ("list", "", "secrets", "", OPERATOR_NAMESPACE, "", False, "no listing"),
    ("get", "", "secrets", "", "team-a", TLS_SECRET, False, "no Secret of another namespace"),
    ("create", "", "secrets", "", "team-a", "", False, "no Secret in another namespace"),
    ("create", "", "pods", "eviction", "team-a", "", True, "catch-up evictions"),
    ("patch", "", "pods", "", "team-a", "", False, "never changes running pods"),
    ("create", "", "pods", "", "team-a", "", False, "never creates pods"),
]


def _bind_in_namespace(cluster: LocalCluster, name: str, namespace: str, rules_file: Path) -> None:
    """A Role holding ``rules_file``'s rules in ``namespace``, bound to the operator's ServiceAccount."""
    rules = yaml.safe_load(rules_file.read_text())
    apply(cluster, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                    "metadata": {"name": name, "namespace": namespace}, "rules": rules})  # fmt: skip
    apply(cluster, {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                    "metadata": {"name": name, "namespace": namespace},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                    "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": OPERATOR_NAMESPACE}]})  # fmt: skip


def test_admission_mode_rbac_reaches_only_its_own_webhook_and_certificate_secret(
    cluster: LocalCluster, operator_kubeconfig: Path
) -> None:
    name = "kvoffload-operator-test-admission-sar"
    bind_rules(cluster, f"{name}-cluster", ADMISSION_RULES_FILE)
    bind_rules(cluster, f"{name}-webhook", ADMISSION_WEBHOOK_RULES_FILE)
    _bind_in_namespace(cluster, f"{name}-ns", OPERATOR_NAMESPACE, ADMISSION_NAMESPACE_RULES_FILE)
    try:
        wrong = _wrong_answers(cluster, [a[:6] for a in ADMISSION_ACCESS], [a[6] for a in ADMISSION_ACCESS],
                               [a[7] for a in ADMISSION_ACCESS])  # fmt: skip
        assert not wrong, "\n".join(wrong)
    finally:
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", f"{name}-cluster", f"{name}-webhook", check=False)
        cluster.kubectl("delete", "-n", OPERATOR_NAMESPACE, "rolebinding,role", f"{name}-ns", check=False)


def _pod_from_template(tpl: dict[str, Any], name: str, keep: set[str] | None = None) -> dict[str, Any]:
    """A bare Pod from a pod template; ``keep`` limits it to those containers (others removed)."""
    spec = copy.deepcopy(tpl["spec"])
    if keep is not None:
        for key in ("containers", "initContainers"):
            spec[key] = [x for x in spec.get(key, []) if x["name"] in keep]
        if not spec["containers"]:  # a pod needs one regular container: a harmless, restricted one
            spec["containers"] = [{"name": "pause", "image": "registry.k8s.io/pause:3.10",
                                   "securityContext": {"allowPrivilegeEscalation": False,
                                                       "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True,
                                                       "seccompProfile": {"type": "RuntimeDefault"}}}]  # fmt: skip
        mounted = {m["name"] for x in spec["containers"] + spec.get("initContainers", [])
                   for m in x.get("volumeMounts", [])}  # fmt: skip
        spec["volumes"] = [v for v in spec.get("volumes", []) if v["name"] in mounted]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}}, "spec": spec}


def _restricted_namespace(cluster: LocalCluster, name: str) -> None:
    apply(cluster, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name, "labels": {
        "pod-security.kubernetes.io/enforce": "restricted", "pod-security.kubernetes.io/enforce-version": "latest"}}})  # fmt: skip
    wait_for_default_service_account(cluster, name)


def _dry_run_pod(cluster: LocalCluster, pod: dict[str, Any], namespace: str) -> subprocess.CompletedProcess[str]:
    pod = {**pod, "metadata": {**pod["metadata"], "namespace": namespace}}
    return cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(pod), check=False)


def test_injected_pods_admitted_under_baseline_and_sidecar_meets_restricted(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    # namespace enforces baseline (tests/conftest.py); the operator injects, the ReplicaSet creates pods.
    apply(cluster, trtllm_deployment("psa", namespace, annotations={c.ANN_ENABLED: "true"}))
    injected = wait_injected(cluster, "deployment", "psa", namespace)
    wait_for(lambda: [p for p in list_objects(cluster, "pods", namespace, "app=psa")
                      if c.ANN_CONFIG_HASH in p["metadata"].get("annotations", {})],
             timeout=90, what="an injected pod admitted under baseline")  # fmt: skip
    replica_sets = list_objects(cluster, "replicasets", namespace, "app=psa")
    failed = [e for rs in replica_sets for e in events_for(cluster, namespace, rs["metadata"]["name"], "FailedCreate")]
    assert not failed, failed
    tpl = injected["spec"]["template"]
    ours = {c.SIDECAR_CONTAINER, c.BUNDLE_INIT_CONTAINER}
    for container in tpl["spec"]["containers"] + tpl["spec"].get("initContainers", []):
        if container["name"] in ours:
            sc = container["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
            assert sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
            assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    restricted = "psa-restricted-" + namespace[-5:]
    _restricted_namespace(cluster, restricted)
    # The other GPU access mode: the sidecar sees the engine's GPU through the NVIDIA runtime.
    apply(cluster, {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
                    "handler": "nvidia"})  # fmt: skip
    apply(cluster, {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
                    "metadata": {"name": "gpu", "namespace": namespace},
                    "spec": {"sidecar": {"gpuAccess": "nvidia-runtime", "runtimeClassName": "nvidia"}}})  # fmt: skip
    apply(cluster, trtllm_deployment("psa-gpu", namespace, annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: "gpu"}))
    gpu_tpl = wait_injected(cluster, "deployment", "psa-gpu", namespace)["spec"]["template"]
    assert gpu_tpl["spec"]["runtimeClassName"] == "nvidia"
    try:
        for variant, template_ in (("none", tpl), ("nvidia-runtime", gpu_tpl)):
            only_ours = _dry_run_pod(cluster, _pod_from_template(template_, "ours", keep=ours), restricted)
            assert only_ours.returncode == 0, (
                f"gpuAccess {variant}: injected containers fail restricted: {only_ours.stderr}"
            )
        whole = _dry_run_pod(cluster, _pod_from_template(tpl, "whole"), restricted)
        assert whole.returncode != 0 and "trtllm" in whole.stderr and c.SIDECAR_CONTAINER not in whole.stderr
        print("restricted violations of the whole injected pod (the user's container only):", whole.stderr.strip())
    finally:
        cluster.kubectl("delete", "namespace", restricted, "--wait=false", check=False)


def _helm(*args: str) -> str:
    return subprocess.run(["helm", *args], capture_output=True, text=True, check=True, timeout=120).stdout


def test_operator_pod_passes_restricted(cluster: LocalCluster) -> None:
    docs = [d for d in yaml.safe_load_all(_helm("template", "kvo", str(CHART), "-n", "kvoffload-system")) if d]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    name = "psa-operator"
    _restricted_namespace(cluster, name)
    try:
        account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        apply(cluster, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": account, "namespace": name}})
        out = _dry_run_pod(cluster, _pod_from_template(deployment["spec"]["template"], "operator"), name)
        assert out.returncode == 0, out.stderr
        assert "violate" not in out.stderr
    finally:
        cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def test_two_namespaces_get_separate_configmaps_and_no_cross_references(
    cluster: LocalCluster, running_operator: OperatorProcess
) -> None:
    namespaces = ["iso-tenant-a", "iso-tenant-b"]
    try:
        for ns in namespaces:
            apply(cluster, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        policy = {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
                  "metadata": {"name": "shared-name", "namespace": namespaces[0]}, "spec": {"cache": {"l1Size": "2Gi"}}}  # fmt: skip
        apply(cluster, policy)
        for ns in namespaces:  # same workload name, same policy name; the policy exists only in tenant a
            apply(
                cluster, trtllm_deployment("llm", ns, annotations={c.ANN_ENABLED: "true", c.ANN_POLICY: "shared-name"})
            )
        a = wait_injected(cluster, "deployment", "llm", namespaces[0])
        wait_for(lambda: events_for(cluster, namespaces[1], "llm", "KvoffloadInvalid"), timeout=60,
                 what="tenant b refused: the policy of tenant a is not visible to it")  # fmt: skip
        message = events_for(cluster, namespaces[1], "llm", "KvoffloadInvalid")[0]["message"]
        assert "no KVCachePolicy of that name exists in namespace iso-tenant-b" in message
        # Tenant b creates its own policy: both injected, each with its own ConfigMap.
        apply(cluster, {**policy, "metadata": {"name": "shared-name", "namespace": namespaces[1]},
                        "spec": {"cache": {"l1Size": "3Gi"}}})  # fmt: skip
        b = wait_injected(cluster, "deployment", "llm", namespaces[1])
        for ns, obj, other in ((namespaces[0], a, namespaces[1]), (namespaces[1], b, namespaces[0])):
            cm = get(cluster, "configmap", "llm" + c.GENERATED_CONFIGMAP_SUFFIX, ns)
            assert cm["metadata"]["namespace"] == ns
            owner = cm["metadata"]["ownerReferences"][0]
            assert owner["uid"] == obj["metadata"]["uid"] and owner["kind"] == "Deployment"
            text = json.dumps(obj["spec"]["template"]) + json.dumps(cm["data"])
            assert other not in text, f"{ns} refers to {other}"
        l1 = {ns: json.loads(get(cluster, "configmap", "llm" + c.GENERATED_CONFIGMAP_SUFFIX, ns)["data"][c.POLICY_FILE])
              ["cache"]["l1Size"] for ns in namespaces}  # fmt: skip
        assert l1 == {namespaces[0]: "2Gi", namespaces[1]: "3Gi"}
    finally:
        for ns in namespaces:
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
