"""The user's journey end to end: helm install, annotate, real cache hits, metrics, removal, uninstall."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hack.demo import token_source_lines
from hack.journey import Journey, shared_prefix_prompts, strip_server_fields
from hack.localcluster import LocalCluster
from hack.polling import wait_until
from kvoffload import contract
from tests.support.promtool import run_token_source_tests

pytestmark = [pytest.mark.e2e, pytest.mark.controlplane]


@pytest.fixture
def journey(cluster: LocalCluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Journey]:
    j = Journey(cluster=cluster, workdir=tmp_path, namespace=f"llm-{request.node.callspec.id}")
    try:
        yield j
    finally:
        j.close()
        cluster.kubectl("delete", "namespace", j.namespace, "--wait=false", check=False)


@pytest.mark.parametrize("options_from_configmap", [False, True], ids=["no-options-file", "options-configmap"])
def test_annotated_trtllm_deployment_reuses_kv_through_the_sidecar(
    journey: Journey, options_from_configmap: bool
) -> None:
    notes = journey.install_chart()
    assert f"kubectl annotate deployment <name> -n <namespace> {contract.ANN_ENABLED}=true" in notes
    journey.start_operator()
    journey.create_workload(options_from_configmap=options_from_configmap)

    pod = journey.annotate()
    names = {c["name"] for c in pod["spec"].get("initContainers", []) + pod["spec"]["containers"]}
    assert {contract.SIDECAR_CONTAINER, contract.BUNDLE_INIT_CONTAINER} <= names

    prompts = shared_prefix_prompts(num_requests=5, prefix_tokens=1024, suffix_tokens=96)
    report = journey.run_pod_locally(pod, prompts)
    later = report["phases"][2]["results"]
    assert all(not r["failed"] for phase in report["phases"] if "results" in phase for r in phase["results"])
    assert report["kv_mismatches"] == 0
    # After the device cache was evicted, every later request found the 1024-token prefix in the sidecar.
    assert all(r["connector_matched_tokens"] >= 1024 for r in later)
    assert all(r["computed_prompt_tokens"] <= 96 + 256 for r in later)
    bundle_python = journey.local_pod.volume_dirs[contract.VOLUME_BUNDLE] / "python"  # type: ignore[union-attr]
    assert list(bundle_python.rglob("connector/__pycache__/*.pyc")), "the connector must load from the bundle volume"

    journey.start_prometheus()
    hit = wait_until(lambda: journey.promql("sum(kvoffload_connector_lookup_hit_tokens_total)"), 60, "hit tokens")
    assert hit >= 4 * 1024
    assert wait_until(lambda: journey.promql("sum(kvoffload_connector_retrieve_bytes_total)"), 60, "retrieve bytes") > 0
    assert journey.promql("max(kvoffload_sidecar_server_up)") == 1
    assert wait_until(lambda: journey.promql('count({__name__=~"lmcache_mp_.*"})'), 30, "LMCache server series")
    assert {"KvoffloadSidecarDown", "KvoffloadLookupHitRateCollapsed", "KvoffloadPromptReuseCollapsed",
            "kvoffload:prompt_tokens_reused:ratio_rate5m"} <= journey.loaded_alert_rules()  # fmt: skip

    # Where the prompt tokens came from, as Prometheus scraped it, equals what the engine did with them
    # (and is what the demo prints); the chart's token-source rules pass promtool on these very series.
    results = [r for phase in report["phases"] if "results" in phase for r in phase["results"]]
    engine = {"device": sum(r["device_reused_tokens"] for r in results),
              "cache": sum(r["connector_matched_tokens"] for r in results),
              "computed": sum(r["computed_prompt_tokens"] for r in results)}  # fmt: skip
    sources = wait_until(journey.token_sources, 30, "prompt-token sources")
    scraped = {src: sum(v for (s, _), v in sources.items() if s == src) for src in engine}
    assert scraped == engine, (scraped, engine)
    assert token_source_lines(sources, 0.0, 0.0)[1].startswith(f"              device {engine['device']} ")
    promtool = run_token_source_tests(journey.rule_groups(), sources, journey.workdir / "promtool")
    assert promtool.returncode == 0, promtool.stdout + promtool.stderr

    template = journey.remove_annotation()
    assert strip_server_fields(template) == strip_server_fields(journey.original_template)
    configmaps = journey.kubectl("get", "configmap", "-n", journey.namespace, "-o", "name").stdout
    assert f"{journey.workload}-kvoffload" not in configmaps

    leftovers = journey.uninstall()
    assert leftovers == ""
