"""One answer per workload whichever replica the apiserver reaches: every replica plans at
admission with the inputs of the operator holding the Lease.

During a ``helm upgrade`` the old and the new operator both serve the webhook, each with its own
defaults. Had each planned with its own, a user's write answered by the new one took a workload to
the new settings and the old one's next reconcile took it back (measured: 2-4 round trips per
workload in a 10 s overlap); an app created opted in and answered by the new one was labelled from
the new settings, or, once the new one no longer planned, not at all, and the holder's label rolled
it a second time. So the holder publishes its planning inputs (its defaults and cluster facts,
``planning_inputs``) in the Lease (``control.leadership``), and a replica plans with those: its
CREATE gets the holder's label, its first pods the holder's injection, an UPDATE the holder's record.

A replica plans only with inputs its own code reads as the holder's code does: the same operator
version. Otherwise (the new image of an upgrade waiting for the Lease) it forwards the review to the
holder's webhook (``forwarding_address``, ``review_forwarding``), so the holder answers it. When that
fails (the holder published no address, is gone, or does not answer in time), and while nobody holds
the Lease, it makes no plan: an UPDATE keeps kvoffload's record and label as stored, a CREATE is
admitted as written (the holder's label then rolls it once more), a pod is injected from its
workload's record; the acting operator decides the rest.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any

from kvoffload.operator import __version__
from kvoffload.operator.admission.new_workloads import Planner
from kvoffload.operator.intent.settings import OperatorDefaults
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan

NOT_ACTING = (
    "nobody holds the Lease, or its holder plans with inputs this operator does not read alike: the holder plans"
)


def planning_inputs(defaults: OperatorDefaults, cluster: ClusterInfo) -> str:
    """What ``new_workloads.planner``'s plans depend on besides the API, as the JSON the holder
    publishes: two operators of one version planning with it plan every workload alike."""
    document = {"defaults": dataclasses.asdict(defaults), "cluster": dataclasses.asdict(cluster)}
    return json.dumps(document, sort_keys=True, default=lambda v: sorted(v) if isinstance(v, frozenset) else str(v))


def read_planning_inputs(text: str) -> tuple[OperatorDefaults, ClusterInfo] | str:
    """The holder's published inputs, or why this operator does not plan with them (not readable
    by this version's fields, or written by another operator version, whose code may plan them
    otherwise)."""
    try:
        document = json.loads(text)
        defaults = OperatorDefaults(**document["defaults"])
        cluster_fields: dict[str, Any] = dict(document["cluster"])
        cluster_fields["webhook_excluded_namespaces"] = frozenset(cluster_fields["webhook_excluded_namespaces"])
        cluster = ClusterInfo(**cluster_fields)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"the holder's planning inputs are not readable by operator {__version__}: {exc}"
    if cluster.operator_version != __version__:
        return f"the holder is operator {cluster.operator_version}, this one {__version__}"
    return defaults, cluster


def plan_as_holder(own: Planner, own_inputs: str, planner_for: Callable[[OperatorDefaults, ClusterInfo], Planner],
                   holders_inputs: Callable[[], str | None]) -> Planner:  # fmt: skip
    """A planner with the inputs ``holders_inputs()`` gives now (the Lease holder's published ones,
    this replica's own while it holds it; None: nobody's): ``own`` when they are this replica's
    own (``own_inputs``: the holder itself, a hot standby of its release), else ``planner_for``
    them, else no plan."""

    def planned(workload: Mapping[str, Any]) -> InjectionPlan | str:
        published = holders_inputs()
        if published is not None and published == own_inputs:
            return own(workload)
        inputs = read_planning_inputs(published) if published else NOT_ACTING
        if isinstance(inputs, str):
            return inputs if inputs == NOT_ACTING else f"{NOT_ACTING} ({inputs})"
        return planner_for(*inputs)(workload)

    return planned


def forwarding_address(holders_inputs: str | None, holders_webhook: str | None, own_inputs: str) -> str | None:
    """Where to forward a review so the holder answers it: its webhook's address when it published
    inputs this replica does not plan with (``read_planning_inputs`` refuses them: another operator
    version); None when this replica plans as the holder or nobody published anything."""
    if not holders_inputs or not holders_webhook or holders_inputs == own_inputs:
        return None
    return holders_webhook if isinstance(read_planning_inputs(holders_inputs), str) else None
