"""The TensorRT-LLM options file an injected engine runs with: kvoffload's keys merged over the
user's file. Pure and shared: the operator writes it into template mode's generated ConfigMap, and
an injected pod's init container (:mod:`kvoffload.trtllm_options_init`) writes it from the user's
ConfigMap inside the pod (admission mode), so no answer of the webhook carries the user's text.

Needs PyYAML (the operator has it; so do TensorRT-LLM's images, where the init step runs).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import yaml


def options_digest(text: str) -> str:
    """The sha256 (hex) naming a user's options file: what an injection record keeps of it."""
    return hashlib.sha256(text.encode()).hexdigest()


def parse_user_options(text: str | None) -> dict[str, Any] | str:
    """The user's options file as a mapping ({} for none or an empty file), or why it is not one
    (a one-line reason)."""
    if not text:
        return {}
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        return "the user's TensorRT-LLM options file is not valid YAML: " + " ".join(str(exc).split())
    if loaded is not None and not isinstance(loaded, dict):
        return "the user's TensorRT-LLM options file is not a YAML mapping"
    return dict(loaded or {})


def merge_options(user: Mapping[str, Any], ours: Mapping[str, Any]) -> dict[str, Any]:
    """``ours`` (``kv_connector_config`` and ``kv_cache_config``) over the user's options: our
    connector replaces theirs, our cache keys go over theirs, everything else stays the user's."""
    merged = dict(user)
    merged["kv_connector_config"] = dict(ours["kv_connector_config"])
    cache_config = merged.get("kv_cache_config")
    merged["kv_cache_config"] = {**(cache_config if isinstance(cache_config, Mapping) else {}),
                                 **ours.get("kv_cache_config", {})}  # fmt: skip
    return merged


def options_yaml(options: Mapping[str, Any]) -> str:
    """The options file's text (keys sorted: the same options always give the same bytes)."""
    return yaml.safe_dump(dict(options), sort_keys=True, default_flow_style=False)
