"""The sidecar's settings parser: env + policy spec -> SidecarSettings or one precise line."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import contract
from kvoffload.sidecar.settings import (
    FsTier,
    RedisTier,
    SettingsError,
    load_settings,
    parse_policy_text,
)
from tests.support.cache_keys import policy_keys

pytestmark = pytest.mark.sidecar

GOOD_SPEC = {
    "mode": "sidecar",
    "cache": {"l1Size": "8Gi", "evictionPolicy": "ARC", "chunkSize": 128, "maxWorkers": 2},
    "l2": {
        "fs": {"path": "/var/cache/kvoffload", "size": "100Gi"},
        "redis": {"url": "redis://cache-user@redis.cache:6380/0"},
    },
}


def test_defaults_without_env_or_policy() -> None:
    s = load_settings({}, None)
    assert (s.request_port, s.lmcache_http_port, s.sidecar_http_port) == (
        contract.REQUEST_PORT,
        contract.LMCACHE_HTTP_PORT,
        contract.SIDECAR_HTTP_PORT,
    )
    assert s.l1_size_bytes == 20 * 2**30
    assert (s.eviction_policy, s.chunk_size, s.max_workers) == ("LRU", 256, 4)
    assert s.l2_fs is None and s.l2_redis is None
    assert s.grace_seconds == 25.0
    assert s.track_usage is False
    assert s.metrics_dir == contract.METRICS_DIR
    assert s.shm_name == "kvoffload_kvoffload"


def test_policy_spec_is_read() -> None:
    s = load_settings({contract.ENV_L2_REDIS_PASSWORD: "s3cret"}, GOOD_SPEC, "/p.json")
    assert s.l1_size_bytes == 8 * 2**30
    assert (s.eviction_policy, s.chunk_size, s.max_workers) == ("ARC", 128, 2)
    assert s.l2_fs == FsTier(path="/var/cache/kvoffload", size_bytes=100 * 2**30)
    assert s.l2_redis == RedisTier(host="redis.cache", port=6380, username="cache-user", password="s3cret")
    assert s.policy_file == "/p.json"


def test_env_overrides_policy() -> None:
    env = {
        contract.ENV_L1_SIZE: "1Gi",
        contract.ENV_EVICTION_POLICY: "LRU",
        contract.ENV_CHUNK_SIZE: "512",
        contract.ENV_MAX_WORKERS: "8",
        contract.ENV_L2_FS_PATH: "/data/l2/",
        contract.ENV_L2_FS_SIZE: "",
        contract.ENV_L2_REDIS_URL: "",
        contract.ENV_INSTANCE_ID: "pod-0",
        contract.ENV_GRACE_SECONDS: "7.5",
    }
    s = load_settings(env, GOOD_SPEC)
    assert s.l1_size_bytes == 2**30
    assert (s.eviction_policy, s.chunk_size, s.max_workers) == ("LRU", 512, 8)
    assert s.l2_fs == FsTier(path="/data/l2", size_bytes=None)
    assert s.l2_redis is None
    assert s.shm_name == "kvoffload_pod-0"
    assert s.grace_seconds == 7.5


def test_redis_url_defaults_port_and_password_stays_out_of_describe() -> None:
    env = {contract.ENV_L2_REDIS_URL: "redis://redis", contract.ENV_L2_REDIS_PASSWORD: "pw"}
    s = load_settings(env, None)
    assert s.l2_redis == RedisTier(host="redis", port=6379, username="", password="pw")
    assert "pw" not in repr(s.describe())


BAD = [
    (
        {contract.ENV_L1_SIZE: "lots"},
        None,
        "KVOFFLOAD_L1_SIZE: 'lots' is not allowed; a byte quantity from 64Mi to 1Pi (LMCache's L1 must hold whole chunks), such as 20Gi (suffix Ki, Mi, Gi, Ti, Pi or k, M, G, T, P)",
    ),
    (
        {contract.ENV_L1_SIZE: "0"},
        None,
        "KVOFFLOAD_L1_SIZE: '0' is not allowed; a byte quantity from 64Mi to 1Pi (LMCache's L1 must hold whole chunks), such as 20Gi (suffix Ki, Mi, Gi, Ti, Pi or k, M, G, T, P)",
    ),
    (
        {},
        {"cache": {"l1Size": True}},
        "policy spec.cache.l1Size: True is not allowed; a byte quantity from 64Mi to 1Pi (LMCache's L1 must hold whole chunks), such as 20Gi (suffix Ki, Mi, Gi, Ti, Pi or k, M, G, T, P)",
    ),
    (
        {contract.ENV_EVICTION_POLICY: "FIFO"},
        None,
        "KVOFFLOAD_EVICTION_POLICY: 'FIFO' is not allowed; allowed: LRU, ARC",
    ),
    (
        {},
        {"cache": {"evictionPolicy": "MRU"}},
        "policy spec.cache.evictionPolicy: 'MRU' is not allowed; allowed: LRU, ARC",
    ),
    (
        {contract.ENV_REQUEST_PORT: "70000"},
        None,
        "KVOFFLOAD_REQUEST_PORT: '70000' is not allowed; use a TCP port number from 1 to 65535",
    ),
    (
        {contract.ENV_SIDECAR_HTTP_PORT: "5555"},
        None,
        "KVOFFLOAD_SIDECAR_HTTP_PORT: 5555 is not allowed; it must differ from KVOFFLOAD_REQUEST_PORT",
    ),
    (
        {contract.ENV_CHUNK_SIZE: "-3"},
        None,
        "KVOFFLOAD_CHUNK_SIZE: '-3' is not allowed; an integer from 16 to 65536",
    ),
    (
        {},
        {"cache": {"maxWorkers": 0}},
        "policy spec.cache.maxWorkers: 0 is not allowed; an integer from 1 to 64",
    ),
    (
        {contract.ENV_L2_FS_PATH: "relative/dir"},
        None,
        "KVOFFLOAD_L2_FS_PATH: 'relative/dir' is not allowed; use an absolute path without '..', "
        "e.g. /var/cache/kvoffload",
    ),
    (
        {contract.ENV_L2_FS_SIZE: "10Gi"},
        None,
        "KVOFFLOAD_L2_FS_SIZE: '10Gi' is not allowed; a size needs a filesystem L2 path too "
        "(KVOFFLOAD_L2_FS_PATH or policy l2.fs.path)",
    ),
    (
        {contract.ENV_L2_REDIS_URL: "http://redis:6379"},
        None,
        "KVOFFLOAD_L2_REDIS_URL: 'http://redis:6379' is not allowed; redis://[user@]host[:port][/0] (LMCache's Redis adapter: plain Redis, database 0)",
    ),
    (
        {contract.ENV_L2_REDIS_URL: "redis://u:hunter2@redis:6379"},
        None,
        "KVOFFLOAD_L2_REDIS_URL: 'redis://u:***@redis:6379' is not allowed; keep the password out of the URL (a Secret holds it): redis://[user@]host[:port][/0]",
    ),
    (
        {},
        {"l2": {"redis": {"url": "redis://redis:6379/3"}}},
        "policy spec.l2.redis.url: 'redis://redis:6379/3' is not allowed; redis://[user@]host[:port][/0] (LMCache's Redis adapter uses database 0 only)",
    ),
    (
        {contract.ENV_L2_REDIS_PASSWORD: "pw"},
        None,
        "KVOFFLOAD_L2_REDIS_PASSWORD: is set but no Redis L2 is configured; set KVOFFLOAD_L2_REDIS_URL "
        "or policy l2.redis.url, or unset the password",
    ),
    (
        {contract.ENV_GRACE_SECONDS: "0"},
        None,
        "KVOFFLOAD_GRACE_SECONDS: '0' is not allowed; use a number of seconds greater than 0 and at most 3600",
    ),
    (
        {contract.ENV_LMCACHE_TRACK_USAGE: "maybe"},
        None,
        "LMCACHE_TRACK_USAGE: 'maybe' is not allowed; use true or false",
    ),
    (
        {contract.ENV_INSTANCE_ID: "../etc"},
        None,
        "KVOFFLOAD_INSTANCE_ID: '../etc' is not allowed; use 1-200 characters of letters, digits, '.', "
        "'_' or '-', starting with a letter or digit",
    ),
    ({}, {"cache": "big"}, "policy spec.cache: 'big' is not allowed; an object"),
]


@pytest.mark.parametrize(
    ("env", "spec", "message"), BAD, ids=[m.split(":")[0] + f"-{i}" for i, (_, _, m) in enumerate(BAD)]
)
def test_bad_settings_name_setting_value_and_allowed(env: dict[str, str], spec: dict | None, message: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env, spec)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


def test_policy_text_must_be_a_json_object() -> None:
    with pytest.raises(SettingsError) as info:
        parse_policy_text("[1, 2]", "/etc/p.json")
    assert str(info.value) == (
        "KVOFFLOAD_POLICY_FILE: '/etc/p.json' holds a JSON list; it must hold the KVCachePolicy spec as a JSON object"
    )
    with pytest.raises(SettingsError, match=r"^KVOFFLOAD_POLICY_FILE: '/etc/p.json' is not valid JSON"):
        parse_policy_text("{cache:", "/etc/p.json")


SETTINGS_ENV = [
    contract.ENV_REQUEST_PORT,
    contract.ENV_LMCACHE_HTTP_PORT,
    contract.ENV_SIDECAR_HTTP_PORT,
    contract.ENV_L1_SIZE,
    contract.ENV_EVICTION_POLICY,
    contract.ENV_CHUNK_SIZE,
    contract.ENV_MAX_WORKERS,
    contract.ENV_L2_FS_PATH,
    contract.ENV_L2_FS_SIZE,
    contract.ENV_L2_REDIS_URL,
    contract.ENV_INSTANCE_ID,
    contract.ENV_SHM_NAME,
    contract.ENV_GRACE_SECONDS,
    contract.ENV_PROMETHEUS_MULTIPROC_DIR,
    contract.ENV_LMCACHE_TRACK_USAGE,
]


@given(st.dictionaries(st.sampled_from(SETTINGS_ENV), st.text(max_size=40), max_size=6))
def test_any_env_gives_settings_or_one_line_naming_a_setting(env: dict[str, str]) -> None:
    try:
        settings = load_settings(env, None)
    except SettingsError as exc:
        message = str(exc)
        assert "\n" not in message and "\r" not in message
        assert message.split(":", 1)[0] in env
    else:
        assert settings.l1_size_bytes > 0
        assert 1 <= settings.chunk_size <= 65536
        assert len({settings.request_port, settings.lmcache_http_port, settings.sidecar_http_port}) == 3


policy_values = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 10**6), st.text(max_size=20), st.lists(st.integers(), max_size=2)
)


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "cache": st.one_of(
                policy_values,
                st.fixed_dictionaries(
                    {},
                    optional={
                        "l1Size": policy_values,
                        "evictionPolicy": policy_values,
                        "chunkSize": policy_values,
                        "maxWorkers": policy_values,
                    },
                ),
            ),
            "l2": st.one_of(
                policy_values,
                st.fixed_dictionaries(
                    {},
                    optional={
                        "fs": st.fixed_dictionaries({}, optional={"path": policy_values, "size": policy_values}),
                        "redis": st.fixed_dictionaries({}, optional={"url": policy_values}),
                    },
                ),
            ),
        },
    )
)
def test_any_policy_gives_settings_or_one_line_naming_a_policy_field(spec: dict) -> None:
    try:
        load_settings({}, spec)
    except SettingsError as exc:
        message = str(exc)
        assert "\n" not in message
        assert message.startswith("policy ")


@given(st.integers(1, 2**40), st.sampled_from(["", "Ki", "Mi", "Gi"]))
def test_valid_quantities_parse_to_their_bytes(number: int, suffix: str) -> None:
    scale = {"": 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[suffix]
    if number * scale > 2**50:
        return
    if number * scale < 64 * 2**20:  # contract.MIN_L1_SIZE: refused, naming the minimum
        with pytest.raises(SettingsError, match=f"from {contract.MIN_L1_SIZE} to 1Pi"):
            load_settings({contract.ENV_L1_SIZE: f"{number}{suffix}"}, None)
        return
    assert load_settings({contract.ENV_L1_SIZE: f"{number}{suffix}"}, None).l1_size_bytes == number * scale


def test_an_l2_path_on_kvoffloads_own_mount_is_refused_by_the_sidecar_too() -> None:
    with pytest.raises(SettingsError, match=r"KVOFFLOAD_L2_FS_PATH.*'/dev/shm'.*kvoffload mounts or ships /dev/shm"):
        load_settings({contract.ENV_L2_FS_PATH: "/dev/shm", contract.ENV_L2_FS_SIZE: "1Gi"}, None)


def test_a_port_with_a_control_character_is_refused_not_crashed_on() -> None:
    """Found by the settings fuzz test: re's \\s matched \\x1f, and int() then raised ValueError."""
    with pytest.raises(SettingsError, match=r"KVOFFLOAD_REQUEST_PORT: '0\\x1f' is not allowed"):
        load_settings({contract.ENV_REQUEST_PORT: "0\x1f"}, None)


def test_a_request_port_off_the_loopback_needs_the_policys_keys(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match=rf"{contract.ENV_REQUEST_HOST}: '0.0.0.0' .*{contract.ENV_CACHE_KEYS_DIR}"):
        load_settings({contract.ENV_REQUEST_HOST: "0.0.0.0"}, None)
    with pytest.raises(SettingsError, match=r"server\.public is missing"):
        load_settings({contract.ENV_REQUEST_HOST: "0.0.0.0", contract.ENV_CACHE_KEYS_DIR: str(tmp_path)}, None)
    server_dir, _ = policy_keys(tmp_path, "llama")
    node = load_settings({contract.ENV_REQUEST_HOST: "0.0.0.0", contract.ENV_CACHE_KEYS_DIR: str(server_dir)}, None)
    assert node.cache_keys_dir == str(server_dir)
    assert load_settings({}, None).cache_keys_dir is None  # sidecar mode: loopback, no keys


def test_a_policy_whose_redis_url_is_in_a_secret_takes_it_from_the_env_and_stops_with_one_line_without_it() -> None:
    spec = {"l2": {"redis": {"urlSecretRef": {"name": "redis-url", "key": "url"}}}}
    s = load_settings({contract.ENV_L2_REDIS_URL: "redis://cache-user@redis.cache:6380"}, spec, "/p.json")
    assert s.l2_redis == RedisTier(host="redis.cache", port=6380, username="cache-user", password="")
    for env in ({}, {contract.ENV_L2_REDIS_URL: ""}):
        with pytest.raises(SettingsError) as refused:
            load_settings(env, spec, "/p.json")
        assert "urlSecretRef (Secret redis-url, key url)" in str(refused.value) and "\n" not in str(refused.value)
