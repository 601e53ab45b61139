"""Counting the apiserver's write requests from its audit log (``LocalCluster.audit_log``): who
sent which verb to which object, and what the apiserver answered."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.operator_support import OPERATOR_NAMESPACE, OPERATOR_SA

OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_SA}"


@dataclass(frozen=True)
class Write:
    user: str
    verb: str
    resource: str
    namespace: str
    name: str
    code: int

    @classmethod
    def of(cls, event: dict[str, Any]) -> Write:
        ref = event.get("objectRef") or {}
        resource = str(ref.get("resource", "")) + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        return cls(
            user=str((event.get("user") or {}).get("username", "")), verb=str(event.get("verb")),
            resource=resource, namespace=str(ref.get("namespace", "")), name=str(ref.get("name", "")),
            code=int((event.get("responseStatus") or {}).get("code", 0)),
        )  # fmt: skip


@dataclass
class AuditWindow:
    """The writes logged since ``mark()``."""

    path: Path
    offset: int = 0

    def mark(self) -> AuditWindow:
        self.offset = self.path.stat().st_size if self.path.exists() else 0
        return self

    def writes(self, user: str | None = None, namespace: str | None = None) -> list[Write]:
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            lines = fh.read().splitlines()
        found = []
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line still being written
            if event.get("stage") != "ResponseComplete":
                continue
            write = Write.of(event)
            if (user is None or write.user == user) and (namespace is None or write.namespace == namespace):
                found.append(write)
        return found

    def counts(self, user: str | None = None, namespace: str | None = None) -> Counter[tuple[str, str, int]]:
        """(verb, resource, code) -> requests."""
        return Counter((w.verb, w.resource, w.code) for w in self.writes(user, namespace))
