"""What one reconcile pass came to, as a value: the result label, the Events to post, the error
reasons to count, whether the injection came or went, and a failure to retry. The pass decides and
writes; the reconciler reports an outcome once, at the end (``Reconciler._report``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.operator.api.kube import KubeApiError
from kvoffload.policy_values import PolicyError


@dataclass(frozen=True)
class Notice:
    """One Event about the workload, posted once per ``state``."""

    type: str
    reason: str
    message: str
    state: str = ""


@dataclass
class Outcome:
    """One pass's result and what to report about it."""

    result: str
    """``applied``, ``unchanged``, ``removed``, ``noop``, ``skipped``, ``conflict`` or ``error``."""
    notices: list[Notice] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    """Reasons for the errors counter (the field or cause, as in ``PolicyError.reason``)."""
    injected: bool | None = None
    """The pass left the workload injected (True) or took the injection out (False); None: neither."""
    failure: str | None = None
    """Why the pass failed on the API or inside the operator: it runs again with backoff."""


def rejected(error: PolicyError, state: str) -> Outcome:
    """Bad input: a Warning naming field, value and what is allowed; nothing applied."""
    return Outcome("error", [Notice("Warning", "KvoffloadInvalid", error.message, state)], [error.reason])


def conflicted(exc: KubeApiError, what: str, state: str) -> Outcome:
    """Another field manager owns fields kvoffload needs: nothing changed, a Warning names them."""
    details = "; ".join(f"{f}: {m}" for f, m in exc.field_conflicts)
    message = f"{what}: another field manager owns fields kvoffload needs; nothing was changed ({details})"
    return Outcome("conflict", [Notice("Warning", "KvoffloadConflict", message, state)], ["conflict"])
