"""The operator against the local cluster, with stand-in member pods.

Member pods run a stand-in ``rolloutrun`` (first on the pods' PATH) that records its argv
and sleeps (a Gym one accepts connections on its port, as the readiness probe wants): the
tests that use this are about the operator; runs with the real trainer and Gym come with
the embedded ``rolloutrun run``.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.operator_access import operator_kubeconfig
from rolloutrun_localcluster.testing import api_client, local_cluster
from rolloutrun_operator.handlers import Options
from rolloutrun_operator.kube import permission_rules
from rolloutrun_operator.runner import OperatorConfig, OperatorThread

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "rolloutruns.rolloutrun.dev.yaml"
GROUP, VERSION, PLURAL = "rolloutrun.dev", "v1alpha1", "rolloutruns"

SHIM = """#!PYTHON
import os, socket, sys, time
root = os.environ["ROLLOUTRUN_LOCALCLUSTER_POD_DIR"]
with open(os.path.join(root, "argv"), "w") as out:
    out.write(" ".join(sys.argv[1:]))
if sys.argv[1] == "gym":  # accept connections on the Gym port, as the readiness probe wants
    port = int(sys.argv[sys.argv.index("--port") + 1])
    host = sys.argv[sys.argv.index("--host") + 1]
    server = socket.create_server((host, port))
    while True:
        server.accept()[0].close()
time.sleep(600)
"""


#: The claim every RolloutRun of these tests keeps its file:// storage on (validation
#: refuses file:// storage without one); :func:`create_storage_claim` makes it.
STORAGE_CLAIM = "run-storage"


def create_storage_claim(core: Any, namespace: str) -> None:
    """The run's storage claim in ``namespace`` (the default StorageClass binds it)."""
    spec = {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}
    core.create_namespaced_persistent_volume_claim(
        namespace, {"metadata": {"name": STORAGE_CLAIM}, "spec": spec}
    )


def shimmed_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A local cluster whose pods find the stand-in ``rolloutrun`` first on their PATH."""
    shims = tmp_path_factory.mktemp("bin")
    (shims / "rolloutrun").write_text(SHIM.replace("PYTHON", sys.executable))
    (shims / "rolloutrun").chmod(0o755)
    env = {"PATH": f"{shims}:{os.environ.get('PATH', '/usr/bin:/bin')}"}
    # image pulls retried after 2 s, not the kubelet's 10 s (test_pull_status_localcluster.py)
    yield from local_cluster(
        tmp_path_factory.mktemp("cluster"), extra_env=env, image_backoff=(2.0, 20.0)
    )


def client_with_crd(cluster: LocalCluster) -> Iterator[Any]:
    """An API client of ``cluster`` with the RolloutRun CRD installed."""
    from kubernetes import client as k8s

    client = api_client(cluster)
    k8s.ApiextensionsV1Api(client).create_custom_resource_definition(
        yaml.safe_load(CRD.read_text())
    )
    yield client
    client.close()


def operator_thread(
    cluster: LocalCluster, namespace: str, rules: list[dict[str, Any]] | None = None
) -> OperatorThread:
    """The operator as the embedded default runs it: a thread beside the local cluster, as
    its own ServiceAccount bound to the chart's rules (``rules`` replaces them: a test of a
    missing permission gives its operator an account of its own)."""
    account = "rolloutrun-operator" if rules is None else f"rolloutrun-operator-{namespace}"
    granted = permission_rules() if rules is None else rules
    kubeconfig = operator_kubeconfig(cluster, granted, name=account)
    options = Options(kubeconfig=str(kubeconfig))
    return OperatorThread(OperatorConfig(options=options, namespaces=[namespace]))


def rolloutrun(
    name: str,
    *,
    storage_uri: str = "file:///tmp/rolloutrun-test",
    gym_replicas: int = 2,
    lease_seconds: int = 2,
) -> dict[str, Any]:
    """A RolloutRun of stand-in pods on the run's storage claim, quick to recover: short
    grace periods, no backoff; tests change what they are about in the returned body."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RolloutRun",
        "metadata": {"name": name},
        "spec": {
            "storage": {"uri": storage_uri, "volumeClaimName": STORAGE_CLAIM},
            "gym": {"replicas": gym_replicas, "port": 8000, "terminationGracePeriodSeconds": 2},
            "trainer": {"terminationGracePeriodSeconds": 2},
            "recovery": {
                "backoffSeconds": 0,
                "maxRestarts": 3,
                "leaseDurationSeconds": lease_seconds,
            },
            "run": {
                "workers": {"backend": "inprocess"},
                # below the trainer's terminationGracePeriodSeconds, as the CRD requires
                "checkpointing": {"preemptionGraceSeconds": 1},
            },
        },
    }


class RunNamespace:
    """A fresh namespace (``prefix`` and a random suffix) with the run's storage claim, and
    the API clients and reads the tests use in it."""

    def __init__(self, api: Any, prefix: str) -> None:
        from kubernetes import client as k8s

        self.name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.core: Any = k8s.CoreV1Api(api)
        self.runs: Any = k8s.CustomObjectsApi(api)
        self.rbac: Any = k8s.RbacAuthorizationV1Api(api)
        self.leases: Any = k8s.CoordinationV1Api(api)
        self.core.create_namespace({"metadata": {"name": self.name}})
        create_storage_claim(self.core, self.name)

    def create_run(self, body: dict[str, Any]) -> None:
        self.runs.create_namespaced_custom_object(GROUP, VERSION, self.name, PLURAL, body)

    def run(self, name: str) -> dict[str, Any]:
        return self.runs.get_namespaced_custom_object(GROUP, VERSION, self.name, PLURAL, name)

    def warning_reasons(self, name: str) -> set[str]:
        """The reasons of the Warning Events about the object ``name``."""
        selector = f"involvedObject.name={name},type=Warning"
        events = self.core.list_namespaced_event(self.name, field_selector=selector).items
        return {event.reason for event in events}

    def ready_condition(self, name: str) -> dict[str, Any]:
        """The run's Ready condition, ``{}`` while it has none."""
        for item in (self.run(name).get("status") or {}).get("conditions") or []:
            if item["type"] == "Ready":
                return dict(item)
        return {}
