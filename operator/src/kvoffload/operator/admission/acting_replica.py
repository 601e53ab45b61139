"""One answer per workload whichever replica the apiserver reaches: a replica plans at admission
only as the operator holding the Lease would.

During a ``helm upgrade`` the old and the new operator both serve the webhook, each with its own
defaults. Had both planned, a user's write answered by the new one took a workload to the new
settings and the old one's next reconcile took it back (measured: 2-4 round trips per workload in
a 10 s overlap). A replica that neither holds the Lease nor plans as its holder does (the digest
the holder publishes in it, ``control.leadership``; any replica while nobody holds it) makes no
plan: an UPDATE keeps kvoffload's record and label as stored, a CREATE is admitted as written, a
pod is injected from its workload's record; the acting operator decides the rest. A hot standby
of the same release plans as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvoffload.operator.admission.new_workloads import Planner
from kvoffload.operator.plan.injection_plan import InjectionPlan

NOT_ACTING = "this operator neither holds the Lease nor plans as its holder does: the holder plans"


def plan_while_acting(plan: Planner, acting: Callable[[], bool]) -> Planner:
    """``plan`` while ``acting()`` says this replica plans as the Lease's holder would, else no plan."""

    def planned(workload: Mapping[str, Any]) -> InjectionPlan | str:
        return plan(workload) if acting() else NOT_ACTING

    return planned
