"""Node-mode operator fixture; the session operator and its ServiceAccount come from
``tests/support/operator_fixtures.py`` (registered in ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hack.localcluster import LocalCluster
from hack.workloads import wait_for
from tests.support.operator_fixtures import assert_no_internal_errors, bind_rules
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
    bind_rules(cluster, "kvoffload-operator-test-node-mode", NODE_MODE_RULES_FILE)
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
    assert_no_internal_errors(proc)
