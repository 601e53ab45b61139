"""A workload carrying what kvoffload's field manager holds but kvoffload did not write (an injection
record that does not read as one; a manifest applied under kvoffload's name), on the real apiserver
with the admission-mode operator: one Warning, and no write at all to the workload, counted by the
apiserver's audit log. Before, the operator deleted such a record (a write the forger made under its
name), and on a manifest applied under its name its removal or apply PATCHes failed in a loop (5 x 422
and 4 x 409 in 12 s): the apiserver refused a Deployment without the selector that went with them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from kvoffload import contract as c
from tests.integration.operator.test_operator_admission import live, manifest
from tests.support.audit import OPERATOR_USER, AuditWindow
from tests.support.operator_support import OperatorProcess, child_pythonpath, events_for, server_side_apply

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]
WATCH_S = 12.0
"""How long the workload is watched for operator writes (past the retry queue's first backoffs)."""
FORGED = '{"settings": "not a record kvoffload wrote"}'


def forged_under_kvoffloads_name(cluster: LocalCluster, name: str, namespace: str, shape: str) -> None:
    """``record``: the user's Deployment, then a record applied under kvoffload's field manager;
    ``manifest``/``manifest-opted-in``: the whole manifest, record included, applied under it."""
    body = manifest(name, namespace, "trtllm:1", opted_in=shape == "manifest-opted-in")
    if shape == "record":
        server_side_apply(cluster, "user", body)
        body = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "namespace": namespace}}
    body["metadata"].setdefault("annotations", {})[c.ANN_INJECTION_RECORD] = FORGED
    server_side_apply(cluster, c.FIELD_MANAGER, body)


def workload_writes(audit: AuditWindow, namespace: str, name: str) -> list[Any]:
    return [w for w in audit.writes(OPERATOR_USER, namespace) if w.resource == "deployments" and w.name == name]


@pytest.mark.parametrize("shape", ["record", "manifest", "manifest-opted-in"])
def test_a_record_kvoffload_did_not_write_is_reported_once_and_left_alone(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess, shape: str
) -> None:
    name = "forged"
    audit = AuditWindow(cluster.audit_log).mark()
    forged_under_kvoffloads_name(cluster, name, namespace, shape)
    time.sleep(WATCH_S)
    assert workload_writes(audit, namespace, name) == [], audit.counts(OPERATOR_USER, namespace)
    warnings = [e for e in events_for(cluster, namespace, name) if e["type"] == "Warning"]
    assert [(e["reason"], e.get("count", 1)) for e in warnings] == [("KvoffloadInvalid", 1)], warnings
    assert "kvoffload did not write this" in warnings[0]["message"], warnings[0]["message"]
    assert live(cluster, name, namespace)["metadata"]["annotations"][c.ANN_INJECTION_RECORD] == FORGED


def test_the_uninstall_hook_leaves_such_a_workload_alone_says_so_and_does_not_fail_for_it(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess
) -> None:
    """The chart's hook command (the last test of the module: it deletes the webhook's registration)."""
    name = "forged"
    forged_under_kvoffloads_name(cluster, name, namespace, "manifest")
    audit = AuditWindow(cluster.audit_log).mark()
    hook = subprocess.run(
        [sys.executable, "-m", "kvoffload.operator", "--kubeconfig", str(admission_operator.kubeconfig),
         "--remove-all", "--leader-election=false", "--injection=admission", f"--namespace={namespace}"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": child_pythonpath()},
    )  # fmt: skip
    assert hook.returncode == 0, hook.stdout + hook.stderr
    assert f"Deployment/{namespace}/{name}: left alone: " in hook.stdout, hook.stdout
    assert "0 left; 1 left alone" in hook.stdout, hook.stdout
    assert workload_writes(audit, namespace, name) == [], "the hook wrote to it"
