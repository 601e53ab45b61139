"""A small synchronous Kubernetes REST client: JSON in, JSON out, errors as ``KubeApiError``.

The operator needs only a handful of calls (get, list, Server-Side Apply, merge-patch status,
delete, create Event, /version), and wants the raw JSON, managedFields included. Credentials
come from the in-cluster service account or a kubeconfig, loaded by the ``kubernetes`` package.
"""

from __future__ import annotations

import json
import os
import ssl
import threading
from collections.abc import Iterable, Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import urllib3
from kubernetes import client as k8s_client
from kubernetes import config as k8s_config

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
MERGE_PATCH_CONTENT_TYPE = "application/merge-patch+json"
TIMEOUT = urllib3.Timeout(connect=5.0, read=30.0)


class KubeApiError(Exception):
    """A non-2xx answer; ``status`` is the HTTP code, ``body`` the decoded Status object if any."""

    def __init__(self, status: int, body: Mapping[str, Any], method: str, path: str) -> None:
        self.status = status
        self.body = dict(body)
        self.reason = str(body.get("reason", ""))
        self.message = str(body.get("message", "")) or f"HTTP {status}"
        super().__init__(f"{method} {path}: {status} {self.reason}: {self.message}")

    @property
    def field_conflicts(self) -> list[tuple[str, str]]:
        """(field path, message) of each Server-Side Apply field-manager conflict."""
        causes = (self.body.get("details") or {}).get("causes") or []
        return [
            (str(cause.get("field", "")), str(cause.get("message", "")))
            for cause in causes
            if cause.get("reason") == "FieldManagerConflict"
        ]


def load_configuration(kubeconfig: str | None = None) -> k8s_client.Configuration:
    """In-cluster service account when running in a pod, else ``kubeconfig`` / ``$KUBECONFIG``."""
    cfg = k8s_client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=cfg)
    else:
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=cfg, persist_config=False)
    return cfg


class Kube:
    """Thread-safe: kopf runs sync handlers in worker threads and they share one pool."""

    def __init__(self, cfg: k8s_client.Configuration) -> None:
        self._cfg = cfg
        self._host = cfg.host.rstrip("/")
        self._lock = threading.Lock()
        kwargs: dict[str, Any] = {"maxsize": 16, "block": False, "timeout": TIMEOUT, "retries": False}
        if cfg.verify_ssl:
            kwargs["cert_reqs"] = ssl.CERT_REQUIRED
            if cfg.ssl_ca_cert:
                kwargs["ca_certs"] = cfg.ssl_ca_cert
        else:
            kwargs["cert_reqs"] = ssl.CERT_NONE
        if cfg.cert_file:
            kwargs["cert_file"] = cfg.cert_file
        if cfg.key_file:
            kwargs["key_file"] = cfg.key_file
        self._pool = urllib3.PoolManager(**kwargs)

    def _headers(self, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "kvoffload-operator"}
        if content_type:
            headers["Content-Type"] = content_type
        with self._lock:
            if self._cfg.refresh_api_key_hook is not None:
                self._cfg.refresh_api_key_hook(self._cfg)
            token = self._cfg.get_api_key_with_prefix("authorization") or self._cfg.get_api_key_with_prefix(
                "BearerToken"
            )
        if token:
            headers["Authorization"] = token
        return headers

    def request(self, method: str, path: str, body: Any = None, content_type: str | None = None,
                params: Mapping[str, str] | None = None) -> dict[str, Any]:  # fmt: skip
        url = self._host + path + ("?" + urlencode(params) if params else "")
        data = None if body is None else json.dumps(body).encode()
        if data is not None and content_type is None:
            content_type = "application/json"
        try:
            resp = self._pool.request(method, url, body=data, headers=self._headers(content_type), preload_content=True)
        except urllib3.exceptions.HTTPError as exc:
            # The apiserver is down or restarting: an expected, retried condition, not a bug.
            raise KubeApiError(
                0, {"reason": "Unreachable", "message": f"apiserver unreachable ({exc})"}, method, path
            ) from exc
        try:
            decoded = json.loads(resp.data or b"{}")
        except ValueError:
            decoded = {"message": resp.data[:500].decode(errors="replace")}
        if resp.status >= 400:
            raise KubeApiError(resp.status, decoded if isinstance(decoded, dict) else {}, method, path)
        return decoded if isinstance(decoded, dict) else {}

    def get(self, path: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return self.request("GET", path)
        except KubeApiError as exc:
            if exc.status == 404:
                return None
            raise

    def apply(self, path: str, body: Mapping[str, Any], field_manager: str, force: bool = False) -> dict[str, Any]:
        """Server-Side Apply ``body`` as ``field_manager``."""
        params = {"fieldManager": field_manager, "force": "true" if force else "false"}
        return self.request("PATCH", path, body=body, content_type=APPLY_CONTENT_TYPE, params=params)

    def merge_patch(self, path: str, body: Mapping[str, Any], field_manager: str) -> dict[str, Any]:
        return self.request("PATCH", path, body=body, content_type=MERGE_PATCH_CONTENT_TYPE,
                            params={"fieldManager": field_manager})  # fmt: skip

    def delete(self, path: str) -> bool:
        """Delete; False when it was already gone."""
        try:
            self.request("DELETE", path)
        except KubeApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def create(self, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return self.request("POST", path, body=body)

    def server_version(self) -> tuple[int, int]:
        """(major, minor) of the apiserver, from /version."""
        return parse_version(self.request("GET", "/version"))


def parse_version(info: Mapping[str, Any]) -> tuple[int, int]:
    """(major, minor) from a /version answer; providers write minors like ``"29+"``."""

    def number(value: object) -> int:
        digits = ""
        for ch in str(value):
            if not ch.isdigit():
                break
            digits += ch
        return int(digits or 0)

    return number(info.get("major", 0)), number(info.get("minor", 0))


def namespaced_path(api: str, plural: str, namespace: str, name: str = "") -> str:
    """``{api}/namespaces/{namespace}/{plural}[/{name}]``; ``api`` is ``/api/v1`` or ``/apis/<group>/<version>``."""
    base = f"{api}/namespaces/{quote(namespace)}/{plural}"
    return f"{base}/{quote(name)}" if name else base


WORKLOAD_PLURALS = {"Deployment": "deployments", "StatefulSet": "statefulsets"}


def workload_path(kind: str, namespace: str = "", name: str = "") -> str:
    """Path of one workload, of a namespace's workloads, or (no namespace) of all of them."""
    plural = WORKLOAD_PLURALS[kind]
    if not namespace:
        return f"/apis/apps/v1/{plural}"
    return namespaced_path("/apis/apps/v1", plural, namespace, name)


def list_workloads(kube: Kube, namespaces: Iterable[str] = ()) -> Iterator[dict[str, Any]]:
    """Every Deployment and StatefulSet in ``namespaces`` (all when empty), with kind and apiVersion set."""
    for kind in WORKLOAD_PLURALS:
        for namespace in namespaces or ("",):
            for item in kube.request("GET", workload_path(kind, namespace)).get("items") or []:
                yield {"apiVersion": "apps/v1", "kind": kind, **item}


def configmap_path(namespace: str, name: str = "") -> str:
    return namespaced_path("/api/v1", "configmaps", namespace, name)


def policy_path(namespace: str, name: str = "", group: str = "kvoffload.io", version: str = "v1alpha1",
                plural: str = "kvcachepolicies") -> str:  # fmt: skip
    return namespaced_path(f"/apis/{group}/{version}", plural, namespace, name)


def events_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/events"
