"""Operator fixtures for every suite (registered in ``tests/conftest.py``): the CRD, the operator's
ServiceAccount bound to the chart's RBAC rules, and one operator process for the session.

The ServiceAccount is bound to ClusterRoles built from the chart's rules files for template mode
(``operator-clusterrole-rules.yaml``, ``operator-template-rules.yaml``, ``operator-nodes-rules.yaml``),
the same files the Helm chart renders, so these tests prove that exactly those rules suffice. An
admission-mode operator runs with the template rules revoked (admission mode writes no ConfigMap). Defined once, here: a second definition of a session
fixture (re-exported by another conftest) is a second instance, i.e. two operators at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from hack.localcluster import LocalCluster
from hack.ports import free_port
from hack.workloads import apply, wait_for
from kvoffload import contract as c
from tests.support.operator_support import (
    CRD_FILE,
    LEADER_ELECTION_RULES_FILE,
    NODES_RULES_FILE,
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    RULES_FILE,
    TEMPLATE_RULES_FILE,
    OperatorProcess,
    admission_args,
    admission_rules,
    register_webhook_as_the_chart_does,
)


def bind_rules(cluster: LocalCluster, name: str, rules_file: Path) -> None:
    """A ClusterRole holding exactly ``rules_file``'s rules, bound to the operator's ServiceAccount."""
    apply(cluster, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name}, "rules": yaml.safe_load(rules_file.read_text()),
    })  # fmt: skip
    apply(cluster, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": OPERATOR_NAMESPACE}],
    })  # fmt: skip


def assert_no_internal_errors(proc: OperatorProcess) -> None:
    """Whatever the tests threw at it, the operator never crashed inside a reconcile."""
    for log in sorted(proc.workdir.glob("operator-*.log")):
        text = log.read_text(errors="replace")
        assert " ERROR kvoffload" not in text, f"{log}:\n{text[-4000:]}"


@contextmanager
def operator_instead(
    cluster: LocalCluster,
    operator: OperatorProcess,
    workdir: Path,
    rules: Mapping[str, Path],
    extra_args: Sequence[str],
    rules_in_effect: Callable[[], object] | None = None,
) -> Iterator[OperatorProcess]:
    """Another operator in the session operator's place (which is stopped; tests that need it again
    restart it): ``extra_args`` on its command line and ``rules`` (ClusterRole name -> the chart's
    rules file) bound on top, as the chart's option installs them; the rules are revoked afterwards.
    ``rules_in_effect`` is waited for before it starts."""
    for name, rules_file in rules.items():
        bind_rules(cluster, name, rules_file)
    if rules_in_effect is not None:
        wait_for(rules_in_effect, what="the extra rules in effect")
    operator.stop()
    proc = OperatorProcess(kubeconfig=operator.kubeconfig, workdir=workdir, extra_args=list(extra_args))
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        for name in rules:
            cluster.kubectl("delete", "clusterrolebinding,clusterrole", name, check=False)
    assert_no_internal_errors(proc)


TEMPLATE_ROLE = "kvoffload-operator-test-template"
"""The session ServiceAccount's ClusterRole of template mode's ConfigMap writes."""


def sa_can(cluster: LocalCluster, *args: str) -> bool:
    """``kubectl auth can-i ARGS`` as the operator's ServiceAccount."""
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"
    return cluster.kubectl("auth", "can-i", *args, f"--as={user}", check=False).stdout.strip() == "yes"


@contextmanager
def template_rules_revoked(cluster: LocalCluster) -> Iterator[None]:
    """Template mode's ConfigMap writes unbound while the block runs (as an admission-mode install
    grants none), bound again afterwards."""
    cluster.kubectl("delete", "clusterrolebinding", TEMPLATE_ROLE, check=False)
    wait_for(lambda: not sa_can(cluster, "create", "configmaps", "-n", "default"), what="ConfigMap writes revoked")
    try:
        yield
    finally:
        bind_rules(cluster, TEMPLATE_ROLE, TEMPLATE_RULES_FILE)
        wait_for(lambda: sa_can(cluster, "create", "configmaps", "-n", "default"), what="ConfigMap writes back")


@contextmanager
def admission_operator_instead(
    cluster: LocalCluster, operator: OperatorProcess, workdir: Path, role: str
) -> Iterator[OperatorProcess]:
    """The operator with ``--injection admission`` and the chart's admission rules (ClusterRoles named
    after ``role``) in place of template mode's, its webhook on 127.0.0.1, in the session operator's
    place; its webhook registration is deleted afterwards."""
    port = free_port()
    register_webhook_as_the_chart_does(cluster, port)
    operator.stop()  # before its template-mode rights go, so it never meets a refusal
    try:
        with (
            template_rules_revoked(cluster),
            operator_instead(cluster, operator, workdir, admission_rules(role), admission_args(port)) as proc,
        ):
            yield proc
    finally:
        cluster.kubectl("delete", "mutatingwebhookconfiguration", c.WEBHOOK_CONFIGURATION_NAME, check=False)


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CRD installed; a ServiceAccount bound to the chart's ClusterRole rules; its kubeconfig."""
    cluster.kubectl("apply", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "crd/kvcachepolicies.kvoffload.io", "--timeout=60s")
    apply(cluster, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}})
    apply(cluster, {"apiVersion": "v1", "kind": "ServiceAccount",
                          "metadata": {"name": OPERATOR_SA, "namespace": OPERATOR_NAMESPACE}})  # fmt: skip
    bind_rules(cluster, "kvoffload-operator-test", RULES_FILE)
    bind_rules(cluster, TEMPLATE_ROLE, TEMPLATE_RULES_FILE)
    bind_rules(cluster, "kvoffload-operator-test-nodes", NODES_RULES_FILE)
    bind_rules(cluster, "kvoffload-operator-test-leader-election", LEADER_ELECTION_RULES_FILE)
    path = tmp_path_factory.mktemp("operator") / "operator.kubeconfig"
    return cluster.service_account_kubeconfig(OPERATOR_NAMESPACE, OPERATOR_SA, path)


@pytest.fixture(scope="session")
def operator(operator_kubeconfig: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[OperatorProcess]:
    """One operator process for the session (tests that kill it start it again)."""
    proc = OperatorProcess(kubeconfig=operator_kubeconfig, workdir=tmp_path_factory.mktemp("operator-run"))
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
    assert_no_internal_errors(proc)


@pytest.fixture
def running_operator(operator: OperatorProcess) -> OperatorProcess:
    """The session operator, restarted if an earlier test left it stopped."""
    if operator.popen is None or operator.popen.poll() is not None:
        operator.start()
    return operator
