"""docs/reliability.md's "RBAC per mode" table is what the chart grants: every mode rendered with
``helm template``, with and without ``operator.watchNamespaces``, and compared grant by grant
(where, API group, resource, name, verb) with the table's rows for that mode. A doc that drifts
from the chart fails here, and so does a chart that grants more than the doc admits."""

from __future__ import annotations

import itertools
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.chart]

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "charts" / "kvoffload"
DOC = ROOT / "docs" / "reliability.md"
HEADING = "## RBAC per mode"
RELEASE_NAMESPACE = "kvoffload-system"
WATCHED = ("team-a", "team-b")
CLUSTER_WIDE = "(cluster-wide)"
"""A grant's reach when it comes through a ClusterRoleBinding."""

Grant = tuple[str, str, str, str, str]
"""(reach: CLUSTER_WIDE or a namespace, API group, resource, resource name or ``*``, verb)."""


@dataclass(frozen=True)
class Mode:
    injection: str
    node: bool

    @property
    def names(self) -> frozenset[str]:
        """The table's mode words that apply to this install."""
        return frozenset({"all", self.injection, *(["node"] if self.node else [])})

    def values(self, watched: tuple[str, ...]) -> list[str]:
        sets = [f"injection.mode={self.injection}", f"nodeMode.enabled={str(self.node).lower()}"]
        return sets + [f"operator.watchNamespaces[{i}]={ns}" for i, ns in enumerate(watched)]


MODES = [Mode(injection, node) for injection, node in itertools.product(("admission", "template"), (False, True))]


@dataclass(frozen=True)
class Row:
    where: str
    groups: tuple[str, ...]
    resources: tuple[str, ...]
    names: tuple[str, ...]
    verbs: tuple[str, ...]
    modes: frozenset[str]


def _cells(text: str) -> tuple[str, ...]:
    return tuple(part.strip().strip("`") for part in text.split(","))


def table_rows(doc: str) -> list[Row]:
    """The rows of the first table under ``HEADING``."""
    section = doc.split(HEADING, 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    assert header[:6] == ["where", "API group", "resources", "names", "verbs", "modes"], header
    rows = []
    for line in lines[2:]:
        where, groups, resources, names, verbs, modes = (c.strip() for c in line.strip("|").split("|")[:6])
        rows.append(Row(where, _cells(groups), _cells(resources), _cells(names), _cells(verbs),
                        frozenset(_cells(modes))))  # fmt: skip
    return rows


def documented(rows: Iterable[Row], mode: Mode, watched: tuple[str, ...]) -> set[Grant]:
    """The grants the table promises for ``mode`` (``watched``: the watchNamespaces value)."""
    reaches = {
        "cluster": [CLUSTER_WIDE],
        "release namespace": [RELEASE_NAMESPACE],
        "namespaces": list(watched) or [CLUSTER_WIDE],
    }
    grants: set[Grant] = set()
    for row in rows:
        if not row.modes & mode.names:
            continue
        assert row.where in reaches, f"unknown 'where' {row.where!r}"
        for reach, group, resource, name, verb in itertools.product(
            reaches[row.where], row.groups, row.resources, row.names, row.verbs
        ):
            grants.add((reach, "" if group == "core" else group, resource, name, verb))
    return grants


def render(values: list[str]) -> list[dict[str, Any]]:
    argv = ["helm", "template", "kvo", str(CHART), "--namespace", RELEASE_NAMESPACE]
    for value in values:
        argv += ["--set", value]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def rendered_grants(docs: list[dict[str, Any]]) -> set[Grant]:
    """Every (reach, group, resource, name, verb) the rendered bindings give the operator's ServiceAccount."""
    roles: Mapping[tuple[str, str, str], list[dict[str, Any]]] = {
        (d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d.get("rules") or []
        for d in docs if d["kind"] in ("ClusterRole", "Role")
    }  # fmt: skip
    grants: set[Grant] = set()
    for binding in (d for d in docs if d["kind"] in ("ClusterRoleBinding", "RoleBinding")):
        namespace = binding["metadata"].get("namespace", "")
        ref = binding["roleRef"]
        rules = roles[(ref["kind"], namespace if ref["kind"] == "Role" else "", ref["name"])]
        reach = CLUSTER_WIDE if binding["kind"] == "ClusterRoleBinding" else namespace
        for rule in rules:
            for group, resource, name, verb in itertools.product(
                rule["apiGroups"], rule["resources"], rule.get("resourceNames") or ["*"], rule["verbs"]
            ):
                grants.add((reach, group, resource, name, verb))
    return grants


@pytest.mark.parametrize("watched", [(), WATCHED], ids=["cluster-wide", "watchNamespaces"])
@pytest.mark.parametrize("mode", MODES, ids=[f"{m.injection}{'+node' if m.node else ''}" for m in MODES])
def test_the_rbac_table_is_exactly_what_the_chart_grants(mode: Mode, watched: tuple[str, ...]) -> None:
    promised = documented(table_rows(DOC.read_text()), mode, watched)
    granted = rendered_grants(render(mode.values(watched)))
    assert granted - promised == set(), "granted by the chart but not in docs/reliability.md's table"
    assert promised - granted == set(), "in docs/reliability.md's table but not granted by the chart"


def test_admission_mode_writes_no_configmap_and_nodes_are_listed_cluster_wide_also_with_watch_namespaces() -> None:
    """The two narrowings of issue 42 item 5, spelled out: no ConfigMap write in admission mode,
    anywhere; ``nodes list`` through a ClusterRoleBinding whatever ``watchNamespaces`` says."""
    for watched in ((), WATCHED):
        admission = rendered_grants(render(Mode("admission", False).values(watched)))
        writes = {g for g in admission if g[2] == "configmaps" and g[4] not in ("get",)}
        assert writes == set(), writes
        assert {g for g in admission if g[2] == "nodes"} == {(CLUSTER_WIDE, "", "nodes", "*", "list")}
        template = rendered_grants(render(Mode("template", False).values(watched)))
        assert {(g[0], g[4]) for g in template if g[2] == "configmaps"} == {
            (reach, verb) for reach in (watched or [CLUSTER_WIDE]) for verb in ("get", "create", "patch", "delete")
        }
