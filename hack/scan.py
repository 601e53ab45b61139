"""The security scanners of ``make test``: bandit on the package, checkov on the chart as Helm
renders it in each mode and on what the operator injects (its containers, a node cache pod). Every finding must be fixed or waived, with a reason, in
``hack/scan-waivers.yaml``; a waiver that no longer matches anything fails too, so the file stays
true. checkov gives no severities offline, so no finding passes on its severity alone.

    python -m hack.scan
"""

from __future__ import annotations

import fnmatch
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
WAIVERS = ROOT / "hack" / "scan-waivers.yaml"
CHART = ROOT / "charts" / "kvoffload"
SOURCE_FOLDERS = ("common/src", "operator/src", "sidecar/src", "connector/src")  # what ships
CACHE = Path(os.environ.get("KVOFFLOAD_CACHE") or Path.home() / ".cache" / "kvoffload")
SCANNERS = CACHE / "scanners" / "bin"
RENDERS: dict[str, tuple[str, ...]] = {
    "admission": (),
    "template": ("injection.mode=template",),
    "node": ("nodeMode.enabled=true",),
}
"""The chart renders checkov scans: file name -> ``--set`` values."""


@dataclass(frozen=True)
class Finding:
    tool: str
    rule: str
    where: str
    """bandit: ``path:line``; checkov: ``Kind.namespace.name``."""
    what: str


@dataclass(frozen=True)
class Waiver:
    tool: str
    rule: str
    where: str
    """An fnmatch pattern over :attr:`Finding.where`."""
    reason: str

    def covers(self, finding: Finding) -> bool:
        return (self.tool, self.rule) == (finding.tool, finding.rule) and fnmatch.fnmatchcase(finding.where, self.where)


def load_waivers(text: str) -> list[Waiver]:
    """The waivers file; each entry needs tool, rule, where and a non-empty reason."""
    waivers = []
    for i, entry in enumerate(yaml.safe_load(text) or []):
        missing = [k for k in ("tool", "rule", "where", "reason") if not str(entry.get(k) or "").strip()]
        if missing:
            raise ValueError(f"{WAIVERS.name} entry {i}: missing {', '.join(missing)}")
        waivers.append(Waiver(entry["tool"], entry["rule"], entry["where"], " ".join(str(entry["reason"]).split())))
    return waivers


def judge(findings: Iterable[Finding], waivers: Sequence[Waiver]) -> tuple[list[Finding], list[Waiver]]:
    """(findings no waiver covers, waivers that cover no finding)."""
    unwaived, used = [], set()
    for finding in findings:
        covering = [i for i, w in enumerate(waivers) if w.covers(finding)]
        used.update(covering)
        if not covering:
            unwaived.append(finding)
    return unwaived, [w for i, w in enumerate(waivers) if i not in used]


def bandit_findings(report: dict[str, Any]) -> list[Finding]:
    found = []
    for r in report.get("results", []):
        where = f"{Path(r['filename']).as_posix()}:{r['line_number']}"
        found.append(Finding("bandit", r["test_id"], where, f"{r['issue_severity']}: {r['issue_text']}"))
    return found


def checkov_findings(reports: dict[str, Any] | list[dict[str, Any]]) -> list[Finding]:
    found = []
    for report in reports if isinstance(reports, list) else [reports]:
        for r in report.get("results", {}).get("failed_checks", []):
            found.append(Finding("checkov", r["check_id"], r["resource"], f"{r['file_path']}: {r['check_name']}"))
    return sorted(set(found), key=lambda f: (f.rule, f.where))


def _run_bandit() -> list[Finding]:
    out = subprocess.run([str(SCANNERS / "bandit"), "-q", "-r", *SOURCE_FOLDERS, "-f", "json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)  # fmt: skip
    if out.returncode not in (0, 1) or not out.stdout.strip():
        raise SystemExit(f"scan: bandit failed ({out.returncode}): {out.stderr[-2000:]}")
    return bandit_findings(json.loads(out.stdout))


def injected_objects() -> list[dict[str, Any]]:
    """What the operator puts into clusters besides the chart: a pod holding only the containers
    it injects beside an engine (the engine is the user's), and a node-mode cache pod."""
    from hack.workloads import trtllm_deployment
    from kvoffload import contract as c
    from kvoffload.operator.intent.settings import InjectionSettings, OperatorDefaults, resolve_settings
    from kvoffload.operator.node.cache_objects import cache_settings, render_cache_network_policy, render_cache_pod
    from kvoffload.operator.plan.fragment import ClusterInfo, RenderedInjection, render_injection_fragment

    defaults = OperatorDefaults()
    workload = trtllm_deployment("llm", "team-a")
    settings = resolve_settings({c.ANN_ENABLED: "true"}, None, defaults, "team-a")
    assert isinstance(settings, InjectionSettings), settings
    rendered = render_injection_fragment(workload, settings, ClusterInfo(native_sidecars=True))
    assert isinstance(rendered, RenderedInjection), rendered
    spec = rendered.workload_apply["spec"]["template"]["spec"]
    ours = {
        "initContainers": spec["initContainers"],
        "containers": [_hardened_stand_in()],
        "automountServiceAccountToken": False,  # the user's choice; kvoffload's containers need no token
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},  # the user's, as the token
        **{k: v for k, v in spec.items() if k not in ("initContainers", "containers")},
    }  # fmt: skip
    injected = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "injected", "namespace": "team-a"},
                "spec": ours}  # fmt: skip
    policy = {"apiVersion": f"{c.API_GROUP}/{c.API_VERSION}", "kind": c.POLICY_KIND,
              "metadata": {"name": "shared", "namespace": "team-a", "uid": "u"},
              "spec": {"mode": "node", "cache": {"l1Size": "4Gi"}}}  # fmt: skip
    node_settings = cache_settings(policy, defaults)
    assert isinstance(node_settings, InjectionSettings), node_settings
    return [injected, render_cache_pod(policy, node_settings, "gpu-node-0"), render_cache_network_policy(policy)]


def _hardened_stand_in() -> dict[str, Any]:
    """The engine's place in the scanned pod, written so that every finding there is kvoffload's."""
    probe = {"httpGet": {"path": "/health", "port": 8000}}
    return {
        "name": "engine-stand-in", "image": "registry.example/engine@sha256:" + "0" * 64,
        "imagePullPolicy": "Always", "livenessProbe": probe, "readinessProbe": probe,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "1", "memory": "1Gi"}},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "runAsUser": 10001, "readOnlyRootFilesystem": True,
                            "seccompProfile": {"type": "RuntimeDefault"}},
    }  # fmt: skip


def _run_checkov() -> list[Finding]:
    with tempfile.TemporaryDirectory(prefix="kvoffload-scan-") as tmp:
        Path(tmp, "injected.yaml").write_text(yaml.safe_dump_all(injected_objects()))
        for name, values in RENDERS.items():
            argv = ["helm", "template", "kvo", str(CHART), "--namespace", "kvoffload-system"]
            for value in values:
                argv += ["--set", value]
            rendered = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
            Path(tmp, f"{name}.yaml").write_text(rendered)
        out = subprocess.run(
            [str(SCANNERS / "checkov"), "-d", tmp, "--framework", "kubernetes", "-o", "json", "--quiet", "--compact",
             "--skip-download"],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
    if out.returncode not in (0, 1) or not out.stdout.strip():
        raise SystemExit(f"scan: checkov failed ({out.returncode}): {out.stderr[-2000:]}")
    return checkov_findings(json.loads(out.stdout))


def main() -> int:
    missing = [t for t in ("bandit", "checkov") if not (SCANNERS / t).exists()]
    if missing:
        raise SystemExit(f"scan: {', '.join(missing)} not installed in {SCANNERS}; run hack/setup.sh python")
    findings = _run_bandit() + _run_checkov()
    unwaived, stale = judge(findings, load_waivers(WAIVERS.read_text()))
    for f in unwaived:
        print(f"scan: {f.tool} {f.rule} {f.where}: {f.what}", file=sys.stderr)
    for w in stale:
        print(f"scan: waiver {w.tool} {w.rule} {w.where} matches nothing any more; remove it", file=sys.stderr)
    print(f"scan: {len(findings)} findings, {len(findings) - len(unwaived)} waived, {len(unwaived)} not, "
          f"{len(stale)} stale waivers")  # fmt: skip
    return 1 if unwaived or stale else 0


if __name__ == "__main__":
    sys.exit(main())
