"""Fixtures: the CRD, the operator's ServiceAccount bound to the chart's RBAC rules, the operator.

The ServiceAccount is bound to a ClusterRole built from the chart's
``files/operator-clusterrole-rules.yaml``, the same file the Helm chart renders, so these tests
prove that exactly those rules suffice.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from hack.localcluster import LocalCluster
from tests.integration.operator.operator_support import (
    CRD_FILE,
    NODE_MODE_RULES_FILE,
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    RULES_FILE,
    OperatorProcess,
)
from tests.support.workloads import wait_for


def _apply_json(cluster: LocalCluster, obj: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))


def _bind_rules(cluster: LocalCluster, name: str, rules_file: Path) -> None:
    """A ClusterRole holding exactly ``rules_file``'s rules, bound to the operator's ServiceAccount."""
    _apply_json(cluster, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": name}, "rules": yaml.safe_load(rules_file.read_text()),
    })  # fmt: skip
    _apply_json(cluster, {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SA, "namespace": OPERATOR_NAMESPACE}],
    })  # fmt: skip


def _assert_no_internal_errors(proc: OperatorProcess) -> None:
    """Whatever the tests threw at it, the operator never crashed inside a reconcile."""
    for log in sorted(proc.workdir.glob("operator-*.log")):
        text = log.read_text(errors="replace")
        assert " ERROR kvoffload" not in text, f"{log}:\n{text[-4000:]}"


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """CRD installed; a ServiceAccount bound to the chart's ClusterRole rules; its kubeconfig."""
    cluster.kubectl("apply", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "crd/kvcachepolicies.kvoffload.io", "--timeout=60s")
    _apply_json(cluster, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}})
    _apply_json(cluster, {"apiVersion": "v1", "kind": "ServiceAccount",
                          "metadata": {"name": OPERATOR_SA, "namespace": OPERATOR_NAMESPACE}})  # fmt: skip
    _bind_rules(cluster, "kvoffload-operator-test", RULES_FILE)
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
    _assert_no_internal_errors(proc)


@pytest.fixture
def running_operator(operator: OperatorProcess) -> OperatorProcess:
    """The session operator, restarted if an earlier test left it stopped."""
    if operator.popen is None or operator.popen.poll() is not None:
        operator.start()
    return operator


@pytest.fixture(scope="module")
def node_mode_operator(
    cluster: LocalCluster, operator: OperatorProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """An operator with ``--node-mode true`` and the chart's node-mode rules granted on top, as
    ``nodeMode.enabled=true`` installs it; the session operator is stopped meanwhile (tests that
    need it again restart it) and the extra rules are revoked afterwards."""
    _bind_rules(cluster, "kvoffload-operator-test-node-mode", NODE_MODE_RULES_FILE)
    sa_user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"
    wait_for(lambda: cluster.kubectl("auth", "can-i", "watch", "pods", "-A", f"--as={sa_user}",
                                     check=False).stdout.strip() == "yes", what="node-mode rules in effect")  # fmt: skip
    operator.stop()
    proc = OperatorProcess(kubeconfig=operator.kubeconfig, workdir=tmp_path_factory.mktemp("node-mode-operator"),
                           extra_args=["--node-mode", "true"])  # fmt: skip
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()
        cluster.kubectl("delete", "clusterrolebinding,clusterrole", "kvoffload-operator-test-node-mode", check=False)
    _assert_no_internal_errors(proc)
