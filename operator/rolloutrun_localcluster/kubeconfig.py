"""Kubeconfig files for the local cluster: one for users and tools, one per pod."""

from __future__ import annotations

import base64
from pathlib import Path

import yaml

CONTEXT = "rolloutrun-local"


def render(server: str, token: str, ca_pem: bytes, namespace: str = "default") -> str:
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
        "users": [{"name": CONTEXT, "user": {"token": token}}],
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
    path.write_text(render(server, token, ca_pem, namespace))
    path.chmod(0o600)
    return path
