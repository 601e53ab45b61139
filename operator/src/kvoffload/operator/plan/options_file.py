"""What kvoffload writes for TensorRT-LLM: the engine's args with our options file wired in, the
options file merged over the user's, and the engine setups it refuses before the pod (a model whose
KV cache it cannot move, a chunk size the engine's blocks do not divide, user options that cannot
run with a KV connector). Pure; the user's command line is read in
:mod:`kvoffload.operator.intent.trtllm_options`."""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from kvoffload import contract as c
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.trtllm_options import (
    APPEND_FLAG,
    OPTIONS_PATH,
    AppendFlag,
    ManualStep,
    MergeFromConfigMap,
    OptionsPlan,
    connector_options,
    find_options_arg,
    set_arg_value,
)
from kvoffload.operator.intent.workload import Container
from kvoffload.operator.plan.containers import SIDECAR_UID
from kvoffload.policy_values import WORKLOAD_DEPENDENT, PolicyError
from kvoffload.trtllm_options_merge import merge_options, options_yaml, parse_user_options


def desired_args(args: Sequence[str], plan: OptionsPlan) -> list[str] | None:
    """The engine container's args with our options file wired in; None when args stay as they are."""
    argv = [str(x) for x in args]
    if isinstance(plan, AppendFlag):
        return [*argv, APPEND_FLAG, OPTIONS_PATH]
    if isinstance(plan, MergeFromConfigMap):
        found = find_options_arg(argv)
        if found is None:  # pragma: no cover - the plan came from these args
            return None
        set_arg_value(argv, found[0], OPTIONS_PATH)
        return argv
    return None


SLIDING_WINDOW_FAMILIES = (
    ("gpt-oss", "GPT-OSS alternates sliding-window and full-attention layers"),
    ("gemma-2", "Gemma 2 alternates local sliding-window and global attention layers"),
    ("gemma-3", "Gemma 3 alternates local sliding-window and global attention layers"),
    ("gemma3", "Gemma 3 alternates local sliding-window and global attention layers"),
    ("gemma-4", "Gemma 4 alternates local sliding-window and global attention layers"),
)
"""Model families whose KV cache KVCacheManagerV2 (main's default for them) splits into one layer
group per attention window: served there (``connector/layout.py``, ``GroupedLayout``); TensorRT-LLM
refuses a KV connector with variable sliding windows on the V1 manager. Matched on the model
argument's last path element, lower-cased."""

NOT_SERVED_HYBRID = (
    ("qwen3-next", "Qwen3-Next mixes linear-attention layers, whose per-request state is a recurrent one and "
     "not per-token KV, with full-attention ones: a prefix cannot be restored from cached KV blocks, so "
     "kvoffload cannot serve it"),
)  # fmt: skip
"""Hybrid families the connector does not serve, and why."""


NOT_SERVED_LATENT_ATTENTION = (
    ("deepseek-v3.2", "DeepSeek-V3.2 adds sparse attention (an indexer cache beside the latent), whose KV layout "
     "TensorRT-LLM's connector path rejects at engine start (\"KV connector layout is not supported\")"),
    ("deepseek-v4", "DeepSeek-V4 keeps KV layer groups of different tokens per block (compressed attention), "
     "which the connector refuses at engine start"),
)  # fmt: skip
"""Latent-attention families the connector does not serve (plain multi-head latent attention, DeepSeek
V2/V3/R1 and Kimi K2, is served: one latent per layer, ``connector/layout.py``)."""


def model_layout_problem(model: str, kv_cache_manager_v1: bool = False) -> str | None:
    """Why kvoffload cannot serve ``model``'s KV cache (sparse, compressed or linear attention; sliding
    windows on the V1 manager, which the options file forces when ``kv_cache_manager_v1``), or None;
    matched on the model argument's last path element, lower-cased."""
    name = posixpath.basename(model.rstrip("/")).lower()
    for family, feature in NOT_SERVED_LATENT_ATTENTION:
        if "distill" not in name and family in name:
            return f"{feature}: opt this workload out"
    for family, feature in NOT_SERVED_HYBRID:
        if family in name:
            return f"{feature}: opt this workload out"
    if kv_cache_manager_v1:
        for family, feature in SLIDING_WINDOW_FAMILIES:
            if family in name:
                return (
                    f"{feature}, which TensorRT-LLM serves with a KV connector only on KVCacheManagerV2, and the "
                    "options file sets kv_cache_config.use_kv_cache_manager_v2: false: remove it"
                )
    return None


def _kv_cache_manager_v1(options: Mapping[str, Any] | None) -> bool:
    """Whether the options file forces TensorRT-LLM's V1 KV cache manager."""
    cache = (options or {}).get("kv_cache_config")
    return isinstance(cache, Mapping) and cache.get("use_kv_cache_manager_v2") is False


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
    if isinstance(windows, list) and len(set(windows)) > 1 and _kv_cache_manager_v1(options):
        return (f"kv_cache_config.max_attention_window: {windows} with use_kv_cache_manager_v2: false; TensorRT-LLM "
                "serves a KV connector with variable sliding-window attention only on KVCacheManagerV2")  # fmt: skip
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
    """Our options merged over the user's, checked; (YAML text, error message or None). The merge
    is the one the pods' init step runs (:mod:`kvoffload.trtllm_options_merge`). Cached, as above."""
    base = parse_user_options(user_yaml)
    if isinstance(base, str):
        return "", base
    problem = user_options_problem(base) if user_yaml else None
    if problem:
        return "", problem
    return options_yaml(merge_options(base, connector_options())), None


@functools.lru_cache(maxsize=256)
def forces_kv_cache_manager_v1(user_yaml: str | None) -> bool:
    """Whether the user's options file sets ``use_kv_cache_manager_v2: false`` (an unreadable file is
    refused by ``merged_options_yaml``). Cached, as the merge is."""
    try:
        loaded = yaml.safe_load(user_yaml) if user_yaml else None
    except yaml.YAMLError:
        return False
    return isinstance(loaded, dict) and _kv_cache_manager_v1(loaded)


def unreadable_in_pod(mode: int, fs_group: int | None) -> str | None:
    """Why the options init step (uid 65532, the pod's ``fsGroup`` its only supplementary group) cannot
    read a user's options file of ``mode``, or None."""
    if mode & 0o004 or (fs_group is not None and mode & 0o040):
        return None
    readers = "its owner" if not mode & 0o040 else "its owner and group (the pod sets no fsGroup)"
    return (f"the file's mode {mode:#o} lets only {readers} read it, and the pod's options init step runs as "
            f"uid {SIDECAR_UID}, which merges the file in admission mode: give it a mode others may read "
            "(the default 0644), or set the pod's securityContext.fsGroup with a group-readable mode")  # fmt: skip


def engine_options(engine: Container, settings: InjectionSettings, user_options_yaml: str | None,
                   merged_in_pod: bool = False) -> tuple[list[str] | None, str | None] | PolicyError:  # fmt: skip
    """The engine's TensorRT-LLM side: (its args to apply or None, the options file it gets), or why
    its model or options cannot run with kvoffload's connector.

    ``merged_in_pod``: the user's file is not at hand (the webhook's pods, planned from a record that
    keeps only its digest); the operator checked it when it planned the record, and the pod's init
    step merges it, so where the engine's options come from a ConfigMap the file is None and the
    checks that read it (its own settings, its block size against the chunk size, a forced V1 KV
    cache manager) are not made again."""
    plan = engine.options
    from_configmap = isinstance(plan, MergeFromConfigMap)
    v1 = from_configmap and not merged_in_pod and forces_kv_cache_manager_v1(user_options_yaml)
    layout_problem = model_layout_problem(engine.model, v1) if engine.model else None
    if layout_problem:
        return PolicyError(f"container {engine.name} model", engine.model, layout_problem, reason="unsupported")
    args = desired_args(engine.spec.get("args") or [], plan)
    if args is None and engine.we_own_args:
        args = list(engine.spec.get("args") or [])  # keep the user's value while we still own the field
    if from_configmap and merged_in_pod:
        return args, None
    text, error = merged_options_yaml(user_options_yaml if from_configmap else None)
    if error:
        assert isinstance(plan, MergeFromConfigMap)
        return PolicyError(f"ConfigMap {plan.configmap} key {plan.key}", "<file>", error, reason="invalid_options")
    # Where the engine's options are known (ours, or merged from the user's ConfigMap), a chunk size
    # its blocks do not divide is refused here, not by the connector when the engine starts.
    chunk_problem = None if isinstance(plan, ManualStep) else chunk_size_problem(text, settings.chunk_size)
    if chunk_problem:
        return PolicyError("cache.chunkSize", settings.chunk_size, chunk_problem, reason=WORKLOAD_DEPENDENT)
    return args, text
