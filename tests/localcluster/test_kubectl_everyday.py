"""The everyday kubectl commands against the local cluster, run with the real kubectl: the
imperative ``create`` family (kubectl sends those objects as protobuf), ``get`` with the
printer columns a real server fills, ``--sort-by``, ``describe`` and ``events``."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client as k8s

from rolloutrun_localcluster.cluster import LocalCluster

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")

Kubectl = Callable[..., str]


@pytest.fixture
def kubectl(cluster: LocalCluster, namespace: str) -> Kubectl:
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig_path)}

    def run(*args: str, stdin: str | None = None) -> str:
        done = subprocess.run(
            ["kubectl", "-n", namespace, *args],
            env=env,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, f"kubectl {' '.join(args)}: {done.stderr}"
        return done.stdout

    return run


def test_kubectl_create_makes_the_built_in_kinds(
    kubectl: Kubectl, client: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)
    rbac: Any = k8s.RbacAuthorizationV1Api(client)
    team = f"{namespace}-team"
    assert kubectl("create", "namespace", team) == f"namespace/{team} created\n"
    core.delete_namespace(team)
    kubectl("create", "configmap", "settings", "--from-literal=mode=fast", "--from-literal=x=")
    assert core.read_namespaced_config_map("settings", namespace).data == {"mode": "fast", "x": ""}
    kubectl("create", "secret", "generic", "storage", "--from-literal=key=s3cr\u00e9t")
    secret = core.read_namespaced_secret("storage", namespace)
    assert secret.type == "Opaque"
    assert base64.b64decode(secret.data["key"]).decode() == "s3cr\u00e9t"
    kubectl("create", "serviceaccount", "trainer")
    assert core.read_namespaced_service_account("trainer", namespace).metadata.name == "trainer"
    kubectl("create", "service", "clusterip", "web", "--tcp=80:8080")
    service = core.read_namespaced_service("web", namespace)
    assert service.spec.type == "ClusterIP" and service.spec.selector == {"app": "web"}
    port = service.spec.ports[0]
    assert (port.port, port.target_port, port.protocol) == (80, 8080, "TCP")
    kubectl("create", "role", "reader", "--verb=get,list", "--resource=pods")
    rule = rbac.read_namespaced_role("reader", namespace).rules[0]
    assert (rule.verbs, rule.resources, rule.api_groups) == (["get", "list"], ["pods"], [""])
    kubectl(
        "create",
        "rolebinding",
        "reader",
        "--role=reader",
        f"--serviceaccount={namespace}:trainer",
    )
    binding = rbac.read_namespaced_role_binding("reader", namespace)
    assert (binding.role_ref.kind, binding.role_ref.name) == ("Role", "reader")
    assert [(s.kind, s.name, s.namespace) for s in binding.subjects] == [
        ("ServiceAccount", "trainer", namespace)
    ]
    resources = json.loads(kubectl("get", "--raw", "/api/v1"))["resources"]
    if any(r["name"] == "serviceaccounts/token" for r in resources):
        assert kubectl("create", "token", "trainer").count(".") == 2  # a JWT
