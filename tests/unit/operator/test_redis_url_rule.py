"""One Redis L2 URL rule (contract.REDIS_URL_PATTERN) for the CRD, the operator and the sidecar."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import contract as c
from kvoffload.operator.settings import OperatorDefaults, SettingsError, resolve_settings
from kvoffload.sidecar import settings as sidecar_settings

pytestmark = pytest.mark.operator
CRD = Path(__file__).resolve().parents[3] / "charts" / "kvoffload" / "crds" / "kvcachepolicies.yaml"


def crd_url_rules() -> list[str]:
    doc = yaml.safe_load(CRD.read_text())
    spec = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    url = spec["properties"]["l2"]["properties"]["redis"]["properties"]["url"]
    return [v["rule"] for v in url["x-kubernetes-validations"]]


def operator_accepts(url: str) -> bool:
    policy = {"metadata": {"name": "p"}, "spec": {"l2": {"redis": {"url": url}}}}
    s = resolve_settings({c.ANN_ENABLED: "true", c.ANN_POLICY: "p"}, policy, OperatorDefaults(), "ns")
    return not isinstance(s, SettingsError)


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
