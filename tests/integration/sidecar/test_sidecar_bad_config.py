"""Bad configuration: the real entry point exits 2 with exactly one line, starting nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload import contract
from tests.support.sidecar_harness import sidecar_env

pytestmark = pytest.mark.sidecar

CASES: list[tuple[str, dict[str, str], str | None, str]] = [
    (
        "l1-size",
        {contract.ENV_L1_SIZE: "20GB"},
        None,
        "KVOFFLOAD_L1_SIZE: '20GB' is not allowed; a byte quantity from 64Mi to 1Pi (LMCache's L1 must hold whole chunks), such as 20Gi (suffix Ki, Mi, Gi, Ti, Pi or k, M, G, T, P)",
    ),
    (
        "l1-size-too-big",
        {contract.ENV_L1_SIZE: "2Pi"},
        None,
        "KVOFFLOAD_L1_SIZE: '2Pi' is not allowed; a byte quantity from 64Mi to 1Pi (LMCache's L1 must hold whole chunks), such as 20Gi (suffix Ki, Mi, Gi, Ti, Pi or k, M, G, T, P)",
    ),
    (
        "eviction",
        {contract.ENV_EVICTION_POLICY: "random"},
        None,
        "KVOFFLOAD_EVICTION_POLICY: 'random' is not allowed; allowed: LRU, ARC",
    ),
    (
        "request-port",
        {contract.ENV_REQUEST_PORT: "http"},
        None,
        "KVOFFLOAD_REQUEST_PORT: 'http' is not allowed; use a TCP port number from 1 to 65535",
    ),
    (
        "http-port-zero",
        {contract.ENV_SIDECAR_HTTP_PORT: "0"},
        None,
        "KVOFFLOAD_SIDECAR_HTTP_PORT: '0' is not allowed; use a TCP port number from 1 to 65535",
    ),
    (
        "chunk-size",
        {contract.ENV_CHUNK_SIZE: "1.5"},
        None,
        "KVOFFLOAD_CHUNK_SIZE: '1.5' is not allowed; an integer from 16 to 65536",
    ),
    (
        "max-workers",
        {contract.ENV_MAX_WORKERS: "1000"},
        None,
        "KVOFFLOAD_MAX_WORKERS: '1000' is not allowed; an integer from 1 to 64",
    ),
    (
        "redis-url-scheme",
        {contract.ENV_L2_REDIS_URL: "rediss://redis:6380"},
        None,
        "KVOFFLOAD_L2_REDIS_URL: 'rediss://redis:6380' is not allowed; redis://[user@]host[:port][/0] (LMCache's Redis adapter speaks plain Redis, not TLS)",
    ),
    (
        "redis-url-port",
        {contract.ENV_L2_REDIS_URL: "redis://redis:99999"},
        None,
        "KVOFFLOAD_L2_REDIS_URL: 'redis://redis:99999' is not allowed; redis://[user@]host[:port][/0] (LMCache's Redis adapter: plain Redis, database 0)",
    ),
    (
        "fs-path",
        {contract.ENV_L2_FS_PATH: "/var/../etc"},
        None,
        "KVOFFLOAD_L2_FS_PATH: '/var/../etc' is not allowed; use an absolute path without '..', "
        "e.g. /var/cache/kvoffload",
    ),
    (
        "fs-size",
        {contract.ENV_L2_FS_PATH: "/var/cache/kvo", contract.ENV_L2_FS_SIZE: "-1Gi"},
        None,
        "KVOFFLOAD_L2_FS_SIZE: '-1Gi' is not allowed; a byte quantity greater than 0 and at most 1Pi, such as 20Gi (suffix Ki, Mi, Gi, Ti, Pi or k, M, G, T, P)",
    ),
    (
        "policy-l2-fs-size",
        {},
        json.dumps({"l2": {"fs": {"path": "/cache", "size": "huge"}}}),
        "policy spec.l2.fs.size: 'huge' is not allowed; a byte quantity greater than 0 and at most 1Pi, such as 20Gi (suffix Ki, Mi, Gi, Ti, Pi or k, M, G, T, P)",
    ),
    (
        "policy-eviction",
        {},
        json.dumps({"cache": {"evictionPolicy": "LFU"}}),
        "policy spec.cache.evictionPolicy: 'LFU' is not allowed; allowed: LRU, ARC",
    ),
    (
        "policy-not-json",
        {},
        "cache: {l1Size: 20Gi}",
        "KVOFFLOAD_POLICY_FILE: '{policy}' is not valid JSON (Expecting value at line 1); "
        "it must hold the KVCachePolicy spec as a JSON object",
    ),
    (
        "grace",
        {contract.ENV_GRACE_SECONDS: "forever"},
        None,
        "KVOFFLOAD_GRACE_SECONDS: 'forever' is not allowed; use a number of seconds greater than 0 and at most 3600",
    ),
]


def _run(env: dict[str, str], argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(argv, env=env, capture_output=True, timeout=60, check=False)


@pytest.mark.parametrize(("name", "extra", "policy", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_config_exits_2_with_one_line(
    tmp_path: Path, name: str, extra: dict[str, str], policy: str | None, message: str
) -> None:
    env = sidecar_env(tmp_path, **extra)
    policy_path = tmp_path / "policy.json"
    if policy is not None:
        policy_path.write_text(policy)
        env[contract.ENV_POLICY_FILE] = str(policy_path)
    result = _run(env, [sys.executable, "-m", "kvoffload.sidecar"])
    assert result.returncode == 2
    assert result.stdout == b""
    assert result.stderr.decode() == "kvoffload-sidecar: " + message.replace("{policy}", str(policy_path)) + "\n"
    assert not (tmp_path / "metrics").exists(), "nothing may start on bad configuration"


def test_missing_explicit_policy_file_via_console_script(tmp_path: Path) -> None:
    script = Path(sys.executable).with_name("kvoffload-sidecar")
    assert script.exists(), f"console script missing: {script} (hack/setup.sh installs the sidecar distribution)"
    env = sidecar_env(tmp_path)
    env[contract.ENV_POLICY_FILE] = str(tmp_path / "nope.json")
    result = _run(env, [str(script)])
    assert result.returncode == 2
    assert result.stderr.decode() == (
        f"kvoffload-sidecar: KVOFFLOAD_POLICY_FILE: '{tmp_path / 'nope.json'}' does not exist; "
        "point it at the mounted policy file or leave it unset\n"
    )


def test_dry_run_prints_the_lmcache_command(tmp_path: Path) -> None:
    env = sidecar_env(tmp_path, **{contract.ENV_L2_FS_PATH: "/cache", contract.ENV_EVICTION_POLICY: "ARC"})
    result = _run(env, [sys.executable, "-m", "kvoffload.sidecar", "--dry-run"])
    assert result.returncode == 0, result.stderr.decode()
    argv = json.loads(result.stdout)["argv"]
    assert argv[argv.index("--eviction-policy") + 1] == "ARC"
    assert json.loads(argv[argv.index("--l2-adapter") + 1]) == {"type": "fs", "base_path": "/cache"}
