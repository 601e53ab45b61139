"""Manifests of TensorRT-LLM-like workloads, as a user would write them."""

from __future__ import annotations

import json
from typing import Any

from hack.localcluster import GPU_RESOURCE, LocalCluster
from hack.polling import wait_until

TRTLLM_IMAGE = "nvcr.io/nvidia/tensorrt-llm/release:1.3.0rc26"


def trtllm_container(options_file: str | None = None, name: str = "trtllm") -> dict[str, Any]:
    """A ``trtllm-serve`` container requesting one GPU; ``options_file`` adds ``--extra_llm_api_options``."""
    args = ["meta-llama/Llama-3.1-8B-Instruct", "--backend", "pytorch", "--host", "0.0.0.0", "--port", "8000"]
    if options_file:
        args += ["--extra_llm_api_options", options_file]
    return {
        "name": name,
        "image": TRTLLM_IMAGE,
        "command": ["trtllm-serve"],
        "args": args,
        "ports": [{"name": "http", "containerPort": 8000}],
        "resources": {"limits": {GPU_RESOURCE: "1"}, "requests": {"cpu": "4", "memory": "32Gi"}},
    }


def trtllm_deployment(
    name: str,
    namespace: str,
    replicas: int = 1,
    annotations: dict[str, str] | None = None,
    containers: list[dict[str, Any]] | None = None,
    volumes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """An apps/v1 Deployment serving a model with TensorRT-LLM on one GPU."""
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": namespace, "annotations": dict(annotations or {})},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": containers or [trtllm_container()], "volumes": volumes or []},
            },
        },
    }


def apply(cluster: LocalCluster, manifest: dict[str, Any]) -> None:
    """``kubectl apply`` a manifest as the admin user."""
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def get(cluster: LocalCluster, kind: str, name: str, namespace: str) -> dict[str, Any]:
    """One object as JSON."""
    return json.loads(cluster.kubectl("get", kind, name, "-n", namespace, "-o", "json").stdout)  # type: ignore[no-any-return]


def list_objects(cluster: LocalCluster, kind: str, namespace: str, selector: str = "") -> list[dict[str, Any]]:
    """Objects of ``kind`` in ``namespace`` matching a label selector."""
    args = ["get", kind, "-n", namespace, "-o", "json"]
    if selector:
        args += ["-l", selector]
    return json.loads(cluster.kubectl(*args).stdout)["items"]  # type: ignore[no-any-return]


def wait_for(predicate: Any, timeout: float = 60, interval: float = 0.5, what: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy; fail with ``what`` on timeout."""
    return wait_until(predicate, timeout, what, interval)


def wait_for_default_service_account(cluster: Any, namespace: str) -> None:
    """Wait for the ``default`` ServiceAccount the controller-manager puts in a new namespace:
    until it exists the apiserver refuses every pod there, even a dry run (a busy controller-manager
    took over 10 s once, and the ReplicaSet's FailedCreate events failed a test)."""
    wait_for(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", namespace, check=False).returncode == 0,
             timeout=120, interval=0.2, what=f"the default ServiceAccount in {namespace}")  # fmt: skip
