"""Node mode on one machine: two TensorRT-LLM stand-in replicas (separate processes, like two
pods on a node sharing its /dev/shm) use one cache server; replica B gets replica A's prefix.

The server is the real sidecar configured as the operator configures a node cache pod
(request port on all addresses, the policy's CURVE keys); the replicas dial it on a non-loopback
address with the policy's client keys, as engines in other pods dial the node-local Service.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvoffload import contract
from tests.support.cache_keys import policy_keys
from tests.support.connector_env import SHARED_CORES_LOOKUP_TIMEOUT_MS
from tests.support.sidecar_harness import Sidecar
from tests.support.trtllm_executor import BLOCK, CHUNK, make_prompt

pytestmark = [pytest.mark.sidecar, pytest.mark.connector]
REPO = Path(__file__).resolve().parents[3]


def _node_address() -> str:
    """This machine's first non-loopback IPv4 address (127.0.0.1 when it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.254", 9))  # no packet is sent for a UDP connect
            address = str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"
    return address if not address.startswith("127.") else "127.0.0.1"


def _replica(tmp_path: Path, name: str, url: str, model: str, phases: list[Any], keys: Path) -> dict[str, Any]:
    """One stand-in engine process with the env node mode injects; its report."""
    workdir = tmp_path / name
    workdir.mkdir()
    options = workdir / contract.TRTLLM_OPTIONS_FILE
    options.write_text(yaml.safe_dump({
        "kv_cache_config": {"enable_block_reuse": True, "tokens_per_block": BLOCK},
        "kv_connector_config": {
            "connector_module": contract.CONNECTOR_MODULE,
            "connector_scheduler_class": contract.CONNECTOR_SCHEDULER_CLASS,
            "connector_worker_class": contract.CONNECTOR_WORKER_CLASS,
        },
    }))  # fmt: skip
    prompts = workdir / "prompts.json"
    prompts.write_text(json.dumps(phases))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env.update({
        contract.ENV_SERVER_URL: url,
        contract.ENV_CACHE_KEYS_DIR: str(keys),
        contract.ENV_BACKEND: contract.BACKEND_SIDECAR,
        contract.ENV_PYTHONHASHSEED: "0",
        contract.ENV_PROMETHEUS_MULTIPROC_DIR: str(workdir),
        contract.ENV_LOOKUP_TIMEOUT_MS: str(SHARED_CORES_LOOKUP_TIMEOUT_MS),
        contract.ENV_PYTHONPATH: os.pathsep.join([str(REPO), str(REPO / "tests" / "standin")]),
    })  # fmt: skip
    out = workdir / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.support.trtllm_executor", "--options", str(options), "--model", model,
         "--prompts", str(prompts), "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(out.read_text())  # type: ignore[no-any-return]


def test_replica_b_gets_replica_as_prefix_from_the_shared_node_cache(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    address = _node_address()
    server_keys, engine_keys = policy_keys(tmp_path / "keys", "shared")
    sidecar = make_sidecar(**{contract.ENV_REQUEST_HOST: "0.0.0.0", contract.ENV_CHUNK_SIZE: str(CHUNK),
                              contract.ENV_CACHE_KEYS_DIR: str(server_keys)})  # fmt: skip
    sidecar.wait_ready()
    url = f"tcp://{address}:{sidecar.request_port}"
    p1 = make_prompt(41, 200)
    p2 = p1 + make_prompt(42, 70)

    a = _replica(
        tmp_path,
        "replica-a",
        url,
        "shared-model",
        [[{"request_id": 1, "prompt": p1, "max_new_tokens": 3}]],
        engine_keys,
    )
    (ra,) = a["phases"][0]["results"]
    assert not ra["failed"] and ra["connector_matched_tokens"] == 0 and ra["computed_prompt_tokens"] == len(p1)

    b = _replica(
        tmp_path,
        "replica-b",
        url,
        "shared-model",
        [[{"request_id": 1, "prompt": p2, "max_new_tokens": 3}]],
        engine_keys,
    )
    (rb,) = b["phases"][0]["results"]
    hit = (len(p1) // CHUNK) * CHUNK
    assert not rb["failed"] and b["kv_mismatches"] == 0
    assert rb["connector_matched_tokens"] == hit  # computed by A, loaded by B
    assert rb["computed_prompt_tokens"] == len(p2) - hit

    # Keys are scoped by model: another model on the same node cache never hits A's blocks.
    other = _replica(
        tmp_path, "replica-c", url, "other-model", [[{"request_id": 1, "prompt": p2, "max_new_tokens": 3}]], engine_keys
    )
    (rc,) = other["phases"][0]["results"]
    assert rc["connector_matched_tokens"] == 0 and rc["computed_prompt_tokens"] == len(p2)


def test_an_engine_killed_mid_store_leaves_the_other_engines_of_the_node_nothing_wrong(
    make_sidecar: Callable[..., Sidecar], tmp_path: Path
) -> None:
    """Node mode, issue 49: engine A is killed (SIGKILL) between a store's PREPARE and its COMMIT;
    engine B, another pod on the node, then runs the same prompt: it is offered nothing A did not
    commit and computes bit-exact; C after it loads what B committed, bit-exact. (The node cache
    runs without LMCache's reaper, so A's reservation stays staged, never published.)"""
    server_keys, engine_keys = policy_keys(tmp_path / "keys", "killed")
    sidecar = make_sidecar(**{contract.ENV_REQUEST_HOST: "0.0.0.0", contract.ENV_CHUNK_SIZE: str(CHUNK),
                              contract.ENV_CACHE_KEYS_DIR: str(server_keys)})  # fmt: skip
    sidecar.wait_ready()
    url = f"tcp://{_node_address()}:{sidecar.request_port}"
    tokens = 8 * CHUNK
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFLOAD_")}
    env[contract.ENV_CACHE_KEYS_DIR] = str(engine_keys)
    dying = subprocess.run(
        [sys.executable, "-m", "tests.support.dying_engine", url, "node-killed-model", "95", str(tokens)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert dying.returncode == -signal.SIGKILL, dying.stdout + dying.stderr
    phase = [[{"request_id": 1, "prompt": make_prompt(95, tokens), "max_new_tokens": 3}]]
    b = _replica(tmp_path, "replica-b", url, "node-killed-model", phase, engine_keys)
    (rb,) = b["phases"][0]["results"]
    assert not rb["failed"] and rb["connector_matched_tokens"] == 0, "offered what the killed engine never committed"
    assert b["kv_mismatches"] == 0
    c = _replica(tmp_path, "replica-c", url, "node-killed-model", phase, engine_keys)
    (rc,) = c["phases"][0]["results"]
    assert not rc["failed"] and c["kv_mismatches"] == 0
