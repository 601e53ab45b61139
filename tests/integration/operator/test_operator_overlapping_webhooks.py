"""Operator replicas overlapping behind the webhook's Service, each answering reviews.

``helm upgrade`` while users deploy (issue 46 item 1): the old and the new operator overlap, both
serving the webhook, while users change their opted-in Deployments with ``kubectl set env``. Each
workload goes to the new settings once and never back; the user's writes roll it, and the
upgrade at most once more. Before, both replicas planned at admission with their own defaults: a
user's write answered by the new one took a workload to its settings, the old one's reconcile
took it back. A hot standby of the same release still plans as the holder would.

Apps created opted in during that overlap (a GitOps tool syncing while the upgrade runs) roll once,
with the holder's settings, whichever replica answers their CREATE and their pods' reviews: a new
replica of the same operator version plans with the holder's published inputs, one of another version
(a new image) forwards the reviews to the holder's webhook."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.ports import free_port
from hack.workloads import get, list_objects, wait_for
from kvoffload import contract as c
from kvoffload.operator import __version__
from kvoffload.operator.plan.injection_record import InjectionRecord
from kvoffload.quantity import format_bytes
from tests.integration.operator.test_operator_admission import revision, settled
from tests.support.audit import OPERATOR_USER, AuditWindow
from tests.support.operator_support import (
    OperatorProcess,
    admission_args,
    register_webhook_as_the_chart_does,
    webhook_port,
)
from tests.support.operator_support import gitops_manifest as manifest
from tests.support.service_endpoints import RoundRobinService
from tests.support.watch_log import WatchLog

pytestmark = [pytest.mark.operator, pytest.mark.controlplane]
WORKLOADS = 4
OLD_L1, NEW_L1 = "4Gi", "5Gi"
OVERLAP_ROUNDS, AFTER_ROUNDS = 5, 3
"""``kubectl set env`` on every workload every ``ROUND_S``: 10 s while both operators run, then
6 s while the old one stops and the new one takes over."""
ROUND_S = 2.0
SETTLE_S = 4.0


def record_l1(workload: dict[str, Any]) -> str | None:
    """The L1 size in the workload's injection record (None: no readable record)."""
    text = ((workload.get("metadata") or {}).get("annotations") or {}).get(c.ANN_INJECTION_RECORD)
    record = InjectionRecord.from_json(text) if text else None
    return format_bytes(record.settings.l1_bytes) if isinstance(record, InjectionRecord) else None


def pod_l1(pod: dict[str, Any]) -> str | None:
    containers = [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]
    sidecar = next((x for x in containers if x["name"] == c.SIDECAR_CONTAINER), None)
    return next((e["value"] for e in sidecar["env"] if e["name"] == c.ENV_L1_SIZE), None) if sidecar else None


def l1_of_pods_as_admitted(events: list[dict[str, Any]], names: list[str]) -> dict[str, list[str | None]]:
    """Each named workload's pods' L1 size as admitted: the first time the watch saw each pod."""
    pod_l1s: dict[str, list[str | None]] = {n: [] for n in names}
    seen: set[str] = set()
    for event in events:
        pod = event["object"]
        if pod["metadata"]["uid"] not in seen and owner_of(pod) in pod_l1s:
            seen.add(pod["metadata"]["uid"])
            pod_l1s[owner_of(pod)].append(pod_l1(pod))
    return pod_l1s


def owner_of(pod: dict[str, Any]) -> str:
    """The Deployment a pod belongs to (its ReplicaSet's name less the template hash)."""
    return str(pod["metadata"]["ownerReferences"][0]["name"]).rsplit("-", 1)[0]


def l1_sequence(values: list[str | None]) -> list[str]:
    """The values in order, repeats and gaps left out: ``[4Gi, 5Gi]`` for one change."""
    sequence: list[str] = []
    for value in values:
        if value is not None and (not sequence or sequence[-1] != value):
            sequence.append(value)
    return sequence


def set_env(cluster: LocalCluster, name: str, namespace: str, value: str) -> int:
    """The user's ``kubectl set env`` on the engine container; 1 when it changed the pod template."""
    out = cluster.kubectl("set", "env", f"deployment/{name}", "-n", namespace, "-c", "trtllm", f"APP_ROUND={value}")
    return 1 if "env updated" in out.stdout else 0


def test_user_writes_during_an_operator_upgrade_never_take_a_workload_back_to_the_old_settings(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess, tmp_path: Path
) -> None:
    names = [f"busy-{i}" for i in range(WORKLOADS)]
    for name in names:
        body = manifest(name, namespace, "trtllm:1.2.0", opted_in=True)
        cluster.kubectl("apply", "-f", "-", input=json.dumps(body))
    for name in names:
        wait_for(lambda n=name: record_l1(get(cluster, "deployment", n, namespace)) == OLD_L1, 90,
                 what=f"{name} injected with L1 {OLD_L1}")  # fmt: skip
    service = RoundRobinService([webhook_port(admission_operator)]).start()
    register_webhook_as_the_chart_does(cluster, service.port)  # the chart's Service, one endpoint so far
    (tmp_path / "upgraded").mkdir()
    upgraded = OperatorProcess(kubeconfig=admission_operator.kubeconfig, workdir=tmp_path / "upgraded",
                               overlap_allowed=True,
                               extra_args=[*admission_args(free_port()), "--default-l1-size", NEW_L1])  # fmt: skip
    deployments = WatchLog(cluster, "deployments", namespace, tmp_path / "deployments.json")
    pods = WatchLog(cluster, "pods", namespace, tmp_path / "pods.json")
    time.sleep(1)  # the watches have listed what is there
    before = {n: get(cluster, "deployment", n, namespace)["metadata"]["generation"] for n in names}
    user_writes: Counter[str] = Counter()
    audit = AuditWindow(cluster.audit_log).mark()
    try:
        upgraded.start()  # a standby, ready: the Service sends it every other review
        service.backends.append(webhook_port(upgraded))
        for round_ in range(OVERLAP_ROUNDS + AFTER_ROUNDS):
            if round_ == OVERLAP_ROUNDS:
                admission_operator.stop()  # the old pod's SIGTERM: it releases the Lease
            started = time.monotonic()
            for name in names:
                user_writes[name] += set_env(cluster, name, namespace, str(round_))
            time.sleep(max(0.0, ROUND_S - (time.monotonic() - started)))
        for name in names:
            wait_for(lambda n=name: record_l1(get(cluster, "deployment", n, namespace)) == NEW_L1, 60,
                     what=f"{name} on L1 {NEW_L1}")  # fmt: skip
        time.sleep(SETTLE_S)
        after = {n: get(cluster, "deployment", n, namespace)["metadata"]["generation"] for n in names}
    finally:
        deployments.stop()
        pods.stop()
        upgraded.stop()
        service.stop()
        register_webhook_as_the_chart_does(cluster, webhook_port(admission_operator))
        admission_operator.start()
    records = {n: l1_sequence([record_l1(e["object"]) for e in deployments.events()
                               if e["object"]["metadata"]["name"] == n]) for n in names}  # fmt: skip
    pod_l1s = l1_of_pods_as_admitted(pods.events(), names)
    extra = {n: after[n] - before[n] - user_writes[n] for n in names}
    patches = audit.counts(OPERATOR_USER, namespace)
    print(f"upgrade with user writes: records {records}, "
          f"extra rollouts {extra}, user writes {dict(user_writes)}, operator writes {dict(patches)}, "
          f"pods by L1 {({n: dict(Counter(v)) for n, v in pod_l1s.items()})}")  # fmt: skip
    once = {n: [OLD_L1, NEW_L1] for n in names}  # the new settings once, never the old ones again
    assert records == once, "a workload's record went back to the old settings"
    assert {n: l1_sequence(v) for n, v in pod_l1s.items()} == once, "pods went back to the old settings"
    assert all(0 <= e <= 1 for e in extra.values()), extra


def test_a_new_opted_in_app_answered_by_a_hot_standby_of_the_same_release_rolls_once(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess, tmp_path: Path
) -> None:
    """A second replica with the same flags (``replicaCount: 2``) plans as the holder would: with
    only its webhook behind the Service (the holder's unready), new opted-in apps are labelled at
    creation and their first pods injected, so each rolls once, as with one replica."""
    (tmp_path / "standby").mkdir()
    standby = OperatorProcess(kubeconfig=admission_operator.kubeconfig, workdir=tmp_path / "standby",
                              overlap_allowed=True, extra_args=admission_args(free_port()))  # fmt: skip
    names = [f"born-{i}" for i in range(2)]
    try:
        standby.start()
        register_webhook_as_the_chart_does(cluster, webhook_port(standby))  # the Service's one ready endpoint
        for name in names:
            cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(name, namespace, "trtllm:1.2.0", True)))
        for name in names:
            pods = settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")
            assert {pod_l1(p) for p in pods} == {OLD_L1}
            wait_for(lambda n=name: record_l1(get(cluster, "deployment", n, namespace)) == OLD_L1, 60,
                     what=f"{name}'s record written by the acting operator")  # fmt: skip
        time.sleep(SETTLE_S)
        revisions = {n: revision(cluster, n, namespace) for n in names}
        answered = standby.log().count(": injected")
    finally:
        standby.stop()
        register_webhook_as_the_chart_does(cluster, webhook_port(admission_operator))
    assert answered >= 2 * len(names), "the standby's webhook labelled the apps and injected their pods"
    assert revisions == dict.fromkeys(names, 1), revisions


@pytest.mark.parametrize("new_version", [None, "0.2.0"], ids=["same-version", "new-image"])
def test_apps_created_opted_in_while_two_operators_overlap_roll_once_with_the_holders_settings(
    cluster: LocalCluster, namespace: str, admission_operator: OperatorProcess, tmp_path: Path,
    new_version: str | None,
) -> None:  # fmt: skip
    """The old operator holds the Lease, the new one (other defaults; the same operator version, or
    another: a new image) waits; both answer reviews. Apps created while only the new one's webhook
    is reached (the old pod's endpoint not ready for a moment), then while the Service spreads
    reviews over both: each gets its first template from its CREATE, one ReplicaSet, revision 1, and
    every pod it ever runs is injected with the old (holding) operator's settings, the same the
    record it ends with names."""
    service = RoundRobinService([webhook_port(admission_operator)]).start()
    register_webhook_as_the_chart_does(cluster, service.port)
    (tmp_path / "upgraded").mkdir()
    upgraded = OperatorProcess(kubeconfig=admission_operator.kubeconfig, workdir=tmp_path / "upgraded",
                               overlap_allowed=True, version=new_version,
                               extra_args=[*admission_args(free_port()), "--default-l1-size", NEW_L1])  # fmt: skip
    only_new, both = [f"early-{i}" for i in range(2)], [f"spread-{i}" for i in range(4)]
    names = [*only_new, *both]
    pods = WatchLog(cluster, "pods", namespace, tmp_path / "pods.json")
    try:
        upgraded.start()
        service.backends[:] = [webhook_port(upgraded)]
        for name in only_new:
            cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(name, namespace, "trtllm:1.2.0", True)))
        for name in only_new:
            settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")
        service.backends[:] = [webhook_port(admission_operator), webhook_port(upgraded)]
        for name in both:
            cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest(name, namespace, "trtllm:1.2.0", True)))
        for name in names:
            wait_for(lambda n=name: record_l1(get(cluster, "deployment", n, namespace)) == OLD_L1, 60,
                     what=f"{name}'s record written by the holder")  # fmt: skip
        for name in both:
            settled(cluster, name, namespace, injected=True, image="trtllm:1.2.0")
        time.sleep(SETTLE_S)
        revisions = {n: revision(cluster, n, namespace) for n in names}
        records = {n: record_l1(get(cluster, "deployment", n, namespace)) for n in names}
        replica_sets = Counter(str(rs["metadata"]["ownerReferences"][0]["name"])
                               for rs in list_objects(cluster, "replicaset", namespace))  # fmt: skip
    finally:
        pods.stop()
        upgraded.stop()
        service.stop()
        register_webhook_as_the_chart_does(cluster, webhook_port(admission_operator))
    pod_l1s = l1_of_pods_as_admitted(pods.events(), names)
    print(f"apps created during the overlap: revisions {revisions}, replica sets {dict(replica_sets)}, "
          f"records {records}, pods by L1 {({n: dict(Counter(v)) for n, v in pod_l1s.items()})}")  # fmt: skip
    assert revisions == dict.fromkeys(names, 1), revisions
    assert {n: replica_sets[n] for n in names} == dict.fromkeys(names, 1), replica_sets
    assert records == dict.fromkeys(names, OLD_L1), records
    otherwise = {n: dict(Counter(v)) for n, v in pod_l1s.items() if set(v) != {OLD_L1}}
    assert not otherwise, f"pods admitted without the holder's injection: {otherwise}"
    new_log = upgraded.log_path.read_text()
    assert f"starting version={new_version or __version__} " in new_log
    forwarded = new_log.count("answered by the Lease's holder")
    assert forwarded >= (len(only_new) if new_version else 0), f"{forwarded} reviews forwarded to the holder"
    assert new_version or not forwarded, "a replica of the holder's version plans itself, it forwards nothing"
