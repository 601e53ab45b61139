"""One answer per workload whichever replica the apiserver reaches: only the operator that holds
the Lease plans at admission.

During a ``helm upgrade`` the old and the new operator both serve the webhook, each with its own
defaults. Had both planned, a user's write answered by the new one took a workload to the new
settings and the old one's next reconcile took it back (measured: 3-5 extra rollouts per workload
in a 10 s overlap). A replica that does not hold the Lease (the one waiting, the one stopping, any
while nobody holds it) makes no plan: an UPDATE keeps kvoffload's record and label as stored, a
CREATE is admitted as written, a pod is injected from its workload's record; the acting operator
decides the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvoffload.operator.admission.new_workloads import Planner
from kvoffload.operator.plan.injection_plan import InjectionPlan

NOT_ACTING = "this operator does not hold the Lease: the acting one plans"


def plan_while_acting(plan: Planner, acting: Callable[[], bool]) -> Planner:
    """``plan`` while ``acting()`` says this replica holds the operator's Lease, else no plan."""

    def planned(workload: Mapping[str, Any]) -> InjectionPlan | str:
        return plan(workload) if acting() else NOT_ACTING

    return planned
