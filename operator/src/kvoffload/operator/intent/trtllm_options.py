"""The user's TensorRT-LLM command line as written, and how it gets the options YAML that loads our connector.

Three cases, decided purely from the engine container and the pod's volumes (``plan_options``):

* no options file on the command line: append ``--extra_llm_api_options <our file>``;
* an options file that comes from a ConfigMap volume: merge the user's file into ours and
  point the flag at the merged copy (the original path is remembered in a template
  annotation, so removal can put it back);
* anything else (options baked into the image, an unknown launcher, no command at all):
  change nothing on the command line and tell the user exactly what to add.

Also read here: the model the command line serves, and the args with kvoffload's rewrite undone.
What kvoffload writes (the args, the merged file) is :mod:`kvoffload.operator.plan.options_file`'s.
"""

from __future__ import annotations

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


def set_arg_value(argv: list[str], index: int, value: str) -> None:
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
    found = _configmap_mount(path, container, volumes)
    return (found[1], found[2]) if found else None


def options_mount(path: str, container: Mapping[str, Any], volumes: Sequence[Mapping[str, Any]]
                  ) -> dict[str, Any] | None:  # fmt: skip
    """The mount through which ``container`` reads ``path`` from a ConfigMap volume (its volume,
    mountPath and subPath), read-only: the pod's options init step mounts the file the same way."""
    found = _configmap_mount(path, container, volumes)
    if found is None:
        return None
    mount = {k: found[0][k] for k in ("name", "mountPath", "subPath") if k in found[0]}
    return {**mount, "readOnly": True}


CONFIGMAP_DEFAULT_MODE = 0o644
"""The mode of a ConfigMap volume's files where neither ``defaultMode`` nor the item's ``mode`` says."""


def options_file_mode(path: str, container: Mapping[str, Any], volumes: Sequence[Mapping[str, Any]]) -> int | None:
    """The mode the kubelet gives the options file at ``path`` (its item's ``mode``, else the volume's
    ``defaultMode``, else 0644); None when ``path`` is not in a ConfigMap volume of ``container``."""
    found = _configmap_mount(path, container, volumes)
    if found is None:
        return None
    mount, _, key_name = found
    cm = next(v["configMap"] for v in volumes if v.get("name") == mount.get("name"))
    item: Mapping[str, Any] = next((i for i in cm.get("items") or [] if str(i.get("key")) == key_name), {})
    for mode in (item.get("mode"), cm.get("defaultMode")):
        if isinstance(mode, int) and not isinstance(mode, bool):
            return mode
    return CONFIGMAP_DEFAULT_MODE


def _configmap_mount(path: str, container: Mapping[str, Any], volumes: Sequence[Mapping[str, Any]]
                     ) -> tuple[Mapping[str, Any], str, str] | None:  # fmt: skip
    """(the mount, ConfigMap name, key) when ``path`` lies in a ConfigMap volume mounted in ``container``;
    the deepest such mount."""
    by_name = {v.get("name"): v for v in volumes}
    best: tuple[int, Mapping[str, Any], str, str] | None = None
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
            best = (len(mount_path), mount, str(cm.get("name")), key_name)
    return (best[1], best[2], best[3]) if best else None


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


def strip_injected_args(args: Sequence[str], original_path: str | None) -> list[str]:
    """Undo :func:`kvoffload.operator.plan.options_file.desired_args`: the args as the user wrote them."""
    argv = [str(x) for x in args]
    if len(argv) >= 2 and argv[-2] == APPEND_FLAG and argv[-1] == OPTIONS_PATH and not original_path:
        return argv[:-2]
    found = find_options_arg(argv)
    if found and found[1] == OPTIONS_PATH and original_path:
        set_arg_value(argv, found[0], original_path)
    return argv


@dataclass(frozen=True)
class CommandLine:
    """A container's TensorRT-LLM command line as the user wrote it."""

    args: list[str] | None
    """Its args with kvoffload's rewrite undone, where kvoffload holds them (None: they stand as written)."""
    options: OptionsPlan
    """How our options file would reach it, were it the engine."""
    model: str | None
    """The model it serves, where ``trtllm-serve`` says so plainly."""


def read_command_line(container: Mapping[str, Any], we_own_args: bool, volumes: Sequence[Mapping[str, Any]],
                      original_path: str | None) -> CommandLine:  # fmt: skip
    """``container``'s command line; ``we_own_args``: kvoffload's field manager holds its args (so
    they carry our rewrite, undone with ``original_path``, the user's options path)."""
    args = None
    if we_own_args:
        args = strip_injected_args(container.get("args") or [], original_path)
        container = {**container, "args": args}
    return CommandLine(args, plan_options(container, volumes, original_path), served_model(container))


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
