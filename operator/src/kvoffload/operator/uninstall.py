"""``kvoffload-operator --remove-all``, the chart's pre-delete hook: take kvoffload out of every
watched workload (seizing the running operator's Lease first, so it stops re-injecting), then the
webhook's registration.
"""

from __future__ import annotations

import time

from kvoffload import contract as c
from kvoffload.operator import PROG
from kvoffload.operator.admission.webhook_tls import delete_webhook_configuration
from kvoffload.operator.api.kube import Kube
from kvoffload.operator.api.operator_deployment import OperatorDeployment
from kvoffload.operator.control.leadership import RENEW_INTERVAL_S, Leadership
from kvoffload.operator.control.workload_writes import LEFT_ALONE, remove_every_injection

UNINSTALL_IDENTITY = "kvoffload-uninstall"
UNINSTALL_HOLD_S = 120
"""How long the uninstall hook's hold on the Lease lasts after its last step: Helm deletes the
operator within it, so no operator pod (a restarted container, a standby) acts again before it goes."""
HANDOVER_WAIT_S = 2 * RENEW_INTERVAL_S
"""After taking the Lease from a running operator: it sees that at its next renewal and stops."""
REMOVAL_PASSES = 3


def uninstall_lease(kube: Kube, namespace: str, owner: OperatorDeployment | None) -> Leadership:
    """The operator's Lease in ``namespace``, for the hook to seize (owned by the operator's
    Deployment, so it goes when Helm deletes that)."""
    return Leadership(kube, namespace, c.OPERATOR_LEASE_NAME, UNINSTALL_IDENTITY, owner)


def remove_all(kube: Kube, namespaces: tuple[str, ...], admission: bool, lease: Leadership | None) -> int:
    """``--remove-all``: one line per workload, exit 1 if any could not be returned to the user's pods;
    then the webhook's registration goes (no pod of the workloads asks for it any more).

    Helm runs this hook while the operator still runs, and a running operator re-injects every
    workload still opted in: with ``lease`` the hook first seizes the operator's Lease (the
    operator stops acting at its next renewal), and holds it until Helm has deleted the operator."""
    if lease is not None and lease.seize(UNINSTALL_HOLD_S):
        print(f"{PROG}: took Lease {lease.namespace}/{lease.name} from the acting operator; "
              f"waiting {HANDOVER_WAIT_S:.0f} s for it to stop", flush=True)  # fmt: skip
        time.sleep(HANDOVER_WAIT_S)
    results: dict[str, str] = {}
    for _pass in range(REMOVAL_PASSES):  # a write the stopping operator had in flight may land after a pass
        found = remove_every_injection(kube, namespaces, generated_configmaps=not admission)
        for ref, result in found:
            if result != "noop" or ref not in results:
                results[ref] = result
        if all(result == "noop" for _ref, result in found):
            break
    for ref, result in results.items():
        print(f"{PROG}: {ref}: {result}", flush=True)
    left = [ref for ref, result in results.items()
            if result not in ("removed", "noop") and not result.startswith(LEFT_ALONE)]  # fmt: skip
    alone = [ref for ref, result in results.items() if result.startswith(LEFT_ALONE)]
    print(f"{PROG}: removed kvoffload from {len(results) - len(left) - len(alone)} workload(s); {len(left)} left"
          + (f"; {len(alone)} left alone (holding what kvoffload did not write)" if alone else ""), flush=True)  # fmt: skip
    if not left and admission and delete_webhook_configuration(kube, c.WEBHOOK_CONFIGURATION_NAME):
        print(f"{PROG}: deleted MutatingWebhookConfiguration {c.WEBHOOK_CONFIGURATION_NAME}", flush=True)
    if lease is not None:
        lease.seize(UNINSTALL_HOLD_S)  # the hold runs from now: Helm deletes the operator next
    return 1 if left else 0
