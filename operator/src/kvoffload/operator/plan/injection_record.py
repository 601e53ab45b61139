"""The injection record, pure: what the operator decided for one workload (settings, the digest of
the user's options file, node wiring), written on the workload as one annotation, read back by the webhook to
inject each of its pods; the hash naming it and the files it gives the pods; and how to tell a record
kvoffload wrote from one it did not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

from kvoffload import contract as c
from kvoffload.operator.intent.managed_fields import owned_by
from kvoffload.operator.intent.settings import InjectionSettings
from kvoffload.operator.intent.workload import Workload
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan
from kvoffload.operator.plan.node_wiring import NodeCacheWiring
from kvoffload.policy_values import PolicyError
from kvoffload.trtllm_options_merge import options_digest


@dataclass(frozen=True)
class InjectionRecord:
    """What the operator decided for one workload: enough to inject any of its pods."""

    settings: InjectionSettings
    user_options_digest: str | None
    """sha256 of the user's options file the operator checked, never its text: the record travels in
    webhook answers, and the pod's init step reads the file from the ConfigMap itself."""
    node_cache: NodeCacheWiring | None
    operator_version: str
    native_sidecars: bool

    def to_json(self) -> str:
        wiring = None
        if self.node_cache is not None:
            wiring = {"server_url": self.node_cache.server_url, "shm_host_path": self.node_cache.shm_host_path,
                      "pod_labels": dict(self.node_cache.pod_labels)}  # fmt: skip
        document = {"settings": self.settings.as_record(), "user_options_digest": self.user_options_digest,
                    "node_cache": wiring, "operator_version": self.operator_version,
                    "native_sidecars": self.native_sidecars}  # fmt: skip
        return json.dumps(document, sort_keys=True, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> InjectionRecord | str:
        """The record, or why the text is not one (a one-line reason). A record of an earlier version
        holds the user's options text (``user_options_yaml``): read as its digest, so the pods of a
        workload injected before an upgrade are still injected; the operator re-plans such a workload
        (its version changed) and writes the record anew, text gone."""
        try:
            doc = json.loads(text)
            wiring = doc.get("node_cache")
            legacy_text = doc.get("user_options_yaml")
            digest = doc.get("user_options_digest")
            if digest is None and isinstance(legacy_text, str):
                digest = options_digest(legacy_text)
            return cls(
                settings=InjectionSettings.from_record(doc["settings"]),
                user_options_digest=None if digest is None else str(digest),
                node_cache=NodeCacheWiring(**wiring) if wiring else None,
                operator_version=str(doc["operator_version"]),
                native_sidecars=bool(doc["native_sidecars"]),
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            return f"the injection record is not readable: {type(exc).__name__}: {exc}"

    @property
    def cluster(self) -> ClusterInfo:
        return ClusterInfo(native_sidecars=self.native_sidecars, operator_version=self.operator_version)


def record_of(plan: InjectionPlan) -> InjectionRecord:
    return InjectionRecord(
        settings=plan.settings, user_options_digest=plan.user_options_digest, node_cache=plan.node_cache,
        operator_version=plan.cluster.operator_version, native_sidecars=plan.cluster.native_sidecars,
    )  # fmt: skip


SELECTOR_PATH = ("f:spec", "f:selector")
"""A field no write of kvoffload's ever sets: held by its field manager, a whole manifest was applied
under kvoffload's name."""


def foreign_record(workload: Workload) -> PolicyError | None:
    """Why what kvoffload's field manager holds on ``workload`` is not what kvoffload wrote: an
    injection record that does not read as one, or the workload's selector (a manifest applied under
    kvoffload's name). None when nothing says so. Such a workload is left alone, with one Warning: a
    removal would delete the forger's fields (the apiserver refuses a Deployment without its selector,
    again at every retry) and an apply would fail the same way."""
    text = workload.annotations.get(c.ANN_INJECTION_RECORD)
    if text is not None and workload.owns_record:
        parsed = InjectionRecord.from_json(text)
        if isinstance(parsed, str):
            return _left_alone(text, parsed)
    if owned_by(workload.live, SELECTOR_PATH, c.FIELD_MANAGER):
        return _left_alone(text, f"field manager {c.FIELD_MANAGER} holds spec.selector, which kvoffload never "
                                 "writes: the workload was applied under kvoffload's name")  # fmt: skip
    return None


def _left_alone(text: str | None, why: str) -> PolicyError:
    shown = text if text is None or len(text) <= 60 else text[:60] + "..."
    return PolicyError(
        f"metadata.annotations[{c.ANN_INJECTION_RECORD}]", shown,
        f"kvoffload did not write this ({why}); kvoffload leaves the workload alone until the annotation is "
        f"removed and the workload is applied under a field manager of its own, not {c.FIELD_MANAGER}",
        reason="foreign_record",
    )  # fmt: skip


def record_digest(files: Mapping[str, str], record_json: str) -> str:
    """The hash naming a record and the files it gives the pods (``LABEL_INJECT``'s value)."""
    return hashlib.sha256(json.dumps({**files, _RECORD_KEY: record_json}, sort_keys=True).encode()).hexdigest()[:16]


_RECORD_KEY = "injection.json"
"""The record's key beside the files in the hash (the key the ConfigMap of earlier versions used:
an upgrade rolls no pods for the move alone)."""
