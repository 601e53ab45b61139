"""The operator's own Deployment as the owner of the objects it makes for itself (its Lease, the
webhook's CA and serving-certificate Secrets): each carries an ownerReference to it, so ``helm
uninstall``, which deletes the Deployment, lets the garbage collector delete them too, and an
operator of a later install tells them from its own by the owner's uid."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvoffload.operator.api.kube import Kube, KubeApiError, namespaced_path

log = logging.getLogger("kvoffload.operator")


@dataclass(frozen=True)
class OperatorDeployment:
    """The operator's Deployment, as an ownerReference names it."""

    name: str
    uid: str

    def reference(self) -> dict[str, Any]:
        """The ownerReference (no ``blockOwnerDeletion``: setting it needs rights on the owner's
        finalizers, and nothing has to wait for these objects)."""
        return {"apiVersion": "apps/v1", "kind": "Deployment", "name": self.name, "uid": self.uid}

    def owns(self, obj: Mapping[str, Any] | None) -> bool:
        """Whether ``obj`` names this Deployment among its owners."""
        return any(ref.get("uid") == self.uid for ref in _references(obj))

    def with_reference(self, references: object) -> list[dict[str, Any]]:
        """``references`` with every other Deployment's reference replaced by this one's (an earlier
        install's operator owned the object; the rest of its owners stay)."""
        listed = references if isinstance(references, list) else []
        kept = [dict(r) for r in listed if isinstance(r, Mapping) and r.get("kind") != "Deployment"]
        return [*kept, self.reference()]


def _references(obj: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return [r for r in refs if isinstance(r, Mapping)]


def earlier_install(
    kube: Kube, namespace: str, obj: Mapping[str, Any] | None, owner: OperatorDeployment | None
) -> bool:
    """Whether ``obj`` belongs to an operator Deployment that is gone (an earlier install's, deleted by
    ``helm uninstall``; a Deployment of that name now has another uid): False when either side names
    none, or when its owner is ours or still there (a second install's operator keeps waiting)."""
    deployments = [r for r in _references(obj) if r.get("kind") == "Deployment"]
    if owner is None or not deployments or owner.owns(obj):
        return False
    for ref in deployments:
        try:
            found = kube.get(namespaced_path("/apis/apps/v1", "deployments", namespace, str(ref.get("name"))))
        except KubeApiError:
            return False  # not ours to read (another release's operator): its term decides
        if found is not None and (found.get("metadata") or {}).get("uid") == ref.get("uid"):
            return False
    return True


def read_operator_deployment(kube: Kube, namespace: str, name: str) -> OperatorDeployment | None:
    """The operator's Deployment ``name`` in ``namespace`` (None when it is not there: nothing gets an owner)."""
    found = kube.get(namespaced_path("/apis/apps/v1", "deployments", namespace, name))
    if found is None:
        log.warning("operator Deployment %s/%s not found: its Lease and Secrets get no owner", namespace, name)
        return None
    return OperatorDeployment(name, str((found.get("metadata") or {}).get("uid") or ""))
