"""make scan's verdict (hack/scan.py): a finding passes only with a written waiver, and a waiver that
covers nothing fails too."""

from __future__ import annotations

import pytest

from hack.scan import WAIVERS, Finding, Waiver, bandit_findings, checkov_findings, judge, load_waivers

pytestmark = pytest.mark.chart


def test_a_finding_without_a_waiver_fails_and_a_waiver_without_a_finding_is_stale() -> None:
    webhook_role = Finding("checkov", "CKV_K8S_155", "ClusterRole.default.kvo-kvoffload-operator-webhook", "")
    chmod = Finding("bandit", "B103", "sidecar/src/kvoffload/sidecar/__main__.py:62", "")
    shell = Finding("bandit", "B602", "sidecar/src/kvoffload/sidecar/supervisor.py:10", "")
    waivers = [
        Waiver("checkov", "CKV_K8S_155", "ClusterRole.*.kvo-kvoffload-operator-webhook", "gap"),
        Waiver("bandit", "B103", "sidecar/src/kvoffload/sidecar/__main__.py:*", "sticky dir"),
        Waiver("bandit", "B108", "kvoffload/*", "fixed since"),
    ]
    unwaived, stale = judge([webhook_role, chmod, shell], waivers)
    assert unwaived == [shell]
    assert stale == [waivers[2]]


def test_a_waiver_needs_a_reason() -> None:
    with pytest.raises(ValueError, match="missing reason"):
        load_waivers("- {tool: bandit, rule: B101, where: '*', reason: ' '}")


def test_the_projects_waivers_file_loads_and_every_entry_gives_a_reason() -> None:
    waivers = load_waivers(WAIVERS.read_text())
    assert waivers and all(len(w.reason) > 20 for w in waivers)
    assert {w.tool for w in waivers} == {"bandit", "checkov"}


def test_reports_become_findings() -> None:
    bandit = {"results": [{"test_id": "B104", "filename": "kvoffload/x.py", "line_number": 3,
                           "issue_severity": "MEDIUM", "issue_text": "all interfaces"}]}  # fmt: skip
    assert bandit_findings(bandit) == [Finding("bandit", "B104", "kvoffload/x.py:3", "MEDIUM: all interfaces")]
    check = {"check_id": "CKV_K8S_11", "resource": "Job.ns.j", "file_path": "/a.yaml", "check_name": "CPU limits"}
    report = {"results": {"failed_checks": [check, check]}}
    assert checkov_findings([report]) == [Finding("checkov", "CKV_K8S_11", "Job.ns.j", "/a.yaml: CPU limits")]
