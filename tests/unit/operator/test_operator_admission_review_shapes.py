"""A review whose object has a field of the wrong JSON type (labels as a list, ownerReferences as a
number, a container that is not an object...) is refused at the edge with 400 and a one-line reason
naming the field, pure, before any reviewer reads it: no "internal error" answer, no traceback; and
the webhook's refusal lines are on a budget."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload import contract as c
from kvoffload.log_budget import LINES_PER_INTERVAL
from kvoffload.operator.admission.https_server import Request
from kvoffload.operator.admission.new_workloads import planner
from kvoffload.operator.admission.review import PodReview, WorkloadReview, parse_pod_review, parse_workload_review
from kvoffload.operator.admission.webhook import WebhookServer
from kvoffload.operator.admission.webhook_tls import issue
from kvoffload.operator.intent.settings import OperatorDefaults
from kvoffload.operator.metrics import OperatorMetrics
from kvoffload.operator.plan.injection_plan import ClusterInfo
from tests.support.webhook_process import StandInApiserver, injected_workload, pod_review

pytestmark = pytest.mark.operator

POD_FIELDS: dict[str, tuple[str, Any]] = {
    "labels a list": ("metadata.labels", [c.LABEL_INJECT]),
    "a label value a number": ("metadata.labels", {c.LABEL_INJECT: 7}),
    "annotations a string": ("metadata.annotations", "x"),
    "ownerReferences a number": ("metadata.ownerReferences", 7),
    "an owner reference a number": ("metadata.ownerReferences", [7]),
    "an owner reference's name an object": ("metadata.ownerReferences", [{"kind": "ReplicaSet", "name": {}}]),
    "spec a list": ("spec", []),
    "containers an object": ("spec.containers", {"name": "engine"}),
    "a container a string": ("spec.containers", ["engine"]),
    "a container's env an object": ("spec.containers.0.env", {"A": "1"}),
    "a container's args a number": ("spec.containers.0.args", 7),
    "a container's volumeMounts a boolean": ("spec.containers.0.volumeMounts", True),
    "a volume a number": ("spec.volumes", [7]),
    "initContainers a string": ("spec.initContainers", "x"),
}
WORKLOAD_FIELDS: dict[str, tuple[str, Any]] = {
    "annotations a list": ("object.metadata.annotations", ["x"]),
    "labels a number": ("object.metadata.labels", 7),
    "spec a string": ("object.spec", "x"),
    "the template a string": ("object.spec.template", "x"),
    "the template's labels a list": ("object.spec.template.metadata.labels", []),
    "the template's containers a number": ("object.spec.template.spec.containers", 7),
    "a template container a list": ("object.spec.template.spec.containers", [[]]),
    "managedFields a number": ("object.metadata.managedFields", 7),
    "oldObject's template a list": ("oldObject.spec.template", []),
    "oldObject's annotations a string": ("oldObject.metadata.annotations", "x"),
}


def _set(node: Any, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value


def malformed_pod(case: str) -> bytes:
    review = pod_review("bad-pod")
    _set(review["request"]["object"], *POD_FIELDS[case])
    return json.dumps(review).encode()


def workload_review(operation: str = "UPDATE") -> dict[str, Any]:
    workload = injected_workload()
    request = {"uid": "bad-workload", "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
               "namespace": "ns", "operation": operation, "object": workload}  # fmt: skip
    if operation == "UPDATE":
        request["oldObject"] = copy.deepcopy(workload)
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}


def malformed_workload(case: str) -> bytes:
    review = workload_review()
    _set(review["request"], *WORKLOAD_FIELDS[case])
    return json.dumps(review).encode()


def _one_line_naming(reason: object, path: str) -> None:
    assert isinstance(reason, str), reason
    assert "\n" not in reason and len(reason) < 200, reason
    assert path.split(".")[-1] in reason, reason


def test_the_well_formed_reviews_the_cases_start_from_are_read() -> None:
    assert isinstance(parse_pod_review(json.dumps(pod_review("ok")).encode()), PodReview)
    for operation in ("CREATE", "UPDATE"):
        assert isinstance(parse_workload_review(json.dumps(workload_review(operation)).encode()), WorkloadReview)


@pytest.mark.parametrize("case", sorted(POD_FIELDS))
def test_a_pod_review_with_a_field_of_the_wrong_type_is_refused_with_one_line_naming_it(case: str) -> None:
    _one_line_naming(parse_pod_review(malformed_pod(case)), POD_FIELDS[case][0])


@pytest.mark.parametrize("case", sorted(WORKLOAD_FIELDS))
def test_a_workload_review_with_a_field_of_the_wrong_type_is_refused_with_one_line_naming_it(case: str) -> None:
    _one_line_naming(parse_workload_review(malformed_workload(case)), WORKLOAD_FIELDS[case][0])


@contextlib.contextmanager
def webhook_server(with_planner: bool) -> Iterator[WebhookServer]:
    """The webhook on a stand-in apiserver; its handler is called directly (the server runs only
    so that stopping it closes its sockets)."""
    kube = StandInApiserver()
    plan = planner(kube, OperatorDefaults(), ClusterInfo(native_sidecars=True, injection="admission"))  # type: ignore[arg-type]
    server = WebhookServer(kube, OperatorMetrics(), issue(["127.0.0.1"]), 0, host="127.0.0.1",  # type: ignore[arg-type]
                           plan=plan if with_planner else None)  # fmt: skip
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def webhook() -> Iterator[WebhookServer]:
    with webhook_server(with_planner=True) as server:
        yield server


def _reply_and_errors(server: WebhookServer, path: str, body: bytes, caplog: pytest.LogCaptureFixture
                      ) -> tuple[int, bytes, list[logging.LogRecord]]:  # fmt: skip
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="kvoffload.operator"):
        reply = server.handle(Request("POST", path, body))
    return reply.status, reply.body, [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


@pytest.mark.parametrize(("path", "body"), [
    *[(c.WEBHOOK_PATH, malformed_pod(case)) for case in sorted(POD_FIELDS)],
    *[(c.WEBHOOK_WORKLOADS_PATH, malformed_workload(case)) for case in sorted(WORKLOAD_FIELDS)],
], ids=[*sorted(POD_FIELDS), *sorted(WORKLOAD_FIELDS)])  # fmt: skip
def test_the_webhook_answers_a_misshapen_review_400_with_one_line_and_logs_no_traceback(
    webhook: WebhookServer, caplog: pytest.LogCaptureFixture, path: str, body: bytes
) -> None:
    status, reply, errors = _reply_and_errors(webhook, path, body, caplog)
    assert status == 400, reply[:300]
    assert reply.endswith(b"\n") and reply.count(b"\n") == 1 and b"internal error" not in reply, reply[:300]
    assert errors == [], [r.getMessage() for r in errors]


def test_a_well_formed_pod_review_is_still_injected(webhook: WebhookServer, caplog: pytest.LogCaptureFixture) -> None:
    status, reply, errors = _reply_and_errors(webhook, c.WEBHOOK_PATH, json.dumps(pod_review("ok")).encode(), caplog)
    assert status == 200 and json.loads(reply)["response"]["patchType"] == "JSONPatch", reply[:300]
    assert errors == []


def test_a_flood_of_refused_reviews_logs_a_few_lines_not_one_each(caplog: pytest.LogCaptureFixture) -> None:
    caplog.clear()
    with webhook_server(with_planner=False) as server, caplog.at_level(logging.DEBUG, logger="kvoffload.operator"):
        for _ in range(1000):
            assert server.handle(Request("POST", c.WEBHOOK_PATH, b"{not json")).status == 400
    refused = [r for r in caplog.records if "refused a review" in r.getMessage()]
    assert 1 <= len(refused) <= LINES_PER_INTERVAL, len(refused)
