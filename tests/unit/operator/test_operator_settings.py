"""Annotations + policy + defaults -> settings or a precise error."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import contract as c
from kvoffload.operator.intent.settings import (
    InjectionSettings,
    OperatorDefaults,
    base_settings,
    enabled_state,
    resolve_settings,
)
from kvoffload.policy_values import PolicyError

pytestmark = pytest.mark.operator
DEFAULTS = OperatorDefaults()


def ok(annotations: dict[str, str], policy: dict[str, Any] | None = None,
       defaults: OperatorDefaults = DEFAULTS) -> InjectionSettings:  # fmt: skip
    result = resolve_settings({c.ANN_ENABLED: "true", **annotations}, policy, defaults, "ns")
    assert isinstance(result, InjectionSettings), result
    return result


def err(annotations: dict[str, str], policy: dict[str, Any] | None = None) -> PolicyError:
    result = resolve_settings({c.ANN_ENABLED: "true", **annotations}, policy, DEFAULTS, "ns")
    assert isinstance(result, PolicyError), result
    return result


@pytest.mark.parametrize(
    ("annotations", "expected"),
    [
        ({}, False),
        ({c.ANN_ENABLED: "true"}, True),
        ({c.ANN_ENABLED: "false"}, False),
        ({"other": "true"}, False),
    ],
)
def test_enabled_state(annotations: dict[str, str], expected: bool) -> None:
    assert enabled_state(annotations) is expected


@pytest.mark.parametrize("value", ["yes", "1", "", "on", "TRUE", "True", " true ", "false\n"])
def test_enabled_state_rejects_other_values_naming_what_is_allowed(value: str) -> None:
    result = enabled_state({c.ANN_ENABLED: value})
    assert isinstance(result, PolicyError)
    assert c.ANN_ENABLED in result.message and repr(value) in result.message and '"true" or "false"' in result.message


def test_defaults_apply_without_policy_or_overrides() -> None:
    s = ok({})
    assert (s.l1_bytes, s.shm_bytes, s.chunk_size, s.backend, s.mode) == (
        20 * 2**30,
        8 * 2**30,
        256,
        "sidecar",
        "sidecar",
    )
    assert s.policy_name is None


def test_precedence_is_defaults_then_policy_then_annotations() -> None:
    policy = {"metadata": {"name": "p"}, "spec": {"cache": {"l1Size": "10Gi", "chunkSize": 512}, "shmSize": "4Gi"}}
    s = ok({c.ANN_POLICY: "p", c.ANN_CPU_CACHE_SIZE: "30Gi"}, policy)
    assert s.l1_bytes == 30 * 2**30  # annotation wins
    assert s.chunk_size == 512 and s.shm_bytes == 4 * 2**30  # policy wins over defaults
    assert s.policy_name == "p"


def test_defaults_file_spec_lays_over_flag_defaults() -> None:
    defaults = OperatorDefaults(spec={"cache": {"l1Size": "2Gi"}, "connector": {"bundleImage": "b:1"}})
    s = ok({}, defaults=defaults)
    assert s.l1_bytes == 2 * 2**30 and s.bundle_image == "b:1"
    bad = base_settings(OperatorDefaults(spec={"cache": {"chunkSize": 7}}))
    assert isinstance(bad, PolicyError) and "operator defaults.cache.chunkSize" in bad.message


@pytest.mark.parametrize(
    ("annotations", "field", "allowed"),
    [
        ({c.ANN_CPU_CACHE_SIZE: "lots"}, c.ANN_CPU_CACHE_SIZE, "Gi"),
        ({c.ANN_CPU_CACHE_SIZE: "0"}, c.ANN_CPU_CACHE_SIZE, "from 64Mi to 1Pi"),
        ({c.ANN_SHM_SIZE: "-1Gi"}, c.ANN_SHM_SIZE, "Gi"),
        ({c.ANN_BACKEND: "remote"}, c.ANN_BACKEND, "sidecar, inprocess"),
        ({c.ANN_MODE: "cluster"}, c.ANN_MODE, "sidecar, node"),
        ({c.ANN_MODE: "node"}, c.ANN_MODE, "needs kvoffload.io/policy"),
        ({c.ANN_CONNECTOR_SOURCE: "pip"}, c.ANN_CONNECTOR_SOURCE, "init-container, image"),
        ({c.ANN_CONTAINER: "Not_A_Name"}, c.ANN_CONTAINER, "container"),
        ({c.ANN_POLICY: "Bad Name"}, c.ANN_POLICY, "KVCachePolicy"),
    ],
)
def test_bad_annotations_name_field_value_and_allowed(annotations: dict[str, str], field: str, allowed: str) -> None:
    e = err(annotations)
    assert e.field == field
    assert repr(next(iter(annotations.values()))) in e.message
    assert allowed in e.message


def test_missing_policy_is_an_error_with_its_own_reason() -> None:
    e = err({c.ANN_POLICY: "gone"})
    assert e.reason == "policy_missing" and "gone" in e.message and "ns" in e.message


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"cache": {"l1Size": 5}}, "cache.l1Size"),
        ({"cache": {"chunkSize": 100}}, "cache.chunkSize"),
        ({"cache": {"chunkSize": True}}, "cache.chunkSize"),
        ({"cache": {"evictionPolicy": "FIFO"}}, "cache.evictionPolicy"),
        ({"cache": {"maxWorkers": 0}}, "cache.maxWorkers"),
        ({"cache": []}, "cache"),
        ({"l2": {"fs": {"path": "rel", "size": "1Gi"}}}, "l2.fs.path"),
        ({"l2": {"redis": {"url": "http://x"}}}, "l2.redis.url"),
        ({"l2": {"redis": {"url": "redis://x", "passwordSecretRef": {"name": "s"}}}}, "passwordSecretRef.key"),
        ({"l2": {"redis": {"url": "redis://x", "urlSecretRef": {"name": "s", "key": "u"}}}}, "exactly one of url"),
        ({"l2": {"redis": {}}}, "exactly one of url"),
        ({"l2": {"redis": {"urlSecretRef": {"name": "Bad_Name", "key": "u"}}}}, "l2.redis.urlSecretRef.name"),
        ({"l2": {"redis": {"urlSecretRef": {"name": "s"}}}}, "l2.redis.urlSecretRef.key"),
        ({"sidecar": {"gpuAccess": "all"}}, "sidecar.gpuAccess"),
        ({"sidecar": {"runtimeClassName": "Bad_Name"}}, "sidecar.runtimeClassName"),
        ({"connector": {"lookupTimeoutMs": 0}}, "connector.lookupTimeoutMs"),
        ({"connector": {"saveDecodeTokens": "yes"}}, "connector.saveDecodeTokens"),
        ({"mode": "node", "connector": {"backend": "inprocess"}}, "connector.backend"),
    ],
)
def test_bad_policy_specs_name_the_policy_field(spec: dict[str, Any], field: str) -> None:
    e = err({c.ANN_POLICY: "p"}, {"metadata": {"name": "p"}, "spec": spec})
    assert "KVCachePolicy p" in e.message and field in e.message


def test_full_policy_round_trips_into_the_policy_document() -> None:
    spec = {
        "cache": {"l1Size": "16Gi", "evictionPolicy": "ARC", "chunkSize": 128, "maxWorkers": 2},
        "l2": {"fs": {"path": "/cache", "size": "50Gi"},
               "redis": {"url": "redis://r:6379/0", "passwordSecretRef": {"name": "r", "key": "pw"}}},
        "shmSize": "2Gi",
        "sidecar": {"image": "img:2", "resources": {"limits": {"memory": "40Gi"}}, "gpuAccess": "none",
                    "runtimeClassName": "nvidia"},
        "connector": {"backend": "sidecar", "source": "image", "lookupTimeoutMs": 50, "retrieveTimeoutMs": 900,
                      "storeTimeoutMs": 800, "saveDecodeTokens": True},
    }  # fmt: skip
    s = ok({c.ANN_POLICY: "p"}, {"metadata": {"name": "p"}, "spec": spec})
    doc = s.policy_document()
    assert doc["cache"] == {"l1Size": "16Gi", "evictionPolicy": "ARC", "chunkSize": 128, "maxWorkers": 2}
    assert doc["l2"] == spec["l2"]
    assert doc["connector"]["saveDecodeTokens"] is True and s.sidecar_resources == {"limits": {"memory": "40Gi"}}
    assert s.runtime_class_name == "nvidia" and s.gpu_access == "none" and s.connector_source == "image"


ANNOTATION_KEYS = [c.ANN_ENABLED, c.ANN_POLICY, c.ANN_CONTAINER, c.ANN_CONNECTOR_SOURCE, c.ANN_MODE,
                   c.ANN_CPU_CACHE_SIZE, c.ANN_SHM_SIZE, c.ANN_BACKEND]  # fmt: skip
VALUES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["true", "false", "20Gi", "1.5Gi", "0", "sidecar", "node", "image", "trtllm", "p", "512Mi"]),
)


@given(st.dictionaries(st.sampled_from(ANNOTATION_KEYS), VALUES), st.booleans())
def test_fuzz_annotations_give_settings_or_an_error_never_an_exception(annotations: dict[str, str], with_policy: bool
                                                                       ) -> None:  # fmt: skip
    policy = {"metadata": {"name": annotations.get(c.ANN_POLICY, "p")}, "spec": {}} if with_policy else None
    state = enabled_state(annotations)
    assert isinstance(state, (bool, PolicyError))
    result = resolve_settings(annotations, policy, DEFAULTS, "ns")
    if isinstance(result, PolicyError):
        assert result.field and "is not allowed" in result.message
    else:
        assert result.l1_bytes > 0 and result.shm_bytes > 0 and result.mode in ("sidecar", "node")
        if result.mode == "node":
            assert result.policy_name is not None and result.backend == c.BACKEND_SIDECAR


def test_an_events_level_other_than_warnings_or_all_stops_the_operator_with_one_line_before_any_request() -> None:
    from kvoffload.operator.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["--events", "normal", "--kubeconfig", "/nonexistent/kubeconfig"])
    assert str(stopped.value) == "kvoffload-operator: --events 'normal': allowed warnings, all"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--metrics-port", "9000", "--health-port", "9000"], "--metrics-port and --health-port are both 9000"),
        (["--injection", "admission", "--webhook-port", "8081", "--health-port", "8081"],
         "--health-port and --webhook-port are both 8081"),
    ],
)  # fmt: skip
def test_two_listeners_on_one_port_stop_the_operator_with_one_line_before_any_request(
    flags: list[str], message: str
) -> None:
    from kvoffload.operator.cli import main

    with pytest.raises(SystemExit) as stopped:
        main([*flags, "--kubeconfig", "/nonexistent/kubeconfig"])
    assert str(stopped.value) == f"kvoffload-operator: {message}: each needs a port of its own"


def test_an_advertised_webhook_host_that_is_not_an_ip_stops_the_operator_with_one_line_before_any_request() -> None:
    from kvoffload.operator.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["--injection", "admission", "--webhook-url", "https://127.0.0.1:8443/mutate-pods",
              "--leader-election-namespace", "kvoffload-system", "--webhook-advertise-host", "operator-pod",
              "--kubeconfig", "/nonexistent/kubeconfig"])  # fmt: skip
    assert (
        str(stopped.value)
        == "kvoffload-operator: --webhook-advertise-host (or POD_IP) 'operator-pod' is not an IP address"
    )


def test_a_redis_url_from_a_secret_round_trips_into_the_policy_document_as_the_reference() -> None:
    redis = {"urlSecretRef": {"name": "redis-url", "key": "url"}, "passwordSecretRef": {"name": "r", "key": "pw"}}
    s = ok({c.ANN_POLICY: "p"}, {"metadata": {"name": "p"}, "spec": {"l2": {"redis": redis}}})
    assert s.policy_document()["l2"] == {"redis": redis}
    assert s.redis_tier is not None and s.redis_tier.url is None
