"""Node-mode and admission-mode operator fixtures; the session operator and its ServiceAccount come from
``tests/support/cluster_operator_fixtures.py`` (registered in ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hack.localcluster import LocalCluster
from tests.support.cluster_operator_fixtures import admission_operator_instead, operator_instead
from tests.support.operator_support import (
    NODE_MODE_RULES_FILE,
    OPERATOR_NAMESPACE,
    OPERATOR_SA,
    OperatorProcess,
)


@pytest.fixture(scope="module")
def node_mode_operator(
    cluster: LocalCluster, operator: OperatorProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """An operator with ``--node-mode true`` and the chart's node-mode rules granted on top, as
    ``nodeMode.enabled=true`` installs it; the session operator is stopped meanwhile (tests that
    need it again restart it) and the extra rules are revoked afterwards."""
    sa_user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"

    def rules_in_effect() -> bool:
        can = cluster.kubectl("auth", "can-i", "watch", "pods", "-A", f"--as={sa_user}", check=False)
        return str(can.stdout).strip() == "yes"

    with operator_instead(cluster, operator, tmp_path_factory.mktemp("node-mode-operator"),
                          {"kvoffload-operator-test-node-mode": NODE_MODE_RULES_FILE}, ["--node-mode", "true"],
                          rules_in_effect) as proc:  # fmt: skip
        yield proc


@pytest.fixture(scope="module")
def admission_operator(
    cluster: LocalCluster, operator: OperatorProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    """The operator with ``--injection admission`` and the chart's admission rules, its webhook on
    127.0.0.1 (``--webhook-url``), for one module's tests; the session operator is stopped meanwhile."""
    with admission_operator_instead(
        cluster, operator, tmp_path_factory.mktemp("admission-operator"), "kvoffload-operator-test"
    ) as proc:
        yield proc
