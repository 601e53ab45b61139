"""The CRD is checked against the one policy module (kvoffload.policy): the same fields, enums,
ranges and patterns; and the shared rules (contract.REDIS_URL_PATTERN, contract.MIN_L1_SIZE) agree.
The real apiserver's verdicts are compared in tests/integration/operator/test_operator_policy_agreement.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import contract as c
from kvoffload import policy as pol
from kvoffload import policy_values as polv
from kvoffload.operator.intent.settings import OperatorDefaults, resolve_settings
from kvoffload.policy_values import PolicyError
from kvoffload.quantity import QUANTITY_PATTERN
from kvoffload.sidecar import settings as sidecar_settings

pytestmark = [pytest.mark.operator, pytest.mark.sidecar]
CRD = Path(__file__).resolve().parents[2] / "charts" / "kvoffload" / "crds" / "kvcachepolicies.yaml"


def crd_spec() -> dict[str, Any]:
    doc = yaml.safe_load(CRD.read_text())
    return doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]  # type: ignore[no-any-return]


def crd_url_rules() -> list[str]:
    url = crd_spec()["properties"]["l2"]["properties"]["redis"]["properties"]["url"]
    return [v["rule"] for v in url["x-kubernetes-validations"]]


def test_the_crd_l1_minimum_is_the_contracts_and_every_side_refuses_below_it() -> None:
    l1 = crd_spec()["properties"]["cache"]["properties"]["l1Size"]
    assert any(f"quantity('{c.MIN_L1_SIZE}')) >= 0" in v["rule"] for v in l1["x-kubernetes-validations"])
    for size, accepted in (("63Mi", False), (c.MIN_L1_SIZE, True)):
        policy = {"metadata": {"name": "p"}, "spec": {"cache": {"l1Size": size}}}
        s = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, OperatorDefaults(), "ns")
        assert (not isinstance(s, PolicyError)) is accepted
        try:
            sidecar_settings.load_settings({}, {"cache": {"l1Size": size}})
            sidecar_ok = True
        except sidecar_settings.SettingsError:
            sidecar_ok = False
        assert sidecar_ok is accepted


def operator_accepts(url: str) -> bool:
    policy = {"metadata": {"name": "p"}, "spec": {"l2": {"redis": {"url": url}}}}
    s = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, OperatorDefaults(), "ns")
    return not isinstance(s, PolicyError)


def sidecar_accepts(url: str) -> bool:
    try:
        sidecar_settings.load_settings({}, {"l2": {"redis": {"url": url}}})
    except sidecar_settings.SettingsError:
        return False
    return True


def test_the_crd_checks_urls_with_the_contract_pattern() -> None:
    assert f'self.matches(r"{c.REDIS_URL_PATTERN}")' in crd_url_rules()


@pytest.mark.parametrize(
    ("url", "accepted"),
    [
        ("redis://redis:6379", True),
        ("redis://cache-user@redis.cache:6380/0", True),
        ("redis://[::1]:6379/", True),
        ("rediss://redis:6380", False),  # LMCache's adapter speaks plain Redis
        ("redis://redis:6379/1", False),  # database 0 only
        ("redis://redis:0", False),
        ("redis://redis:65536", False),
        ("redis://redis?db=1", False),
    ],
)
def test_operator_and_sidecar_agree_with_the_rule(url: str, accepted: bool) -> None:
    assert bool(re.fullmatch(c.REDIS_URL_PATTERN, url)) is accepted
    assert operator_accepts(url) is accepted
    assert sidecar_accepts(url) is accepted


URL_PARTS: Any = st.tuples(
    st.sampled_from(["redis://", "rediss://", "http://", "redis:/"]),
    st.sampled_from(["", "user@", "a b@", "u@v@"]),
    st.sampled_from(["redis", "redis.cache.svc", "[::1]", "[fe80::1%eth0]", "", "r#x", "h?"]),
    st.one_of(st.just(""), st.integers(-1, 70000).map(lambda p: f":{p}"), st.sampled_from([":", ":06379", ":x"])),
    st.sampled_from(["", "/", "/0", "/1", "/00", "/0/", "?x=1", "#f"]),
)


@given(URL_PARTS)
def test_every_url_the_rule_admits_the_sidecar_accepts_and_the_rest_everyone_refuses(parts: tuple[str, ...]) -> None:
    url = "".join(parts)
    admitted = bool(re.fullmatch(c.REDIS_URL_PATTERN, url))
    assert operator_accepts(url) is admitted, url
    assert sidecar_accepts(url) is admitted, url


WHOLE_FIELDS = {"l2.fs", "l2.redis", "sidecar.resources"}
"""Object-valued fields a policy reader takes whole."""


def crd_field_paths(schema: dict[str, Any], prefix: str = "") -> dict[str, dict[str, Any]]:
    """Every settable field of the CRD's spec, by dotted path, with its schema."""
    found: dict[str, dict[str, Any]] = {}
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        if sub.get("type") == "object" and path not in WHOLE_FIELDS:
            found.update(crd_field_paths(sub, path + "."))
        else:
            found[path] = sub
    return found


def test_the_crd_spec_has_exactly_the_policy_fields() -> None:
    assert set(crd_field_paths(crd_spec())) == {f.spec_path for f in pol.FIELDS}


def test_the_crd_limits_are_the_policy_modules() -> None:
    fields = crd_field_paths(crd_spec())
    for path, allowed in (("mode", polv.MODES), ("cache.evictionPolicy", polv.EVICTION_POLICIES),
                          ("sidecar.imagePullPolicy", polv.PULL_POLICIES), ("sidecar.gpuAccess", polv.GPU_ACCESS_MODES),
                          ("connector.backend", polv.BACKENDS), ("connector.source", polv.CONNECTOR_SOURCES)):  # fmt: skip
        assert tuple(fields[path]["enum"]) == allowed, path
    ranges = {"cache.chunkSize": (polv.MIN_CHUNK_SIZE, polv.MAX_CHUNK_SIZE), "cache.maxWorkers": (polv.MIN_WORKERS, polv.MAX_WORKERS),
              **{f"connector.{k}TimeoutMs": (polv.MIN_TIMEOUT_MS, polv.MAX_TIMEOUT_MS) for k in ("lookup", "retrieve", "store")}}  # fmt: skip
    for path, (lo, hi) in ranges.items():
        assert (fields[path]["minimum"], fields[path]["maximum"]) == (lo, hi), path
    assert [v["rule"] for v in fields["cache.chunkSize"]["x-kubernetes-validations"]] == [
        f"self % {polv.CHUNK_SIZE_MULTIPLE} == 0"
    ]
    for path in ("shmSize", "cache.l1Size"):
        assert fields[path]["pattern"] == QUANTITY_PATTERN, path
        assert f"quantity('{polv.MAX_QUANTITY}')) <= 0" in fields[path]["x-kubernetes-validations"][0]["rule"]
    l2 = crd_spec()["properties"]["l2"]["properties"]
    assert l2["fs"]["properties"]["size"]["pattern"] == QUANTITY_PATTERN
    assert tuple(v["rule"] for v in l2["fs"]["properties"]["path"]["x-kubernetes-validations"]) == polv.FS_PATH_RULES
    for ref in ("passwordSecretRef", "urlSecretRef"):
        secret = l2["redis"]["properties"][ref]["properties"]["name"]
        assert (secret["pattern"], secret["maxLength"]) == (polv.SECRET_NAME_PATTERN, 253), ref
    for path in ("sidecar.image", "connector.bundleImage"):
        assert (fields[path]["pattern"], fields[path]["maxLength"]) == (polv.IMAGE_PATTERN, polv.MAX_IMAGE_LENGTH)


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/dev/shm", "kvoffload mounts or ships /dev/shm"),
        ("/dev/shm/l2", "kvoffload mounts or ships /dev/shm"),
        ("/var/run/kvoffload", "kvoffload mounts or ships /var/run/kvoffload"),
        ("/opt/kvoffload", "kvoffload mounts or ships /opt/kvoffload"),
        ("/etc/kvoffload/policy", "kvoffload mounts or ships /etc/kvoffload"),
        ("/opt/venv", "kvoffload mounts or ships /opt/venv"),
        ("/", "/ is the container's own system tree"),
        ("/etc", "/etc is the container's own system tree"),
        ("/proc/self", "/proc is the container's own system tree"),
        ("/sys/fs", "/sys is the container's own system tree"),
        ("/dev", "/dev is the container's own system tree"),
        ("/usr/local/l2", "/usr is the container's own system tree"),
        ("/var", "it holds /var/run/kvoffload"),
        ("/opt", "it holds /opt/kvoffload"),
        ("/cache/", "written plainly"),
        ("/a//b", "written plainly"),
        ("/a/./b", "written plainly"),
        ("/var/../etc", "without '..'"),
    ],
)
def test_an_l2_path_colliding_with_kvoffloads_mounts_or_the_system_is_refused_with_the_reason(
    path: str, words: str
) -> None:
    error = polv.read_fs_tier({"path": path, "size": "1Gi"}, "spec.l2.fs")
    assert isinstance(error, polv.PolicyError) and error.field == "spec.l2.fs.path"
    assert words in error.message and repr(path) in error.message


@pytest.mark.parametrize(
    "path", ["/cache", "/var/cache/kvoffload-l2", "/tmp/l2", "/var/runner", "/data/kv", "/mnt/nvme0"]
)
def test_an_l2_directory_of_its_own_is_accepted(path: str) -> None:
    assert polv.read_fs_tier({"path": path, "size": "1Gi"}, "spec.l2.fs") == polv.FsTier(path, 2**30)
