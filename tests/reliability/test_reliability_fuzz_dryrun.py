"""A sample of fuzzed fragments sent to the real apiserver: every rendered body is valid for it.

The same strategies as tests/unit/reliability/test_reliability_fuzz.py (1,000 examples each, no
cluster); here ``SAMPLE`` rendered fragments are Server-Side Applied with ``--dry-run=server`` as
the operator's field manager onto live workloads, so the apiserver's own validation judges them.
"""

from __future__ import annotations

import json
from itertools import count
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from hack.localcluster import LocalCluster
from hack.workloads import get
from kvoffload import contract as c
from kvoffload.operator.intent.settings import resolve_settings
from kvoffload.operator.plan.fragment import ClusterInfo, RenderedInjection, render_injection_fragment
from kvoffload.policy_values import PolicyError
from tests.support import fuzz_strategies as fuzz

pytestmark = [pytest.mark.reliability, pytest.mark.controlplane]
SAMPLE = 20
_names = count()


def _dry_run_apply(cluster: LocalCluster, body: dict[str, Any]) -> None:
    out = cluster.kubectl(
        "apply", "--server-side", "--dry-run=server", f"--field-manager={c.FIELD_MANAGER}", "--force-conflicts",
        "-f", "-", input=json.dumps(body), check=False,
    )  # fmt: skip
    assert out.returncode == 0, f"apiserver refused a rendered body:\n{out.stderr}\n{json.dumps(body)[:3000]}"


@settings(max_examples=SAMPLE, deadline=None, database=None, phases=[Phase.generate],
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much,
                                 HealthCheck.too_slow])  # fmt: skip
@given(workload=fuzz.workloads(), spec=fuzz.VALID_SPEC,
       annotations=st.fixed_dictionaries({}, optional={c.ANN_CONTAINER: fuzz.CONTAINER_NAMES,
                                                       c.ANN_SHM_SIZE: st.sampled_from(["1Gi", "64Mi"])}))  # fmt: skip
def test_sample_of_rendered_fragments_passes_server_side_dry_run(
    cluster: LocalCluster, namespace: str, workload: dict[str, Any], spec: dict[str, Any], annotations: dict[str, str]
) -> None:
    annotations = {**annotations, c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}
    resolved = resolve_settings(annotations, fuzz.policy_object(spec), fuzz.DEFAULTS, namespace)
    assume(not isinstance(resolved, PolicyError))
    assert not isinstance(resolved, PolicyError)
    workload["metadata"] = {"name": f"dry-{next(_names)}", "namespace": namespace}  # no kvoffload annotations:
    # the operator leaves it alone; the renderer takes the settings directly.
    workload["spec"]["selector"]["matchLabels"] = workload["spec"]["template"]["metadata"]["labels"] = {"app": "dry"}
    assume(isinstance(render_injection_fragment(workload, resolved, ClusterInfo(native_sidecars=True)),
                      RenderedInjection))  # fmt: skip
    created = cluster.kubectl("apply", "--server-side", "--field-manager=user", "-f", "-",
                              input=json.dumps(workload), check=False)  # fmt: skip
    assume(created.returncode == 0)  # the apiserver refused the user's own manifest: nothing to inject into
    live = get(cluster, "deployment", workload["metadata"]["name"], namespace)
    rendered = render_injection_fragment(live, resolved, ClusterInfo(native_sidecars=True))
    assert isinstance(rendered, RenderedInjection), rendered
    _dry_run_apply(cluster, rendered.configmap_apply)
    _dry_run_apply(cluster, rendered.workload_apply)
