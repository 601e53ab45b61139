"""What one reconcile pass does to a workload, decided once: ``decide_workload(workload, inputs) -> Decision``.

Every question the pass asks before it writes is answered here, in this order (the first that
fails wins): is the workload being deleted, did kvoffload write what its field manager holds there
(a forged injection record is left alone), is its ``kvoffload.io/enabled`` readable, is it opted
in, is its namespace one the webhook is called for (admission mode), were these inputs reconciled already, has its
controller written a first status (admission mode: a write before that one is refused), are its settings valid, may its mode run in this
operator, does the injected pod fit a GPU node, may a node-mode engine share its node's cache, and
what is the injection's plan (``injection_plan.plan_workload``). The reconciler hands it the workload as read and the inputs,
calls it once and performs the one effect the decision names. Pure but for the three readers it is
handed (the policy, the nodes' memory, the user's options ConfigMap): it calls each only where the
answer depends on it, so a pass that ends early reads nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.operator.intent.settings import (
    OperatorDefaults,
    enabled_state,
    ours_annotations_digest,
    policy_name,
    resolve_settings,
)
from kvoffload.operator.intent.workload import Workload
from kvoffload.operator.plan.injection_plan import ClusterInfo, InjectionPlan, OptionsReader, plan_workload
from kvoffload.operator.plan.node_fit import node_fit_problem
from kvoffload.operator.plan.node_wiring import node_cache_wiring
from kvoffload.policy_values import PolicyError

Fingerprint = tuple[object, ...]
"""The inputs of one pass (generation, annotations, policy version, cluster): equal ones need no second pass."""

NODE_MODE_OFF = PolicyError(
    "mode", "node", "node mode is off in this operator: it needs the pod rights the chart grants "
    "with nodeMode.enabled=true (operator flag --node-mode true); use mode sidecar or enable it",
    reason="unsupported",
)  # fmt: skip


def outside_webhook_scope(workload: Workload, cluster: ClusterInfo) -> PolicyError | None:
    """Why an opted-in workload cannot be injected at admission here: its namespace is one the webhook
    is never called for, so its pods would start as written, and be evicted over and over."""
    namespace = workload.ref.namespace
    if cluster.injection != "admission" or namespace not in cluster.webhook_excluded_namespaces:
        return None
    return PolicyError(
        "metadata.namespace", namespace,
        "the injection webhook is never called for pods of kube-system or the operator's own namespace; "
        "run the workload in another namespace",
        reason="outside_webhook_scope",
    )  # fmt: skip


@dataclass(frozen=True)
class WorkloadInputs:
    """What the decision reads besides the workload itself."""

    policy: Callable[[str, str], Mapping[str, Any] | None]
    """Reads the KVCachePolicy of a (namespace, name) (None: the policy is missing)."""
    defaults: OperatorDefaults
    cluster: ClusterInfo
    node_mode: bool
    """The operator runs node mode's cache pods (else a workload of ``mode: node`` is refused)."""
    largest_gpu_node_memory: Callable[[], int | None]
    """Reads the largest GPU node's allocatable memory (None: unknown, the fit is not checked)."""
    options: OptionsReader
    """Reads the user's options ConfigMap, where the engine's options come from one."""
    foreign: Callable[[Workload], PolicyError | None] = lambda _workload: None
    """Why what kvoffload's field manager holds on the workload is not what kvoffload wrote (a forged
    injection record, a manifest applied under its name), if it is not: then nothing is written."""
    done: frozenset[Fingerprint] = frozenset()
    """The fingerprints of the inputs already reconciled for this workload."""
    force: bool = False
    """Decide even when the inputs were reconciled already (a resync, an edited options ConfigMap)."""


@dataclass(frozen=True)
class Leave:
    """Nothing to do now: the workload is being deleted, these inputs were reconciled already, or it
    was just created and its controller's first status write (the next event) is still to come."""


@dataclass(frozen=True)
class Remove:
    """Opted out: take the injection out."""


@dataclass(frozen=True)
class Reject:
    """Bad input: nothing is applied; a Warning says why."""

    error: PolicyError
    """The field, the bad value and what is allowed."""
    state: str
    """The inputs as one string: the Warning is posted once per state."""


@dataclass(frozen=True)
class Inject:
    """Opted in with valid settings and a plan: render and apply the injection."""

    plan: InjectionPlan
    state: str
    """The inputs as one string, for the dedupe of this pass's Events."""
    fingerprint: Fingerprint
    hand_back_template: bool
    """Admission mode over a template injected by template mode: once the plan holds, remove that
    injection first (one rollout hands the template back; the webhook then injects the pods)."""


Decision = Leave | Reject | Remove | Inject


def decide_workload(workload: Workload, inputs: WorkloadInputs) -> Decision:
    """The one thing this pass does to ``workload`` (see the module's docstring for the order)."""
    if workload.deleting:
        return Leave()  # being deleted: an apply could only race the garbage collector
    annotations = workload.annotations
    enabled = enabled_state(annotations)
    digest = ours_annotations_digest(annotations)
    foreign = inputs.foreign(workload)
    if foreign is not None:
        return Reject(foreign, digest)  # reported once per annotation set; no removal, no apply
    if isinstance(enabled, PolicyError):
        return Reject(enabled, digest)
    if not enabled:
        return Remove()
    outside = outside_webhook_scope(workload, inputs.cluster)
    if outside is not None:
        return Reject(outside, digest)
    name = policy_name(annotations)
    policy = inputs.policy(workload.ref.namespace, name) if isinstance(name, str) else None
    policy_version = None if policy is None else (policy.get("metadata") or {}).get("resourceVersion")
    fingerprint = (workload.generation, digest, policy_version, inputs.cluster)
    if not inputs.force and fingerprint in inputs.done:
        return Leave()
    if inputs.cluster.injection == "admission" and not inputs.force and not workload.status_observed:
        # Just created: its controller writes the first status within moments, an event that brings
        # the workload back. An apply sent before that write, locked to the version it read, is
        # refused (409) and sent again: nearly one extra write per workload created opted in. Only
        # admission mode waits: the webhook labelled the template at the CREATE, so its first pods
        # are injected without the record; in template mode an early apply may spare a rollout.
        return Leave()
    state = f"{workload.generation}/{digest}/{policy_version}"
    settings = resolve_settings(annotations, policy, inputs.defaults, workload.ref.namespace)
    if isinstance(settings, PolicyError):
        return Reject(settings, state)
    if settings.mode == "node" and not inputs.node_mode:
        return Reject(NODE_MODE_OFF, state)
    unfit = node_fit_problem(workload, settings, inputs.largest_gpu_node_memory())
    if unfit:
        return Reject(unfit, state)
    wiring = node_cache_wiring(workload, settings) if settings.mode == "node" else None
    if isinstance(wiring, PolicyError):
        return Reject(wiring, state)
    plan = plan_workload(workload, settings, inputs.cluster, inputs.options, wiring)
    if isinstance(plan, PolicyError):
        return Reject(plan, state)
    hand_back = inputs.cluster.injection == "admission" and workload.template_injected
    return Inject(plan, state, fingerprint, hand_back)
