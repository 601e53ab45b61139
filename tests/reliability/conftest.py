"""Fixtures for the reliability suite: the operator's fixtures (ServiceAccount bound to the chart's
rules, one operator process for the session) reused from the operator's integration tests."""

from __future__ import annotations

from tests.integration.operator.conftest import operator, operator_kubeconfig, running_operator

__all__ = ["operator", "operator_kubeconfig", "running_operator"]
