"""Will the injected pod fit a GPU node (kvoffload.operator.plan.node_fit)? Decided before injecting."""

from __future__ import annotations

from typing import Any

import pytest

from hack.localcluster import fake_gpu_node
from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
from kvoffload.operator.intent.workload import read_workload
from kvoffload.operator.plan.node_fit import largest_gpu_node_memory, node_fit_problem
from kvoffload.quantity import kubernetes_bytes
from tests.unit.operator.workload_builders import deployment

pytestmark = pytest.mark.operator
CPU_NODE: dict[str, Any] = {"status": {"allocatable": {"memory": "2Ti", "cpu": "64"}}}


def settings_with(l1: str, **spec: Any) -> InjectionSettings:
    policy = {"metadata": {"name": "p"}, "spec": {"cache": {"l1Size": l1}, **spec}}
    s = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, OperatorDefaults(), "ns")
    assert isinstance(s, InjectionSettings), s
    return s


@pytest.mark.parametrize(("quantity", "size"), [("512Gi", 512 * 2**30), ("1e3", 1000), ("100M", 10**8),
                                                ("1500m", 1), ("32Gi", 32 * 2**30), ("lots", None)])  # fmt: skip
def test_kubernetes_memory_quantities_others_wrote_are_read(quantity: str, size: int | None) -> None:
    assert kubernetes_bytes(quantity) == size


def test_only_gpu_nodes_count() -> None:
    assert largest_gpu_node_memory([CPU_NODE, fake_gpu_node("g")]) == 512 * 2**30
    assert largest_gpu_node_memory([CPU_NODE]) is None


@pytest.mark.parametrize(("l1", "fits"), [("400Gi", True), ("478Gi", True), ("479Gi", False), ("600Gi", False)])
def test_an_l1_no_gpu_node_can_hold_is_refused_naming_the_sizes(l1: str, fits: bool) -> None:
    # the engine requests 32Gi (hack.workloads), the cache server its L1 + 2Gi: 512Gi holds L1 <= 478Gi
    problem = node_fit_problem(read_workload(deployment()), settings_with(l1), 512 * 2**30)
    if fits:
        assert problem is None
    else:
        assert problem is not None and problem.reason == "no_node_fits" and "512Gi" in problem.message, problem


def test_without_known_gpu_nodes_or_a_sidecar_nothing_is_refused() -> None:
    assert node_fit_problem(read_workload(deployment()), settings_with("600Gi"), None) is None
    inprocess = settings_with("600Gi", connector={"backend": "inprocess"})
    assert node_fit_problem(read_workload(deployment()), inprocess, 512 * 2**30) is None


def test_a_policys_own_sidecar_resources_are_what_counts_a_limit_standing_for_the_request() -> None:
    # 100Gi L1 would fit; the policy's own resources ask 500Gi (limit only: Kubernetes requests the limit)
    limits_only = settings_with("100Gi", sidecar={"resources": {"limits": {"memory": "500Gi"}}})
    problem = node_fit_problem(read_workload(deployment()), limits_only, 512 * 2**30)
    assert problem is not None and "532Gi" in problem.message, problem
    assert node_fit_problem(read_workload(deployment()), settings_with("100Gi"), 512 * 2**30) is None
