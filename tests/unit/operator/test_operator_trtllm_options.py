"""How TensorRT-LLM gets our options file: append, merge from a ConfigMap, or a manual step."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload import contract as c
from kvoffload.operator.intent.trtllm_options import (
    OPTIONS_PATH,
    AlreadyOurs,
    AppendFlag,
    ManualStep,
    MergeFromConfigMap,
    plan_options,
    strip_injected_args,
)
from kvoffload.operator.plan.options_file import desired_args, merged_options_yaml

pytestmark = pytest.mark.operator
SERVE = ["trtllm-serve"]
CM_VOLUME = {"name": "cfg", "configMap": {"name": "llm-options"}}


def engine(args: list[str], command: list[str] | None = None, mounts: list[dict[str, Any]] | None = None
           ) -> dict[str, Any]:  # fmt: skip
    return {"name": "trtllm", "command": SERVE if command is None else command, "args": args,
            "volumeMounts": mounts or []}  # fmt: skip


@pytest.mark.parametrize(
    ("container", "volumes", "expected"),
    [
        (engine(["model"]), [], AppendFlag()),
        (engine([], command=["trtllm-serve", "serve", "model"]), [], AppendFlag()),
        (engine(["serve", "model"], command=["/usr/local/bin/trtllm-serve"]), [], AppendFlag()),
        (engine(["model", "--extra_llm_api_options", "/config/o.yaml"], mounts=[{"name": "cfg", "mountPath": "/config"}]),
         [CM_VOLUME], MergeFromConfigMap("llm-options", "o.yaml", "/config/o.yaml")),
        (engine(["model", "--config=/config/o.yaml"], mounts=[{"name": "cfg", "mountPath": "/config/"}]),
         [CM_VOLUME], MergeFromConfigMap("llm-options", "o.yaml", "/config/o.yaml")),
        (engine(["model", "--extra-llm-api-options", "/etc/o.yaml"],
                mounts=[{"name": "cfg", "mountPath": "/etc/o.yaml", "subPath": "options"}]),
         [CM_VOLUME], MergeFromConfigMap("llm-options", "options", "/etc/o.yaml")),
        (engine(["model", "--extra_llm_api_options", "/config/file.yaml"],
                mounts=[{"name": "cfg", "mountPath": "/config"}]),
         [{"name": "cfg", "configMap": {"name": "m", "items": [{"key": "real-key", "path": "file.yaml"}]}}],
         MergeFromConfigMap("m", "real-key", "/config/file.yaml")),
        (engine(["model", "--extra_llm_api_options", OPTIONS_PATH]), [], AlreadyOurs()),
    ],
)  # fmt: skip
def test_plan(container: dict[str, Any], volumes: list[dict[str, Any]], expected: object) -> None:
    assert plan_options(container, volumes) == expected


@pytest.mark.parametrize(
    ("container", "volumes", "says"),
    [
        (engine(["model", "--extra_llm_api_options", "/app/o.yaml"]), [], "does not come from a ConfigMap"),
        (engine(["model", "--extra_llm_api_options", "/data/o.yaml"], mounts=[{"name": "d", "mountPath": "/data"}]),
         [{"name": "d", "emptyDir": {}}], "does not come from a ConfigMap"),
        (engine([], command=["trtllm-serve", "m", "--config", "/x.yaml"]), [], "part of `command`"),
        (engine(["model"], command=[]), [], "no `command`"),
        (engine(["-m", "my_server"], command=["python"]), [], "does not run trtllm-serve"),
    ],
)  # fmt: skip
def test_manual_step_says_exactly_what_to_add(container: dict[str, Any], volumes: list[dict[str, Any]], says: str
                                              ) -> None:  # fmt: skip
    plan = plan_options(container, volumes)
    assert isinstance(plan, ManualStep)
    assert says in plan.message
    assert f"--extra_llm_api_options {OPTIONS_PATH}" in plan.message and c.CONNECTOR_MODULE in plan.message


def test_append_and_strip_round_trip() -> None:
    args = ["model", "--port", "8000"]
    injected = desired_args(args, AppendFlag())
    assert injected == [*args, "--extra_llm_api_options", OPTIONS_PATH]
    assert strip_injected_args(injected or [], None) == args


@pytest.mark.parametrize("flag_style", ["separate", "equals"])
def test_rewrite_and_restore_round_trip(flag_style: str) -> None:
    args = ["model", "--config", "/config/o.yaml"] if flag_style == "separate" else ["model", "--config=/config/o.yaml"]
    plan = MergeFromConfigMap("m", "o.yaml", "/config/o.yaml")
    injected = desired_args(args, plan)
    assert injected is not None and OPTIONS_PATH in " ".join(injected)
    assert strip_injected_args(injected, "/config/o.yaml") == args


def test_merge_never_silently_changes_a_users_setting() -> None:
    for user in ("kv_cache_config: {enable_block_reuse: false}\n", "kv_connector_config: {connector_module: other}\n"):
        text, error = merged_options_yaml(user)
        assert text == "" and error and error.split(".")[0].split(":")[0] in user, (user, error)


ARGS = st.lists(st.sampled_from(["model", "--port", "8000", "--config", "/c/o.yaml", "--tp_size", "2", "x"]),
                max_size=8)  # fmt: skip


@given(ARGS)
def test_fuzz_append_strip_is_identity(args: list[str]) -> None:
    injected = desired_args(args, AppendFlag())
    assert injected is not None and strip_injected_args(injected, None) == args
