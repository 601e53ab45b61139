"""How TensorRT-LLM gets the options YAML that loads our connector.

Three cases, decided purely from the engine container and the pod's volumes:

* no options file on the command line: append ``--extra_llm_api_options <our file>``;
* an options file that comes from a ConfigMap volume: merge the user's file into ours and
  point the flag at the merged copy (the original path is remembered in a template
  annotation, so removal can put it back);
* anything else (options baked into the image, an unknown launcher, no command at all):
  change nothing on the command line and tell the user exactly what to add.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from kvoffload import contract as c

OPTIONS_FLAGS = ("--extra_llm_api_options", "--extra-llm-api-options", "--config")
"""Flags naming the options file; ``--config`` is the newer trtllm-serve spelling."""
APPEND_FLAG = "--extra_llm_api_options"
LAUNCHERS = ("trtllm-serve",)
OPTIONS_PATH = posixpath.join(c.TRTLLM_OPTIONS_MOUNT_PATH, c.TRTLLM_OPTIONS_FILE)


@dataclass(frozen=True)
class AppendFlag:
    """No options file given: append ``--extra_llm_api_options OPTIONS_PATH`` to args."""


@dataclass(frozen=True)
class MergeFromConfigMap:
    """The user's options file is key ``key`` of ConfigMap ``configmap``, passed at ``path``."""

    configmap: str
    key: str
    path: str


@dataclass(frozen=True)
class AlreadyOurs:
    """The command line already names our options file (the user added it themselves)."""


@dataclass(frozen=True)
class ManualStep:
    """We cannot wire it up; ``message`` says exactly what the user must add."""

    message: str


OptionsPlan = AppendFlag | MergeFromConfigMap | AlreadyOurs | ManualStep


def connector_options() -> dict[str, Any]:
    """The TensorRT-LLM options kvoffload needs: our connector and block reuse."""
    return {
        "kv_connector_config": {
            "connector_module": c.CONNECTOR_MODULE,
            "connector_scheduler_class": c.CONNECTOR_SCHEDULER_CLASS,
            "connector_worker_class": c.CONNECTOR_WORKER_CLASS,
        },
        "kv_cache_config": {"enable_block_reuse": True},
    }


def manual_step_message(container: str, reason: str) -> str:
    snippet = yaml.safe_dump(connector_options(), sort_keys=True, default_flow_style=True).strip()
    return (
        f"{reason}; add `{APPEND_FLAG} {OPTIONS_PATH}` to the trtllm-serve command of container "
        f"{container!r} (the operator mounts that file), or merge {snippet} into your own options file"
    )


def find_options_arg(argv: Sequence[str]) -> tuple[int, str] | None:
    """Index of the value of the options flag in ``argv`` and that value, or None."""
    for i, arg in enumerate(argv):
        for flag in OPTIONS_FLAGS:
            if arg == flag and i + 1 < len(argv):
                return i + 1, argv[i + 1]
            if arg.startswith(flag + "="):
                return i, arg[len(flag) + 1 :]
    return None


def _set_arg_value(argv: list[str], index: int, value: str) -> None:
    arg = argv[index]
    for flag in OPTIONS_FLAGS:
        if arg.startswith(flag + "="):
            argv[index] = f"{flag}={value}"
            return
    argv[index] = value


def _launches_trtllm(command: Sequence[str], args: Sequence[str]) -> bool:
    return any(posixpath.basename(str(token)) in LAUNCHERS for token in [*command, *args])


def _configmap_source(path: str, container: Mapping[str, Any], volumes: Sequence[Mapping[str, Any]]
                      ) -> tuple[str, str] | None:  # fmt: skip
    """(ConfigMap name, key) when ``path`` lies in a ConfigMap volume mounted in ``container``."""
    by_name = {v.get("name"): v for v in volumes}
    best: tuple[int, str, str] | None = None
    for mount in container.get("volumeMounts") or []:
        mount_path = str(mount.get("mountPath", "")).rstrip("/")
        volume = by_name.get(mount.get("name"))
        if not volume or "configMap" not in volume:
            continue
        sub_path = mount.get("subPath")
        if sub_path and path == mount_path:
            relative = str(sub_path)
        elif not sub_path and path.startswith(mount_path + "/"):
            relative = path[len(mount_path) + 1 :]
        else:
            continue
        cm = volume["configMap"]
        key_name = relative
        for item in cm.get("items") or []:
            if item.get("path") == relative:
                key_name = str(item.get("key"))
        if "/" in key_name:
            continue
        if best is None or len(mount_path) > best[0]:
            best = (len(mount_path), str(cm.get("name")), key_name)
    return (best[1], best[2]) if best else None


def plan_options(container: Mapping[str, Any], volumes: Sequence[Mapping[str, Any]],
                 original_path: str | None = None) -> OptionsPlan:  # fmt: skip
    """Decide how the engine container gets our options file.

    ``container`` is the engine container with the operator's own args change undone, and
    ``original_path`` the user's options path when an earlier reconcile rewrote it.
    """
    name = str(container.get("name"))
    command = [str(x) for x in container.get("command") or []]
    args = [str(x) for x in container.get("args") or []]
    if find_options_arg(command):
        return ManualStep(
            manual_step_message(name, "the options flag is part of `command`, which kvoffload leaves alone")
        )
    found = find_options_arg(args)
    if found is None:
        if not command:
            return ManualStep(manual_step_message(name, "the container has no `command`, so its launcher is unknown"))
        if not _launches_trtllm(command, args):
            return ManualStep(manual_step_message(name, f"`command` {command} does not run trtllm-serve"))
        return AppendFlag()
    path = original_path or found[1]
    if path == OPTIONS_PATH:
        return AlreadyOurs()
    source = _configmap_source(path, container, volumes)
    if source is None:
        return ManualStep(manual_step_message(name, f"the options file {path} does not come from a ConfigMap volume"))
    return MergeFromConfigMap(configmap=source[0], key=source[1], path=path)


def desired_args(args: Sequence[str], plan: OptionsPlan) -> list[str] | None:
    """The engine container's args with our options file wired in; None when args stay as they are."""
    argv = [str(x) for x in args]
    if isinstance(plan, AppendFlag):
        return [*argv, APPEND_FLAG, OPTIONS_PATH]
    if isinstance(plan, MergeFromConfigMap):
        found = find_options_arg(argv)
        if found is None:  # pragma: no cover - the plan came from these args
            return None
        _set_arg_value(argv, found[0], OPTIONS_PATH)
        return argv
    return None


def strip_injected_args(args: Sequence[str], original_path: str | None) -> list[str]:
    """Undo :func:`desired_args`: the args as the user wrote them."""
    argv = [str(x) for x in args]
    if len(argv) >= 2 and argv[-2] == APPEND_FLAG and argv[-1] == OPTIONS_PATH and not original_path:
        return argv[:-2]
    found = find_options_arg(argv)
    if found and found[1] == OPTIONS_PATH and original_path:
        _set_arg_value(argv, found[0], original_path)
    return argv


SEVERAL_LAYER_GROUPS = (
    ("gpt-oss", "GPT-OSS alternates sliding-window and full-attention layers"),
    ("gemma-2", "Gemma 2 alternates local sliding-window and global attention layers"),
    ("gemma-3", "Gemma 3 alternates local sliding-window and global attention layers"),
    ("gemma3", "Gemma 3 alternates local sliding-window and global attention layers"),
    ("gemma-4", "Gemma 4 alternates local sliding-window and global attention layers"),
    ("qwen3-next", "Qwen3-Next mixes linear-attention and full-attention layers"),
)
"""Model families whose KV cache TensorRT-LLM splits into several layer groups (KVCacheManagerV2,
main's default for them); matched on the model argument's last path element, lower-cased."""


MULTI_HEAD_LATENT_ATTENTION = ("deepseek-v2", "deepseek-v3", "deepseek-r1", "deepseek-v4", "kimi-k2")
"""Model families with multi-head latent attention (one latent head, no value half per layer), which the
connector refuses at engine start; a distilled model of another architecture (``...-Distill-...``) is not one."""


def served_model(container: Mapping[str, Any]) -> str | None:
    """The model ``trtllm-serve [serve] MODEL ...`` serves, or None when the command line does not
    say it plainly (another launcher, or an option before the model)."""
    argv = [str(t) for t in [*(container.get("command") or []), *(container.get("args") or [])]]
    for i, token in enumerate(argv):
        if posixpath.basename(token) in LAUNCHERS:
            rest = argv[i + 1 :]
            if rest[:1] == ["serve"]:
                rest = rest[1:]
            return rest[0] if rest and not rest[0].startswith("-") else None
    return None


def model_layout_problem(model: str) -> str | None:
    """Why kvoffload cannot serve ``model``'s KV cache (several layer groups, or multi-head latent
    attention), or None."""
    name = posixpath.basename(model.rstrip("/")).lower()
    if "distill" not in name and any(family in name for family in MULTI_HEAD_LATENT_ATTENTION):
        return (
            f"{posixpath.basename(model.rstrip('/'))} uses multi-head latent attention (one latent head and no "
            "value half per layer); kvoffload moves key and value halves and the connector would refuse it at "
            "engine start: opt this workload out"
        )
    for family, feature in SEVERAL_LAYER_GROUPS:
        if family in name:
            return (
                f"{feature}, so TensorRT-LLM gives its KV cache several layer groups; kvoffload moves one pool "
                "of uniform blocks and the connector would refuse it at engine start: opt this workload out"
            )
    return None


TRTLLM_DEFAULT_TOKENS_PER_BLOCK = 32
"""``kv_cache_config.tokens_per_block`` when an options file sets none (TensorRT-LLM's ``KvCacheConfig``)."""


@functools.lru_cache(maxsize=256)
def chunk_size_problem(options_yaml: str, chunk_size: int) -> str | None:
    """Why LMCache chunks of ``chunk_size`` tokens cannot hold whole KV blocks of the engine these
    options configure (the connector would refuse them at engine start), or None. Cached: a fleet
    shares a few options files, and parsing one is most of a reconcile's CPU."""
    loaded = yaml.safe_load(options_yaml) or {}
    cache_config = loaded.get("kv_cache_config") if isinstance(loaded, dict) else None
    block = (cache_config or {}).get("tokens_per_block", TRTLLM_DEFAULT_TOKENS_PER_BLOCK)
    if isinstance(block, bool) or not isinstance(block, int) or block <= 0:
        return None  # TensorRT-LLM refuses such a file itself
    if chunk_size % block == 0:
        return None
    source = "its options file" if "tokens_per_block" in (cache_config or {}) else "TensorRT-LLM's default"
    return (
        f"a multiple of the engine's kv_cache_config.tokens_per_block, {block} ({source}): "
        "LMCache chunks hold whole KV blocks"
    )


CAPACITY_POLICY_FOR_CONNECTORS = "GUARANTEED_NO_EVICT"


def user_options_problem(options: Mapping[str, Any]) -> str | None:
    """Why the user's own TensorRT-LLM options cannot run with kvoffload's connector, or None.

    Each is a setting TensorRT-LLM refuses with a KV connector at engine start (or with which it
    ignores the connector's offers), or one kvoffload would otherwise have to change silently.
    """
    connector = options.get("kv_connector_config")
    if isinstance(connector, Mapping) and connector.get("connector_module") not in (None, c.CONNECTOR_MODULE):
        return (f"kv_connector_config: the file already loads connector {connector.get('connector_module')!r}; "
                "TensorRT-LLM runs one KV connector: remove it, or opt this workload out of kvoffload")  # fmt: skip
    if isinstance(connector, Mapping) and connector.get("connector"):
        return (f"kv_connector_config.connector: {connector.get('connector')!r} names a connector preset; "
                "TensorRT-LLM runs one KV connector: remove it, or opt this workload out of kvoffload")  # fmt: skip
    cache = options.get("kv_cache_config")
    cache = cache if isinstance(cache, Mapping) else {}
    if cache.get("enable_block_reuse") is False:
        return ("kv_cache_config.enable_block_reuse: false; a KV connector needs block reuse (without it TensorRT-LLM "
                "ignores every hit), so kvoffload would have to turn it on: set it to true or remove it")  # fmt: skip
    host = cache.get("host_cache_size")
    if isinstance(host, int) and not isinstance(host, bool) and host > 0:
        return (f"kv_cache_config.host_cache_size: {host}; TensorRT-LLM refuses a KV connector with its own host "
                "cache tier (kvoffload is that tier): remove it or set 0")  # fmt: skip
    windows = cache.get("max_attention_window")
    if isinstance(windows, list) and len(set(windows)) > 1:
        return (f"kv_cache_config.max_attention_window: {windows}; TensorRT-LLM refuses a KV connector with "
                "variable sliding-window attention")  # fmt: skip
    scheduler = options.get("scheduler_config")
    policy = scheduler.get("capacity_scheduler_policy") if isinstance(scheduler, Mapping) else None
    if policy not in (None, CAPACITY_POLICY_FOR_CONNECTORS):
        return (f"scheduler_config.capacity_scheduler_policy: {policy!r}; TensorRT-LLM runs a KV connector only "
                f"with {CAPACITY_POLICY_FOR_CONNECTORS}: set that or remove the field")  # fmt: skip
    for key, why in (("pipeline_parallel_size", "pipeline parallelism"), ("max_beam_width", "beam search")):
        value = options.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 1:
            return f"{key}: {value}; TensorRT-LLM's KV connector does not support {why}: set 1 or remove it"
    return None


@functools.lru_cache(maxsize=256)
def merged_options_yaml(user_yaml: str | None) -> tuple[str, str | None]:
    """Our options merged over the user's; (YAML text, error message or None). Cached, as above."""
    base: dict[str, Any] = {}
    if user_yaml:
        try:
            loaded = yaml.safe_load(user_yaml)
        except yaml.YAMLError as exc:
            return "", f"the user's TensorRT-LLM options file is not valid YAML: {exc}"
        if loaded is not None and not isinstance(loaded, dict):
            return "", "the user's TensorRT-LLM options file is not a YAML mapping"
        base = dict(loaded or {})
        problem = user_options_problem(base)
        if problem:
            return "", problem
    ours = connector_options()
    merged = dict(base)
    merged["kv_connector_config"] = ours["kv_connector_config"]
    cache_config = merged.get("kv_cache_config")
    merged["kv_cache_config"] = {**(cache_config if isinstance(cache_config, dict) else {}), "enable_block_reuse": True}
    return yaml.safe_dump(merged, sort_keys=True, default_flow_style=False), None
