"""What the webhook accepts, pure: an AdmissionReview checked strictly (a pod CREATE in
admission.k8s.io/v1 with a uid) and an HTTP request head checked against the body cap, each
refused with a one-line reason, never an exception."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.operator.admission.https_server import Reply, RequestHead, parse_head
from kvoffload.operator.admission.review import PodReview, WorkloadReview, parse_pod_review, parse_workload_review

POD = {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "llm-", "namespace": "ns"}, "spec": {}}
REVIEW: dict[str, Any] = {
    "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
    "request": {"uid": "705ab4f5", "kind": {"group": "", "version": "v1", "kind": "Pod"}, "namespace": "ns",
                "operation": "CREATE", "object": POD},
}  # fmt: skip


def changed(path: str, value: Any = ...) -> bytes:
    """The review with the field at ``path`` set to ``value`` (removed when no value is given)."""
    review = copy.deepcopy(REVIEW)
    *parents, last = path.split(".")
    node = review
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return json.dumps(review).encode()


def test_a_pod_create_is_read_with_its_uid_namespace_and_pod() -> None:
    assert parse_pod_review(json.dumps(REVIEW).encode()) == PodReview("705ab4f5", "ns", POD)
    assert parse_pod_review(changed("request.object.metadata.namespace")) == PodReview(
        "705ab4f5", "ns", {**POD, "metadata": {"generateName": "llm-"}}
    ), "a pod whose namespace the apiserver has not filled in yet"


def test_a_workload_update_is_read_with_the_old_object_and_the_field_manager() -> None:
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "llm"}, "spec": {}}
    old = {**deployment, "spec": {"replicas": 1}}
    request = {**REVIEW["request"], "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
               "operation": "UPDATE", "object": deployment, "oldObject": old,
               "options": {"kind": "PatchOptions", "fieldManager": "kubectl-rollout"}}  # fmt: skip
    body = {**REVIEW, "request": request}
    assert parse_workload_review(json.dumps(body).encode()) == WorkloadReview(
        "705ab4f5", "ns", "Deployment", deployment, old=old, field_manager="kubectl-rollout"
    )
    no_options = {**body, "request": {k: v for k, v in request.items() if k != "options"}}
    assert parse_workload_review(json.dumps(no_options).encode()) == WorkloadReview(
        "705ab4f5", "ns", "Deployment", deployment, old=old
    )
    for refused, reason in (({"oldObject": None}, "request.oldObject is NoneType"),
                            ({"options": {"fieldManager": 7}}, "fieldManager 7"),
                            ({"operation": "DELETE"}, "only CREATE")):  # fmt: skip
        answer = parse_workload_review(json.dumps({**body, "request": {**request, **refused}}).encode())
        assert isinstance(answer, str) and reason in answer, answer


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not JSON"),
        (b"\xff\xfe\x00", "not JSON"),
        (b"[1, 2]", "JSON list"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
        (b'{"request": ' + b"{\"a\": " * 50_000 + b"1" + b"}" * 50_001, "nests too deeply"),
        (changed("apiVersion", "admission.k8s.io/v1beta1"), "'admission.k8s.io/v1beta1'"),
        (changed("kind", "ConversionReview"), "'ConversionReview'"),
        (changed("request", "x"), "request is str"),
        (changed("request"), "request is NoneType"),
        (changed("request.uid"), "request.uid None"),
        (changed("request.uid", ""), "request.uid ''"),
        (changed("request.uid", {"a": 1}), "request.uid <a JSON dict>"),
        (changed("request.kind", {"group": "apps", "version": "v1", "kind": "Deployment"}), "only Pod (core) reviewed here"),
        (changed("request.kind", "Pod"), "only Pod (core) reviewed here"),
        (changed("request.operation", "DELETE"), "'DELETE': only CREATE"),
        (changed("request.operation"), "None: only CREATE"),
        (changed("request.namespace"), "request.namespace None"),
        (changed("request.object", []), "request.object is list"),
        (changed("request.object.metadata", "x"), "metadata is str"),
        (changed("request.object.metadata.namespace", "other"), "'other' is not request.namespace 'ns'"),
        (changed("request.uid", "u" * 257), "'uuu"),
        (changed("apiVersion", "v" * 10_000), "vvv..."),
    ],
    ids=lambda x: x[:40] if isinstance(x, str) else None,
)  # fmt: skip
def test_anything_but_a_pod_create_is_refused_with_a_short_one_line_reason(body: bytes, reason: str) -> None:
    refused = parse_pod_review(body)
    assert isinstance(refused, str), refused
    assert reason in refused and "\n" not in refused and len(refused) < 200, refused


@settings(max_examples=300)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=20))  # fmt: skip
def test_any_json_in_any_field_is_either_a_pod_review_or_a_reason(value: Any) -> None:
    for path in ("request", "request.uid", "request.kind", "request.object", "request.object.metadata",
                 "request.namespace", "apiVersion"):  # fmt: skip
        assert isinstance(parse_pod_review(changed(path, value)), (PodReview, str))
    assert isinstance(parse_pod_review(json.dumps(value).encode()), (PodReview, str))


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b"POST /mutate-pods HTTP/1.1\r\nHost: x\r\nContent-Length: 42", RequestHead("POST", "/mutate-pods", 42)),
        (b"GET /readyz HTTP/1.1\r\nHost: x", RequestHead("GET", "/readyz", 0)),
        (b"POST /mutate-workloads HTTP/1.1\r\nContent-Length: 9\r\nx-kvoffload-forwarded: 1",
         RequestHead("POST", "/mutate-workloads", 9, forwarded=True)),
        (b"POST /mutate-pods?timeout=5s HTTP/1.1\r\ncontent-length:  7 ", RequestHead("POST", "/mutate-pods?timeout=5s", 7)),
        (b"POST /mutate-pods HTTP/1.1\r\nHost: x", 411),
        (b"POST /mutate-pods HTTP/1.1\r\nTransfer-Encoding: chunked", 411),
        (b"POST /mutate-pods HTTP/1.1\r\nContent-Length: 1048577", 413),
        (b"POST /mutate-pods HTTP/1.1\r\nContent-Length: 99999999999999999999999", 413),
        (b"POST /mutate-pods HTTP/1.1\r\nContent-Length: " + b"9" * 5000, 413),
        (b"POST /mutate-pods HTTP/1.1\r\nContent-Length: -1", 400),
        (b"POST /mutate-pods HTTP/1.1\r\nContent-Length: 1e3", 400),
        (b"POST /mutate-pods HTTP/1.1\r\nContent-Length: \xb2", 400),
        (b"POST /mutate-pods HTTP/1.1\r\nContent-Length: 2\r\nContent-Length: 2", 400),
        (b"POST /mutate-pods HTTP/1.1\r\nno colon here", 400),
        (b"POST /mutate-pods HTTP/1.1\r\n Folded: header", 400),
        (b"POST /mutate-pods", 400),
        (b"POST mutate-pods HTTP/1.1", 400),
        (b"\x16\x03\x01\x02\x00", 400),
    ],
)  # fmt: skip
def test_a_request_head_gives_its_body_length_or_the_status_it_is_refused_with(
    head: bytes, expected: RequestHead | int
) -> None:
    parsed = parse_head(head, max_body=2**20)
    if isinstance(expected, RequestHead):
        assert parsed == expected
    else:
        assert isinstance(parsed, Reply) and parsed.status == expected, parsed


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_any_bytes_as_a_head_are_a_request_head_or_a_refusal(head: bytes) -> None:
    assert isinstance(parse_head(head, max_body=2**20), (RequestHead, Reply))


def test_a_reply_names_its_length_and_closes_the_connection() -> None:
    encoded = Reply(413, b"too big\n").encode()
    assert encoded.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n")
    assert b"\r\nContent-Length: 8\r\n" in encoded and b"\r\nConnection: close\r\n" in encoded
    assert encoded.endswith(b"\r\n\r\ntoo big\n")
