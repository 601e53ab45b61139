"""Settings -> the ``lmcache server`` argv and env."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload import contract
from kvoffload.sidecar.command import build_server_command, l2_adapter_specs
from kvoffload.sidecar.settings import SettingsError, load_settings
from tests.support.cache_keys import policy_keys

pytestmark = pytest.mark.sidecar


def _flag(argv: tuple[str, ...], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_argv_carries_every_setting_and_safe_defaults() -> None:
    s = load_settings(
        {
            contract.ENV_L1_SIZE: "1536Mi",
            contract.ENV_EVICTION_POLICY: "ARC",
            contract.ENV_CHUNK_SIZE: "128",
            contract.ENV_MAX_WORKERS: "3",
            contract.ENV_REQUEST_PORT: "6000",
            contract.ENV_LMCACHE_HTTP_PORT: "6001",
            contract.ENV_INSTANCE_ID: "pod-a",
        },
        None,
    )
    cmd = build_server_command(s, {}, shm_free_bytes=None, python="/py")
    argv = cmd.argv
    assert argv[:4] == ("/py", "-m", "kvoffload.sidecar.lmcache_server", "server"), (
        "LMCache behind the restricted unpickler"
    )
    assert _flag(argv, "--port") == "6000"
    assert _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--http-host") == "127.0.0.1"
    assert _flag(argv, "--http-port") == "6001"
    assert float(_flag(argv, "--l1-size-gb")) == 1.5
    assert _flag(argv, "--eviction-policy") == "ARC"
    assert _flag(argv, "--chunk-size") == "128"
    assert _flag(argv, "--max-workers") == "3"
    assert _flag(argv, "--supported-transfer-mode") == "auto"
    assert _flag(argv, "--worker-reap-timeout-seconds") == _flag(argv, "--worker-registration-grace-seconds") == "120"
    assert _flag(argv, "--instance-id") == "pod-a"
    assert "--l2-adapter" not in argv
    assert cmd.env[contract.ENV_LMCACHE_TRACK_USAGE] == "false"


def test_shm_only_when_dev_shm_holds_all_of_l1() -> None:
    s = load_settings({contract.ENV_L1_SIZE: "1Gi", contract.ENV_INSTANCE_ID: "p"}, None)
    big = build_server_command(s, {}, shm_free_bytes=2**30)
    assert big.uses_shm and _flag(big.argv, "--shm-name") == "kvoffload_p" and "--no-l1-use-lazy" in big.argv
    small = build_server_command(s, {}, shm_free_bytes=2**30 - 1)
    assert not small.uses_shm and "--shm-name" not in small.argv and "--no-l1-use-lazy" not in small.argv
    unknown = build_server_command(s, {}, shm_free_bytes=None)
    assert not unknown.uses_shm


def test_l2_specs_fs_unbounded_sized_and_redis() -> None:
    s = load_settings(
        {contract.ENV_L2_FS_PATH: "/l2", contract.ENV_L2_REDIS_URL: "redis://r:7000"},
        None,
    )
    assert l2_adapter_specs(s) == [
        {"type": "fs", "base_path": "/l2"},
        {"type": "resp", "host": "r", "port": 7000},
    ]
    sized = load_settings({contract.ENV_L2_FS_PATH: "/l2", contract.ENV_L2_FS_SIZE: "512Mi"}, None)
    assert l2_adapter_specs(sized) == [
        {
            "type": "fs_native",
            "base_path": "/l2",
            "max_capacity_gb": 0.5,
            "eviction": {"eviction_policy": "LRU"},
        }
    ]
    argv = build_server_command(s, {}, None).argv
    adapters = [json.loads(argv[i + 1]) for i, a in enumerate(argv) if a == "--l2-adapter"]
    assert [a["type"] for a in adapters] == ["fs", "resp"]


def test_redis_password_goes_by_env_never_argv_and_inherited_secrets_are_dropped() -> None:
    env = {
        contract.ENV_L2_REDIS_URL: "redis://user@r:7000",
        contract.ENV_L2_REDIS_PASSWORD: "hunter2",
        contract.ENV_PROMETHEUS_MULTIPROC_DIR: "/m",
        "LMCACHE_RESP_PASSWORD": "stale",
        "PATH": "/bin",
    }
    cmd = build_server_command(load_settings(env, None), env, None)
    assert not any("hunter2" in a for a in cmd.argv)
    assert cmd.env["LMCACHE_RESP_PASSWORD"] == "hunter2"
    assert cmd.env["LMCACHE_RESP_USERNAME"] == "user"
    assert contract.ENV_L2_REDIS_PASSWORD not in cmd.env
    assert contract.ENV_PROMETHEUS_MULTIPROC_DIR not in cmd.env
    assert cmd.env["PATH"] == "/bin"
    no_redis = build_server_command(load_settings({}, None), {"LMCACHE_RESP_PASSWORD": "stale"}, None)
    assert "LMCACHE_RESP_PASSWORD" not in no_redis.env


def test_track_usage_opt_in() -> None:
    s = load_settings({contract.ENV_LMCACHE_TRACK_USAGE: "true"}, None)
    assert build_server_command(s, {}, None).env[contract.ENV_LMCACHE_TRACK_USAGE] == "true"


def test_node_cache_pod_opens_only_the_request_port_to_other_pods(tmp_path: Path) -> None:
    """Node mode: engines of other pods dial the request port (their keys checked by the server, which
    inherits the keys directory); LMCache's admin API stays on loopback."""
    keys, _ = policy_keys(tmp_path, "p")
    env = {contract.ENV_REQUEST_HOST: "0.0.0.0", contract.ENV_CACHE_KEYS_DIR: str(keys)}
    s = load_settings(env, None)
    command = build_server_command(s, env, shm_free_bytes=None, python="/py")
    assert command.env[contract.ENV_CACHE_KEYS_DIR] == str(keys)
    argv = command.argv
    assert _flag(argv, "--host") == "0.0.0.0"
    assert _flag(argv, "--http-host") == "127.0.0.1"


def test_request_host_must_be_an_ip_address() -> None:
    with pytest.raises(SettingsError, match=contract.ENV_REQUEST_HOST):
        load_settings({contract.ENV_REQUEST_HOST: "every where"}, None)


def test_kv_events_load_kvoffloads_server_module_only_when_a_port_is_set() -> None:
    off = build_server_command(load_settings({}, None), {}, shm_free_bytes=None)
    assert "--server-module" not in off.argv
    on = build_server_command(load_settings({contract.ENV_KV_EVENTS_PORT: "5570"}, None), {}, shm_free_bytes=None)
    spec = json.loads(_flag(on.argv, "--server-module"))
    assert spec == {
        "module_path": "kvoffload.sidecar.kv_events_module",
        "factory_name": "build_server_modules",
        "config": {"host": "0.0.0.0", "port": 5570, "topic": "", "format": "vllm",
                   "journal": f"/var/run/kvoffload/kvoffload.{contract.KV_EVENTS_JOURNAL}"},
    }  # fmt: skip
    assert contract.METRICS_DIR.startswith(contract.RUN_MOUNT_PATH + "/")  # the journal outlives a server restart
    positional = load_settings(
        {contract.ENV_KV_EVENTS_PORT: "5570", contract.ENV_KV_EVENTS_FORMAT: "vllm-positional"}, None
    )
    assert json.loads(_flag(build_server_command(positional, {}, None).argv, "--server-module"))["config"]["format"] == (
        "vllm-positional")  # fmt: skip
    import importlib

    module = importlib.import_module(spec["module_path"])
    assert callable(getattr(module, spec["factory_name"]))


def test_the_kv_events_topic_reaches_the_publisher_and_a_topic_with_spaces_is_refused() -> None:
    env = {contract.ENV_KV_EVENTS_PORT: "5570", contract.ENV_KV_EVENTS_TOPIC: "kv@10.0.0.7:8000@llama"}
    spec = json.loads(_flag(build_server_command(load_settings(env, None), {}, shm_free_bytes=None).argv,
                            "--server-module"))  # fmt: skip
    assert spec["config"]["topic"] == "kv@10.0.0.7:8000@llama"
    with pytest.raises(SettingsError, match=contract.ENV_KV_EVENTS_TOPIC):
        load_settings({**env, contract.ENV_KV_EVENTS_TOPIC: "kv@ pod"}, None)


@pytest.mark.parametrize("raw", ["0", "70000", "events", str(contract.REQUEST_PORT)])
def test_kv_events_port_must_be_a_free_port_number(raw: str) -> None:
    with pytest.raises(Exception, match=contract.ENV_KV_EVENTS_PORT):
        load_settings({contract.ENV_KV_EVENTS_PORT: raw}, None)
