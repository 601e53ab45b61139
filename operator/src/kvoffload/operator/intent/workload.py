"""The workload as the user wrote it, read once: ``read_workload(obj) -> Workload``.

Everything the decision, the plan and the renderer need from a Deployment or StatefulSet (its
identity, its annotations, its containers with kvoffload's own additions undone, the user's
volumes and pod-level fields, and who owns them) is read here, from the object and its
``metadata.managedFields``; the stages after it take the typed value, never the raw object. A
manifest without managedFields (a pod seen by the webhook, a dry run) is all the user's.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload import contract as c
from kvoffload.operator.intent.managed_fields import TEMPLATE_META, TEMPLATE_SPEC, FieldOwners, field_owners
from kvoffload.operator.intent.trtllm_options import CommandLine, OptionsPlan, read_command_line

SUPPORTED_KINDS = {"Deployment": "apps/v1", "StatefulSet": "apps/v1"}
GPU_RESOURCE = "nvidia.com/gpu"
OUR_CONTAINERS = (c.SIDECAR_CONTAINER, c.BUNDLE_INIT_CONTAINER, c.OPTIONS_INIT_CONTAINER)
OUR_VOLUMES = (c.VOLUME_SHM, c.VOLUME_RUN, c.VOLUME_BUNDLE, c.VOLUME_TRTLLM_OPTIONS, c.VOLUME_POLICY, c.VOLUME_L2_FS)
RECORD_PATH = ("f:metadata", "f:annotations", f"f:{c.ANN_INJECTION_RECORD}")
ADMISSION_LABEL_PATH = (*TEMPLATE_META, "f:labels", f"f:{c.LABEL_INJECT}")
"""Where admission mode's record and the template label naming its hash live in fieldsV1."""


def key(**fields: object) -> str:
    """The fieldsV1 key of one associative-list item, e.g. ``k:{"name":"trtllm"}``."""
    return "k:" + json.dumps(fields, separators=(",", ":"), sort_keys=True)


def container_path(list_name: str, name: str) -> tuple[str, ...]:
    """The fieldsV1 path of one container (``containers`` or ``initContainers``) of the pod template."""
    return (*TEMPLATE_SPEC, f"f:{list_name}", key(name=name))


def configmap_name(workload_name: str) -> str:
    """The generated ConfigMap of a workload (template mode)."""
    return workload_name + c.GENERATED_CONFIGMAP_SUFFIX


def conflict_path(list_name: str, container: str, field_name: str) -> str:
    """A field path as the apiserver spells it in an SSA conflict."""
    return f'.spec.template.spec.{list_name}[name="{container}"].{field_name}'


@dataclass(frozen=True)
class WorkloadRef:
    """Which workload: what Events, locks, retries and writes name it by."""

    kind: str
    namespace: str
    name: str
    uid: str = ""
    resource_version: str | None = None
    """The version read (an Event's ``involvedObject`` names it; None where none was read)."""

    def __str__(self) -> str:
        return f"{self.kind}/{self.namespace}/{self.name}"

    @property
    def api_version(self) -> str:
        return SUPPORTED_KINDS.get(self.kind, "apps/v1")

    def apply_body(self) -> dict[str, Any]:
        """A Server-Side Apply body naming the workload and nothing else."""
        return {"apiVersion": self.api_version, "kind": self.kind,
                "metadata": {"name": self.name, "namespace": self.namespace}}  # fmt: skip


@dataclass(frozen=True)
class Container:
    """One container of the pod template as the user wrote it: where kvoffload owns the args they
    are the user's again, and env entries and mounts are the user's only."""

    spec: Mapping[str, Any]
    we_own_args: bool
    """kvoffload's field manager owns the args (it rewrote the options path or appended it)."""
    options: OptionsPlan
    """How our options file would reach it, were it the engine."""
    model: str | None
    """The model its ``trtllm-serve`` command line serves, where it says so plainly."""

    @property
    def name(self) -> str:
        return str(self.spec.get("name"))

    @property
    def ours(self) -> bool:
        """One of kvoffload's own containers (the cache server, the bundle's init container)."""
        return self.name in OUR_CONTAINERS

    @property
    def requests_gpu(self) -> bool:
        resources = self.spec.get("resources") or {}
        return any(GPU_RESOURCE in (resources.get(kind) or {}) for kind in ("limits", "requests"))


@dataclass(frozen=True)
class PodFields:
    """The pod template's own fields that decide how the injection may land, with who holds them."""

    host_network: bool
    process_namespace_kept_apart: bool
    """The user set ``shareProcessNamespace: false`` (another manager owns it)."""
    runtime_class_name: str | None
    runtime_class_is_users: bool
    annotations: Mapping[str, str]
    """The template's annotations."""
    users_annotations: frozenset[str]
    """Those of the template's annotations another manager owns."""
    fs_group: int | None = None
    """``securityContext.fsGroup``: every container's supplementary group, owner of its volumes' files."""


@dataclass(frozen=True)
class Workload:
    """A Deployment or StatefulSet as kvoffload reads it (see the module's docstring)."""

    ref: WorkloadRef
    generation: object
    deleting: bool
    annotations: Mapping[str, str]
    containers: tuple[Container, ...]
    """Every container of the template, in order (kvoffload's own included: see ``Container.ours``)."""
    reserved_name_taken: tuple[str, str] | None
    """(list, name) where a container of the user's carries a name kvoffload reserves, if anywhere."""
    volumes: tuple[Mapping[str, Any], ...]
    """The user's volumes."""
    pod: PodFields
    original_options_path: str | None
    """The user's options path, where kvoffload rewrote it."""
    template_injected: bool
    """kvoffload owns the injection inside the pod template (template mode's mark)."""
    owns_record: bool
    """kvoffload owns the admission record (an annotation of the workload)."""
    owns_admission_label: bool
    """kvoffload owns the template label naming the record's hash."""
    manages_anything: bool
    """kvoffload's field manager has any field of the object."""
    live: Mapping[str, Any]
    """The object as read: drift checks compare the apply bodies with it."""
    status_observed: bool = True
    """Its controller has written a status (``status.observedGeneration``) for some generation; False
    for a workload just created, whose controller's first status write is still to come."""

    @property
    def user_containers(self) -> tuple[Container, ...]:
        """The containers that are the user's, kvoffload's own left out."""
        return tuple(x for x in self.containers if not x.ours)

    @property
    def holds_admission_keys(self) -> bool:
        """kvoffload owns both the admission record and the template label naming its hash."""
        return self.owns_record and self.owns_admission_label


def read_workload(obj: Mapping[str, Any]) -> Workload:
    """The workload's facts, read once from the object (any kind: the plan judges its shape)."""
    meta = obj.get("metadata") or {}
    template = (obj.get("spec") or {}).get("template") or {}
    spec = template.get("spec") or {}
    template_annotations = (template.get("metadata") or {}).get("annotations") or {}
    held = _Held(field_owners(obj))
    original = None
    if held.ours((*TEMPLATE_META, "f:annotations", f"f:{c.ANN_ORIGINAL_OPTIONS_PATH}")):
        original = template_annotations.get(c.ANN_ORIGINAL_OPTIONS_PATH)
    volumes = tuple(v for v in spec.get("volumes") or [] if held.users((*TEMPLATE_SPEC, "f:volumes",
                                                                         key(name=v.get("name")))))  # fmt: skip
    ref = WorkloadRef(str(obj.get("kind")), str(meta.get("namespace")), str(meta.get("name")),
                      str(meta.get("uid") or ""), meta.get("resourceVersion"))  # fmt: skip
    reserved, pod = _reserved_name_taken(held, spec), _pod_fields(held, spec, template_annotations)
    views = [_users_view(held, x) for x in spec.get("containers") or []]
    lines = [read_command_line(view, we_own_args, volumes, original) for view, we_own_args in views]
    return Workload(
        ref=ref, generation=meta.get("generation"), deleting=bool(meta.get("deletionTimestamp")),
        annotations=meta.get("annotations") or {}, reserved_name_taken=reserved, volumes=volumes, pod=pod,
        original_options_path=original, template_injected=held.ours((*TEMPLATE_META, "f:labels",
                                                                     f"f:{c.LABEL_INJECTED}")),
        owns_record=held.ours(RECORD_PATH), owns_admission_label=held.ours(ADMISSION_LABEL_PATH),
        manages_anything=held.any_ours(), live=obj,
        status_observed="observedGeneration" in (obj.get("status") or {}),
        containers=tuple(_container(view, owned, line) for (view, owned), line in zip(views, lines, strict=True)),
    )  # fmt: skip


@dataclass(frozen=True)
class _Held:
    """Lookups in the object's field owners (None: no managedFields, everything is the user's)."""

    owners: FieldOwners | None

    def users(self, path: Sequence[str]) -> bool:
        """Whether a manager other than kvoffload's holds ``path``."""
        return self.owners is None or bool(self.owners.get(tuple(path), frozenset()) - {c.FIELD_MANAGER})

    def ours(self, path: Sequence[str]) -> bool:
        return self.owners is not None and c.FIELD_MANAGER in self.owners.get(tuple(path), frozenset())

    def any_ours(self) -> bool:
        return self.owners is not None and any(c.FIELD_MANAGER in m for m in self.owners.values())


def _users_view(held: _Held, container: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """(the container with only the user's env entries and mounts, whether kvoffload holds its args)."""
    at = container_path("containers", str(container.get("name")))
    view = copy.deepcopy(dict(container))
    view["env"] = [e for e in container.get("env") or [] if held.users((*at, "f:env", key(name=e.get("name"))))]
    view["volumeMounts"] = [m for m in container.get("volumeMounts") or []
                            if held.users((*at, "f:volumeMounts", key(mountPath=m.get("mountPath"))))]  # fmt: skip
    return view, held.ours((*at, "f:args"))


def _container(view: dict[str, Any], we_own_args: bool, line: CommandLine) -> Container:
    if line.args is not None:
        view["args"] = line.args
    return Container(view, we_own_args, line.options, line.model)


def _reserved_name_taken(held: _Held, spec: Mapping[str, Any]) -> tuple[str, str] | None:
    for list_name in ("containers", "initContainers"):
        for x in spec.get(list_name) or []:
            if x.get("name") in OUR_CONTAINERS and held.users(container_path(list_name, str(x.get("name")))):
                return list_name, str(x.get("name"))
    return None


def _pod_fields(held: _Held, spec: Mapping[str, Any], annotations: Mapping[str, str]) -> PodFields:
    return PodFields(
        host_network=spec.get("hostNetwork") is True,
        process_namespace_kept_apart=spec.get("shareProcessNamespace") is False
        and held.users((*TEMPLATE_SPEC, "f:shareProcessNamespace")),
        runtime_class_name=spec.get("runtimeClassName"),
        runtime_class_is_users=held.users((*TEMPLATE_SPEC, "f:runtimeClassName")),
        annotations=annotations,
        users_annotations=frozenset(k for k in annotations if held.users((*TEMPLATE_META, "f:annotations", f"f:{k}"))),
        fs_group=_int_or_none((spec.get("securityContext") or {}).get("fsGroup")),
    )


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
