"""Workload builders for the operator's unit tests, plus a small Server-Side Apply simulator.

``live`` turns a manifest into what the apiserver returns (managedFields for the user's
manager), and ``applied`` merges an operator fragment into it the way SSA would, recording the
operator's ownership, so re-rendering from an injected object can be tested without a cluster.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from hack.workloads import trtllm_container, trtllm_deployment
from kvoffload import contract as c

LIST_KEYS = {
    "containers": ("name",),
    "initContainers": ("name",),
    "env": ("name",),
    "volumes": ("name",),
    "volumeMounts": ("mountPath",),
    "ports": ("containerPort", "protocol"),
    "ownerReferences": ("uid",),
}


def _key(field: str, item: dict[str, Any]) -> str:
    defaults = {"protocol": "TCP"}
    return "k:" + json.dumps({k: item.get(k, defaults.get(k)) for k in LIST_KEYS[field]}, separators=(",", ":"),
                             sort_keys=True)  # fmt: skip


def fields_of(obj: Any, field: str = "") -> dict[str, Any]:
    """fieldsV1 of everything set in ``obj`` (as one manager applying it would own)."""
    if isinstance(obj, dict):
        return {f"f:{k}": fields_of(v, k) for k, v in obj.items()}
    if isinstance(obj, list) and field in LIST_KEYS:
        return {_key(field, item): {".": {}, **fields_of(item)} for item in obj}
    return {}


def _merge(base: Any, patch: Any, field: str = "") -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in LIST_KEYS:
        out_list = [copy.deepcopy(x) for x in base]
        index = {_key(field, x): i for i, x in enumerate(out_list)}
        for item in patch:
            k = _key(field, item)
            if k in index:
                out_list[index[k]] = _merge(out_list[index[k]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def _drop(tree: dict[str, Any], path: tuple[str, ...]) -> None:
    node = tree
    for part in path[:-1]:
        node = node.get(part, {})
    node.pop(path[-1], None)


def live(manifest: dict[str, Any], manager: str = "kubectl-client-side-apply") -> dict[str, Any]:
    """The manifest as the apiserver would return it after the user created it."""
    obj = copy.deepcopy(manifest)
    obj["metadata"].setdefault("uid", "uid-" + obj["metadata"]["name"])
    obj["metadata"].setdefault("generation", 1)
    obj["metadata"].setdefault("resourceVersion", "1")
    obj.setdefault("status", {"observedGeneration": obj["metadata"]["generation"]})  # its controller saw it
    tracked = {k: v for k, v in obj.items() if k in ("spec",)}
    obj["metadata"]["managedFields"] = [
        {"manager": manager, "operation": "Update", "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
         "fieldsV1": fields_of(tracked)},
    ]  # fmt: skip
    return obj


def applied(obj: dict[str, Any], body: dict[str, Any], manager: str = c.FIELD_MANAGER) -> dict[str, Any]:
    """``obj`` after ``manager`` applied ``body`` (with force where the operator would force)."""
    out = copy.deepcopy(obj)
    spec_patch = body.get("spec", {})
    out["spec"] = _merge(out["spec"], spec_patch, "spec")
    ours = fields_of({"spec": spec_patch})
    entries = [m for m in out["metadata"]["managedFields"] if m["manager"] != manager]
    # Forced ownership of args moves away from the user.
    for container in spec_patch.get("template", {}).get("spec", {}).get("containers", []):
        if "args" in container:
            path = ("f:spec", "f:template", "f:spec", "f:containers", _key("containers", container), "f:args")
            for entry in entries:
                _drop(entry["fieldsV1"], path)
    entries.append({"manager": manager, "operation": "Apply", "apiVersion": "apps/v1", "fieldsType": "FieldsV1",
                    "fieldsV1": ours})  # fmt: skip
    out["metadata"]["managedFields"] = entries
    return out


def deployment(**kwargs: Any) -> dict[str, Any]:
    """A live TensorRT-LLM Deployment (see ``hack.workloads.trtllm_deployment``)."""
    return live(trtllm_deployment(kwargs.pop("name", "llama"), kwargs.pop("namespace", "ns"), **kwargs))


def container(**kwargs: Any) -> dict[str, Any]:
    return trtllm_container(**kwargs)
