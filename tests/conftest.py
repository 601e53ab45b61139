"""Session fixtures: the real local Kubernetes control plane.

A test that needs the control plane takes the ``cluster`` fixture; start-up
failure fails those tests loudly (never a skip).
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from hack.localcluster import LocalCluster
from hack.workloads import wait_for_default_service_account

REPO_ROOT = Path(__file__).resolve().parent.parent

# Property tests assert behaviour, never timings: Hypothesis's per-example deadline and its
# "too slow" health check fail a correct test on a loaded machine (seen: a settings fuzz test
# failed while another build ran on the same two cores).
settings.register_profile("kvoffload", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("kvoffload")

# The operator's session fixtures, defined once for every suite that drives the operator.
pytest_plugins = ("tests.support.cluster_operator_fixtures",)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """etcd + kube-apiserver + controller-manager + scheduler + kwok, for the whole session."""
    workdir = tmp_path_factory.mktemp("cluster")
    local = LocalCluster(workdir=workdir, gpu_nodes=int(os.environ.get("KVOFFLOAD_TEST_GPU_NODES", "3")))
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace enforcing Pod Security ``baseline``, deleted afterwards."""
    base = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:40].strip("-")
    name = f"{base}-{uuid.uuid4().hex[:5]}"
    ns = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "labels": {
                "pod-security.kubernetes.io/enforce": "baseline",
                "pod-security.kubernetes.io/warn": "restricted",
            },
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(ns))
    wait_for_default_service_account(cluster, name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
