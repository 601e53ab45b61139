"""The local control plane's certificates (openssl) and kubeconfigs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _issue_cert(pki: Path, name: str, subject: str, sans: str | None = None, client: bool = False) -> None:
    """Create ``name.key``/``name.crt`` signed by ``ca`` in ``pki``."""
    _openssl("genrsa", "-out", f"{name}.key", "2048", cwd=pki)
    _openssl("req", "-new", "-key", f"{name}.key", "-subj", subject, "-out", f"{name}.csr", cwd=pki)
    ext_lines = [
        "basicConstraints=CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={'clientAuth' if client else 'serverAuth,clientAuth'}",
    ]
    if sans:
        ext_lines.append(f"subjectAltName={sans}")
    (pki / f"{name}.ext").write_text("\n".join(ext_lines) + "\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "30", "-sha256", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=pki,
    )  # fmt: skip


def make_pki(pki: Path) -> None:
    """A CA, the apiserver's serving cert, client certs and the service-account signing key."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("genrsa", "-out", "ca.key", "2048", cwd=pki)
    _openssl("req", "-x509", "-new", "-key", "ca.key", "-subj", "/CN=kvoffload-local-ca", "-days", "30",
             "-out", "ca.crt", cwd=pki)  # fmt: skip
    _issue_cert(
        pki, "apiserver", "/CN=kube-apiserver",
        sans="IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc,"
             "DNS:kubernetes.default.svc.cluster.local",
    )  # fmt: skip
    _issue_cert(pki, "admin", "/O=system:masters/CN=kubernetes-admin", client=True)
    _issue_cert(pki, "controller-manager", "/CN=system:kube-controller-manager", client=True)
    _issue_cert(pki, "scheduler", "/CN=system:kube-scheduler", client=True)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def kubeconfig_yaml(server: str, ca_file: Path, user: dict[str, str], name: str = "local") -> str:
    """A kubeconfig (JSON is valid YAML) for one cluster and one user."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": name, "cluster": {"server": server, "certificate-authority": str(ca_file)}}],
            "users": [{"name": name, "user": user}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
            "current-context": name,
        },
        indent=2,
    )
