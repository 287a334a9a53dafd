"""Kubeconfig files for the local cluster: one for users and tools, one per pod."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import yaml

CONTEXT = "rolloutrun-local"


def render(server: str, token: str | None, ca_pem: bytes, namespace: str = "default") -> str:
    """A kubeconfig for this cluster; ``token=None`` gives one without credentials (a pod
    that does not mount a service-account token: the API answers it 401)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": CONTEXT,
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_pem).decode(),
                },
            }
        ],
        "users": [{"name": CONTEXT, "user": {"token": token} if token is not None else {}}],
        "contexts": [
            {
                "name": CONTEXT,
                "context": {"cluster": CONTEXT, "user": CONTEXT, "namespace": namespace},
            }
        ],
        "current-context": CONTEXT,
        "preferences": {},
    }
    return yaml.safe_dump(config, sort_keys=False)


def write(path: Path, server: str, token: str, ca_pem: bytes, namespace: str = "default") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, render(server, token, ca_pem, namespace).encode())
    return path


def write_private(path: Path, content: bytes) -> None:
    """Write a file only its owner can read (0600, whatever the umask), also when it exists:
    tokens, kubeconfigs and Secret volume files must not be readable by other local users."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(content)


def private_dir(path: Path) -> Path:
    """``mkdir -p`` whose last component is 0700 (whatever the umask)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path
