"""The TensorRT-LLM options merge on the shared floor, and the pod's init step that runs it:
the operator's template-mode file and the pod's own file are the same bytes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvoffload import contract as c
from kvoffload.operator.intent.trtllm_options import connector_options
from kvoffload.operator.plan.options_file import merged_options_yaml
from kvoffload.trtllm_options_init import run
from kvoffload.trtllm_options_merge import merge_options, options_digest, options_yaml, parse_user_options

pytestmark = [pytest.mark.operator, pytest.mark.connector]

OURS_ONLY = (
    "kv_cache_config:\n  enable_block_reuse: true\nkv_connector_config:\n  connector_module: kvoffload.connector.trtllm\n"
    "  connector_scheduler_class: KvoffloadConnectorScheduler\n  connector_worker_class: KvoffloadConnectorWorker\n"
)


@pytest.mark.parametrize(
    ("user", "expected"),
    [
        (None, OURS_ONLY),
        ("", OURS_ONLY),
        ("max_batch_size: 8\nkv_cache_config: {free_gpu_memory_fraction: 0.9}\n",
         "kv_cache_config:\n  enable_block_reuse: true\n  free_gpu_memory_fraction: 0.9\nkv_connector_config:\n"
         "  connector_module: kvoffload.connector.trtllm\n  connector_scheduler_class: KvoffloadConnectorScheduler\n"
         "  connector_worker_class: KvoffloadConnectorWorker\nmax_batch_size: 8\n"),
        ("kv_cache_config: [1]\nkv_connector_config: {connector_module: kvoffload.connector.trtllm, extra: 1}\n",
         OURS_ONLY),
    ],
)  # fmt: skip
def test_the_merge_gives_the_bytes_the_operator_wrote_before_it_moved_to_the_floor(
    user: str | None, expected: str
) -> None:
    """The expected texts are what ``merged_options_yaml`` gave before the merge moved here."""
    parsed = parse_user_options(user)
    assert isinstance(parsed, dict)
    assert options_yaml(merge_options(parsed, connector_options())) == expected
    assert merged_options_yaml(user) == (expected, None)


def test_merge_keeps_user_options_and_adds_ours() -> None:
    user = parse_user_options("max_batch_size: 8\nkv_cache_config: {free_gpu_memory_fraction: 0.9}\n")
    assert isinstance(user, dict)
    merged = merge_options(user, connector_options())
    assert merged["max_batch_size"] == 8
    assert merged["kv_cache_config"] == {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.9}
    assert merged["kv_connector_config"]["connector_module"] == c.CONNECTOR_MODULE
    assert merged["kv_connector_config"]["connector_scheduler_class"] == c.CONNECTOR_SCHEDULER_CLASS


@pytest.mark.parametrize("bad", ["a: [1", "- just\n- a list\n"])
def test_an_unusable_user_file_is_a_one_line_reason(bad: str) -> None:
    reason = parse_user_options(bad)
    assert isinstance(reason, str) and "\n" not in reason
    assert merged_options_yaml(bad) == ("", reason)


def _ours() -> str:
    return json.dumps(connector_options())


def test_the_init_step_writes_the_merged_file_and_says_nothing_when_the_digest_matches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    user = "max_batch_size: 8\n"
    (tmp_path / "user.yaml").write_text(user)
    out = tmp_path / "merged.yaml"
    argv = ["--ours", _ours(), "--out", str(out), "--user-file", str(tmp_path / "user.yaml")]
    assert run([*argv, "--user-digest", options_digest(user)]) == 0
    assert out.read_text() == merged_options_yaml(user)[0]
    assert capsys.readouterr().err == ""
    assert not list(tmp_path.glob("*.partial"))


def test_the_init_step_without_a_user_file_writes_ours_alone(tmp_path: Path) -> None:
    assert run(["--ours", _ours(), "--out", str(tmp_path / "merged.yaml")]) == 0
    assert (tmp_path / "merged.yaml").read_text() == OURS_ONLY


def test_a_user_file_edited_since_the_plan_is_merged_with_one_line_naming_both_digests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    planned, edited = "max_batch_size: 8\n", "max_batch_size: 16\n"
    (tmp_path / "user.yaml").write_text(edited)
    out = tmp_path / "merged.yaml"
    argv = ["--ours", _ours(), "--out", str(out), "--user-file", str(tmp_path / "user.yaml")]
    assert run([*argv, "--user-digest", options_digest(planned)]) == 0
    assert yaml.safe_load(out.read_text())["max_batch_size"] == 16
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and options_digest(planned) in err and options_digest(edited) in err, err


@pytest.mark.parametrize("problem", ["missing", "not yaml", "a list"])
def test_an_unreadable_user_file_exits_non_zero_with_one_line(tmp_path: Path, problem: str) -> None:
    """Run as the pod runs it (``python3 -m``): one line on stderr, status 1, no file for the engine."""
    user = tmp_path / "user.yaml"
    if problem != "missing":
        user.write_text("a: [1" if problem == "not yaml" else "- a\n- b\n")
    out = tmp_path / "merged.yaml"
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload.trtllm_options_init", "--ours", _ours(), "--out", str(out),
         "--user-file", str(user)], capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and str(user) in done.stderr, done.stderr
    assert not out.exists()
