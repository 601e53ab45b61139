"""The reconcile effects against a scripted fake API: what is applied, forced, reported."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvoffload import contract as c
from kvoffload.operator.api.events import EventRecorder
from kvoffload.operator.api.kube import KubeApiError, workload_path
from kvoffload.operator.control.reconcile import Reconciler
from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
from kvoffload.operator.metrics import OperatorMetrics
from kvoffload.operator.plan.fragment import ClusterInfo, RenderedInjection, render_injection_fragment
from tests.unit.operator.workload_builders import applied, deployment

pytestmark = pytest.mark.operator
ARGS_FIELD = '.spec.template.spec.containers[name="trtllm"].args'


def conflict(*fields: str, manager: str = "kubectl-client-side-apply") -> KubeApiError:
    causes = [{"reason": "FieldManagerConflict", "field": f, "message": f'conflict with "{manager}"'} for f in fields]
    return KubeApiError(409, {"reason": "Conflict", "details": {"causes": causes}}, "PATCH", "/x")


@dataclass
class FakeKube:
    """Records calls; ``apply_errors`` are raised by successive workload applies."""

    apply_errors: list[KubeApiError | None] = field(default_factory=list)
    calls: list[tuple[str, str, bool]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    versions: list[object] = field(default_factory=list)
    """``metadata.resourceVersion`` of each workload apply body (None: no optimistic lock)."""
    served: dict[str, dict[str, Any]] = field(default_factory=dict)
    """What the apiserver holds for a workload when ``objects`` does not say: the object the last
    pass over it was handed (``ServedReconciler``); clear it to delete the workload."""

    def apply(self, path: str, body: Mapping[str, Any], field_manager: str, force: bool = False) -> dict[str, Any]:
        self.calls.append(("apply", path, force))
        if "/configmaps/" not in path:
            self.versions.append((body.get("metadata") or {}).get("resourceVersion"))
        if "/configmaps/" in path:
            return dict(body)
        if self.apply_errors:
            error = self.apply_errors.pop(0)
            if error is not None:
                raise error
        return {"metadata": {"generation": 2}}

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self.events.append(dict(body))
        return dict(body)

    def get(self, path: str) -> dict[str, Any] | None:
        return self.objects.get(path, self.served.get(path))

    def delete(self, path: str) -> bool:
        self.calls.append(("delete", path, False))
        return True

    def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        return {"items": []}

    def merge_patch(self, path: str, body: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        return {}


class ServedReconciler(Reconciler):
    """A Reconciler over a ``FakeKube`` that holds each workload as the pass over it was handed (the
    apply reads the workload first to lock to its newest version); a test pins another in ``objects``."""

    def reconcile(self, obj: Mapping[str, Any], force: bool = False) -> str:
        meta = obj["metadata"]
        self.kube.served[workload_path(obj["kind"], meta["namespace"], meta["name"])] = dict(obj)  # type: ignore[attr-defined]
        return super().reconcile(obj, force)


def reconciler(kube: FakeKube, normal_events: bool = True) -> tuple[Reconciler, OperatorMetrics]:
    metrics = OperatorMetrics()
    r = ServedReconciler(kube=kube, defaults=OperatorDefaults(), cluster=ClusterInfo(True), metrics=metrics,  # type: ignore[arg-type]
                   events=EventRecorder(kube, normal=normal_events))  # type: ignore[arg-type]  # fmt: skip
    return r, metrics


def enabled(**extra: str) -> dict[str, Any]:
    return deployment(annotations={c.ANN_ENABLED: "true", **extra})


def workload_applies(kube: FakeKube) -> list[bool]:
    return [force for op, path, force in kube.calls if op == "apply" and "/deployments/" in path]


def test_only_an_args_conflict_is_forced() -> None:
    kube = FakeKube(apply_errors=[conflict(ARGS_FIELD)])
    r, _ = reconciler(kube)
    assert r.reconcile(enabled()) == "applied"
    assert workload_applies(kube) == [False, True]
    assert [e["reason"] for e in kube.events] == ["KvoffloadInjected"]


def test_by_default_an_injection_posts_no_event_but_a_rejection_posts_its_warning() -> None:
    kube = FakeKube()
    r, _ = reconciler(kube, normal_events=False)
    assert r.reconcile(enabled()) == "applied"
    assert kube.events == []
    r.reconcile(enabled(**{c.ANN_POLICY: "no-such-policy"}))
    assert [(e["type"], e["reason"]) for e in kube.events] == [("Warning", "KvoffloadInvalid")]


def test_every_apply_is_locked_to_the_version_read_just_before_it() -> None:
    """A pass works from an event that may be a version behind (the Deployment controller writes its
    status after a CREATE): locking to it would only buy a 409 (issue 46, item 5)."""
    stale = KubeApiError(409, {"reason": "Conflict", "message": "the object has been modified"}, "PATCH", "/x")
    kube = FakeKube(apply_errors=[stale, conflict(ARGS_FIELD)])
    r, _ = reconciler(kube)
    obj = enabled()
    obj["metadata"]["resourceVersion"] = "41"
    status_moved = enabled()
    status_moved["metadata"]["resourceVersion"] = "42"  # same spec and annotations, newer status
    kube.objects[workload_path("Deployment", "ns", "llama")] = status_moved
    assert r.reconcile(obj) == "applied"
    assert kube.versions == ["42", "42", "42"]  # never the event's 41: read, and read again after a 409


def test_a_422_on_a_fragment_of_an_older_spec_is_skipped_not_reported() -> None:
    invalid = KubeApiError(422, {"reason": "Invalid", "message": "spec.template.spec.containers[1].image: Required"},
                           "PATCH", "/x")  # fmt: skip
    kube = FakeKube(apply_errors=[invalid, invalid])
    r, _ = reconciler(kube)
    obj = enabled()
    newer = enabled()
    newer["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
    kube.objects[workload_path("Deployment", "ns", "llama")] = newer
    assert r.reconcile(obj) == "skipped"  # the user renamed the container meanwhile: the next event retries
    assert kube.events == []
    kube.objects[workload_path("Deployment", "ns", "llama")] = obj
    assert r.reconcile(obj) == "error"  # the same spec: the apiserver's refusal is the user's to see
    assert [e["reason"] for e in kube.events] == ["KvoffloadInvalid"]


def test_any_other_conflict_is_reported_and_nothing_forced() -> None:
    kube = FakeKube(apply_errors=[conflict(ARGS_FIELD, ".spec.template.metadata.labels.kvoffload.io/injected",
                                           manager="gitops")])  # fmt: skip
    r, metrics = reconciler(kube)
    assert r.reconcile(enabled()) == "conflict"
    assert workload_applies(kube) == [False]
    (event,) = kube.events
    assert event["type"] == "Warning" and event["reason"] == "KvoffloadConflict" and "gitops" in event["message"]
    assert metrics.errors.labels(kind="Deployment", reason="conflict")._value.get() == 1


def test_a_stale_object_is_skipped_not_forced() -> None:
    kube = FakeKube()
    r, metrics = reconciler(kube)
    obj = enabled()
    newer = enabled()
    newer["metadata"]["generation"] = obj["metadata"].get("generation", 1) + 1
    kube.objects[workload_path("Deployment", "ns", "llama")] = newer  # the user changed the spec meanwhile
    assert r.reconcile(obj) == "skipped"
    assert workload_applies(kube) == []  # the read before the apply saw it: nothing sent, nothing forced
    assert metrics.errors.labels(kind="Deployment", reason="api_error")._value.get() == 0


def test_bad_input_applies_nothing_and_warns_once() -> None:
    kube = FakeKube()
    r, metrics = reconciler(kube)
    obj = enabled(**{c.ANN_CPU_CACHE_SIZE: "lots"})
    assert r.reconcile(obj) == "error"
    assert r.reconcile(obj) == "error"
    assert kube.calls == []
    assert len(kube.events) == 1 and kube.events[0]["reason"] == "KvoffloadInvalid"
    assert metrics.errors.labels(kind="Deployment", reason="invalid_settings")._value.get() == 2


def test_an_api_failure_is_retried_from_the_current_object_until_it_succeeds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    unavailable = KubeApiError(503, {"reason": "ServiceUnavailable", "message": "etcd leader changed"}, "PATCH", "/x")
    kube = FakeKube(apply_errors=[unavailable, unavailable])
    r, metrics = reconciler(kube)
    obj = enabled()
    kube.objects[workload_path("Deployment", "ns", "llama")] = obj
    clock = [1000.0]
    monkeypatch.setattr("kvoffload.operator.control.reconcile.time.monotonic", lambda: clock[0])
    assert r.reconcile(obj) == "error"
    (event,) = kube.events
    assert event["reason"] == "KvoffloadRetrying" and "etcd leader changed" in event["message"]
    assert metrics.retry_queue._value.get() == 1
    assert r.run_due_retries() == 0  # backoff: not before one second
    clock[0] += 1.0
    assert r.run_due_retries() == 1  # fails again; next try two seconds later
    assert r.run_due_retries() == 0
    clock[0] += 2.0
    assert r.run_due_retries() == 1
    assert workload_applies(kube) == [False, False, False]
    assert metrics.retry_queue._value.get() == 0 and len(r.retries) == 0
    assert r.run_due_retries() == 0


def test_a_retry_of_a_deleted_workload_is_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    kube = FakeKube(apply_errors=[KubeApiError(500, {"message": "boom"}, "PATCH", "/x")])
    r, _ = reconciler(kube)
    clock = [0.0]
    monkeypatch.setattr("kvoffload.operator.control.reconcile.time.monotonic", lambda: clock[0])
    assert r.reconcile(enabled()) == "error"
    kube.served.clear()
    clock[0] += 5
    assert r.run_due_retries() == 1
    assert len(r.retries) == 0 and workload_applies(kube) == [False]


def test_unchanged_input_is_not_applied_twice() -> None:
    kube = FakeKube()
    r, _ = reconciler(kube)
    obj = enabled()
    r.reconcile(obj)
    r.reconcile(obj)
    assert len(workload_applies(kube)) == 1
    r.reconcile(obj, force=True)
    assert len(workload_applies(kube)) == 2


def test_opt_out_removes_and_deletes_the_configmap() -> None:
    kube = FakeKube()
    r, _ = reconciler(kube)
    obj = deployment()
    s = resolve_settings({c.ANN_ENABLED: "true"}, None, OperatorDefaults())
    assert isinstance(s, InjectionSettings)
    rendered = render_injection_fragment(obj, s, ClusterInfo(True))
    assert isinstance(rendered, RenderedInjection)
    injected = applied(obj, rendered.workload_apply)
    kube.objects["/api/v1/namespaces/ns/configmaps/llama-kvoffload"] = {
        "metadata": {"labels": {c.LABEL_MANAGED_BY: c.LABEL_MANAGED_BY_VALUE}}}  # fmt: skip
    assert r.reconcile(injected) == "removed"
    assert ("delete", "/api/v1/namespaces/ns/configmaps/llama-kvoffload", False) in kube.calls
    assert len(workload_applies(kube)) == 3  # args back, hand-off, release
    calls = len(kube.calls)
    assert r.reconcile(deployment()) == "noop"  # a workload the operator never touched costs nothing
    assert len(kube.calls) == calls


def test_an_upgrade_from_the_record_in_a_configmap_puts_the_record_on_the_workload_and_deletes_no_configmap(
) -> None:  # fmt: skip
    """Admission mode holds no right to delete ConfigMaps (docs/reliability.md, "RBAC per mode"): the
    ConfigMap an earlier version kept the record in stays, unread, until its owner (the workload) goes."""
    kube = FakeKube()
    metrics = OperatorMetrics()
    r = ServedReconciler(kube=kube, defaults=OperatorDefaults(), cluster=ClusterInfo(True, injection="admission"),  # type: ignore[arg-type]
                   metrics=metrics, events=EventRecorder(kube))  # type: ignore[arg-type]  # fmt: skip
    configmap = "/api/v1/namespaces/ns/configmaps/llama-kvoffload"
    kube.objects[configmap] = {"metadata": {"labels": {c.LABEL_MANAGED_BY: c.LABEL_MANAGED_BY_VALUE}}}
    assert r.reconcile(enabled()) == "applied"
    assert ("delete", configmap, False) not in kube.calls, "a first injection has no ConfigMap to delete"
    earlier = applied(enabled(), {"spec": {"template": {"metadata": {"labels": {c.LABEL_INJECT: "0123456789abcdef"}}}}})
    earlier["metadata"]["uid"] = "uid-upgraded"
    assert r.reconcile(earlier) == "applied"
    assert not [call for call in kube.calls if call[0] == "delete"]


def test_a_configmap_left_by_a_removal_killed_before_deleting_it_is_deleted_by_the_next_process() -> None:
    """Seen in CI: the operator was SIGKILLed after the removal's last apply; the next one found
    nothing of its own on the workload and left the ConfigMap forever."""
    kube = FakeKube()
    r, _ = reconciler(kube)
    configmap = "/api/v1/namespaces/ns/configmaps/llama-kvoffload"
    kube.objects[configmap] = {"metadata": {"labels": {c.LABEL_MANAGED_BY: c.LABEL_MANAGED_BY_VALUE}}}
    plain = deployment()
    assert r.reconcile(plain) == "noop"
    assert kube.calls == [], "a workload without kvoffload annotations is never looked at"
    opted_out = deployment(annotations={c.ANN_POLICY: "p"})
    assert r.reconcile(opted_out) == "noop"
    assert kube.calls == [("delete", configmap, False)]
    r.reconcile(opted_out)
    assert len(kube.calls) == 1, "looked for once per workload and process"


def test_a_stale_removal_event_replans_from_the_live_object_and_writes_nothing_more() -> None:
    """Our own removal's intermediate versions arrive late; re-running its steps from one of them
    would re-claim the args and start the cycle again (a write loop seen under load)."""
    kube = FakeKube()
    r, _ = reconciler(kube)
    s = resolve_settings({c.ANN_ENABLED: "true"}, None, OperatorDefaults())
    assert isinstance(s, InjectionSettings)
    rendered = render_injection_fragment(deployment(), s, ClusterInfo(True))
    assert isinstance(rendered, RenderedInjection)
    stale = applied(deployment(), rendered.workload_apply)
    stale["metadata"]["resourceVersion"] = "41"
    kube.objects[workload_path("Deployment", "ns", "llama")] = deployment()  # already clean, live
    kube.apply_errors = [KubeApiError(409, {"reason": "Conflict"}, "PATCH", "/x")]
    assert r.reconcile(stale) == "noop"
    assert kube.versions == ["41"], "one apply, locked to the version the plan was made from"
    assert not [call for call in kube.calls if call[0] == "delete"]


@pytest.mark.parametrize(
    ("info", "native"),
    [({"major": "1", "minor": "36"}, True), ({"major": "1", "minor": "29+"}, True),
     ({"major": "1", "minor": "28"}, False), ({"major": "1", "minor": "27+"}, False)],
)  # fmt: skip
def test_native_sidecars_follow_the_apiserver_version(info: dict[str, str], native: bool) -> None:
    from kvoffload.operator.api.kube import parse_version
    from kvoffload.operator.cli import NATIVE_SIDECAR_MIN

    assert (parse_version(info) >= NATIVE_SIDECAR_MIN) is native


def test_a_workload_being_deleted_is_left_alone() -> None:
    kube = FakeKube()
    r, _ = reconciler(kube)
    obj = enabled()
    obj["metadata"]["deletionTimestamp"] = "2026-11-30T14:22:16Z"
    assert r.reconcile(obj) == "noop"
    assert kube.calls == [] and kube.events == []


def test_an_apply_refused_because_the_workload_or_its_namespace_went_away_is_not_retried() -> None:
    terminating = KubeApiError(403, {"reason": "Forbidden", "message": "namespace is being terminated"}, "PATCH", "/x")

    class TerminatingKube(FakeKube):
        def apply(self, path: str, body: Mapping[str, Any], field_manager: str, force: bool = False) -> dict[str, Any]:
            self.served.clear()  # the namespace goes while the apply is refused
            return super().apply(path, body, field_manager, force)

    kube = TerminatingKube(apply_errors=[terminating])
    r, metrics = reconciler(kube)
    assert r.reconcile(enabled()) == "skipped"  # GET answers None: it is gone
    assert len(r.retries) == 0 and kube.events == []
    assert metrics.errors.labels(kind="Deployment", reason="api_error")._value.get() == 0
    kube.apply_errors = [terminating]
    obj = enabled()
    kube.objects[workload_path("Deployment", "ns", "llama")] = obj  # still there: a real refusal (RBAC)
    assert r.reconcile(obj) == "error" and len(r.retries) == 1
