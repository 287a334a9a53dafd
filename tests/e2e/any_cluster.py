"""End-to-end runs through the Kubernetes API only, so they run against any cluster.

Why apart from :class:`~rolloutrun_localcluster.embedded.EmbeddedRun`: the other e2e tests
reach into the local cluster (pod processes, node loss, files on the host). The tests here do
only what a user can do on any cluster (create a claim and a RolloutRun, delete a pod, read
the status), so the same test body runs on the local cluster by default and on a real
cluster given ``--kubeconfig`` and ``--image`` (``make e2e``; see docs/operations.md).

On a real cluster the operator and the CRD are installed (the chart) and watch the test's
namespace; the storage is a ReadWriteMany claim of ``--storage-class`` (the cluster's
default when not given) or ``--storage-uri gs://...`` (the member pods' workload identity
must write there).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutrun_localcluster.testing import eventually
from rolloutrun_operator.api.v1alpha1 import GROUP, PLURAL, VERSION


@dataclass
class Target:
    """A cluster with the CRD and an operator watching ``namespace``."""

    api: Any
    namespace: str
    image: str | None = None
    storage_class: str | None = None
    storage_uri: str | None = None
    #: The local cluster's way to bind a claim (a volume on the host), else None.
    local_storage: Path | None = None
    created: list[tuple[str, str]] = field(default_factory=list)

    @property
    def core(self) -> Any:
        from kubernetes import client as k8s

        return k8s.CoreV1Api(self.api)

    @property
    def runs(self) -> Any:
        from kubernetes import client as k8s

        return k8s.CustomObjectsApi(self.api)

    def start(self, document: dict[str, Any]) -> ClusterRun:
        """Create the run (and its storage claim) in the target's namespace."""
        run = copy.deepcopy(document)
        name = f"{run['metadata']['name']}-{uuid.uuid4().hex[:5]}"
        run["metadata"] = {"name": name, "namespace": self.namespace}
        spec = run["spec"]
        if self.image:
            spec["images"] = {"trainer": self.image, "gym": self.image}
        spec["storage"] = self._storage(name)
        self.runs.create_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, run)
        return ClusterRun(self, name)

    def _storage(self, name: str) -> dict[str, Any]:
        if self.storage_uri:
            return {"uri": f"{self.storage_uri.rstrip('/')}/{name}"}
        claim = f"{name}-storage"
        if self.local_storage is not None:
            from rolloutrun_localcluster import storage_provisioner

            directory = self.local_storage / name
            directory.mkdir(parents=True)
            volume, bound = storage_provisioner.static_claim(name, self.namespace, directory)
            self.core.create_persistent_volume(volume)
            self.core.create_namespaced_persistent_volume_claim(self.namespace, bound)
            return {"uri": f"file://{directory}", "volumeClaimName": claim}
        spec: dict[str, Any] = {
            "accessModes": ["ReadWriteMany"],
            "resources": {"requests": {"storage": "1Gi"}},
        }
        if self.storage_class:
            spec["storageClassName"] = self.storage_class
        self.core.create_namespaced_persistent_volume_claim(
            self.namespace, {"metadata": {"name": claim}, "spec": spec}
        )
        return {"uri": f"file:///var/lib/rolloutrun/{name}", "volumeClaimName": claim}


@dataclass
class ClusterRun:
    """One RolloutRun on a :class:`Target`, read and disturbed through the API only."""

    target: Target
    name: str

    def status(self) -> dict[str, Any]:
        body = self.target.runs.get_namespaced_custom_object(
            GROUP, VERSION, self.target.namespace, PLURAL, self.name
        )
        return dict(body.get("status") or {})

    def condition(self, kind: str) -> dict[str, Any]:
        found = [c for c in self.status().get("conditions") or [] if c.get("type") == kind]
        return found[0] if found else {}

    def pod(self, suffix: str) -> str | None:
        """The running member pod whose name ends with ``suffix`` (e.g. ``-trainer``)."""
        pods = self.target.core.list_namespaced_pod(self.target.namespace).items
        for pod in pods:
            name = pod.metadata.name
            if name.startswith(self.name) and suffix in name and pod.status.phase == "Running":
                return str(name)
        return None

    def delete_pod(self, name: str) -> None:
        self.target.core.delete_namespaced_pod(name, self.target.namespace)

    def wait(self, check: Any, what: str, timeout: float) -> Any:
        return eventually(check, timeout=timeout, interval=0.5, what=f"{self.name}: {what}")


def fresh_namespace(api: Any, keep: bool) -> Iterator[str]:
    """A namespace of its own for the test's runs, deleted after (unless ``keep``)."""
    from kubernetes import client as k8s

    core: Any = k8s.CoreV1Api(api)
    name = f"rr-e2e-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    try:
        yield name
    finally:
        if not keep:
            core.delete_namespace(name)


class EmbeddedCluster:
    """The default target: a local cluster with the CRD, a namespace and the operator (under
    the chart's rules) watching it, as ``rolloutrun run`` sets them up."""

    NAMESPACE = "rr-e2e"

    def __init__(self, work_dir: Path) -> None:
        self.work_dir = work_dir
        self.cluster: Any = None
        self.operator: Any = None
        self.api: Any = None

    def __enter__(self) -> tuple[Any, str]:
        from kubernetes import client as k8s
        from kubernetes import config

        from rolloutrun_localcluster.cluster import LocalCluster
        from rolloutrun_localcluster.kubelet import free_pod_network
        from rolloutrun_localcluster.operator_access import operator_kubeconfig
        from rolloutrun_operator.api.crdgen import build_crd
        from rolloutrun_operator.handlers import Options
        from rolloutrun_operator.kube import permission_rules
        from rolloutrun_operator.runner import OperatorConfig, OperatorThread

        self.cluster = LocalCluster(self.work_dir / "cluster", pod_network=free_pod_network())
        self.cluster.start()
        try:
            self.api = config.new_client_from_config(config_file=str(self.cluster.kubeconfig_path))
            crds: Any = k8s.ApiextensionsV1Api(self.api)
            crds.create_custom_resource_definition(build_crd())
            k8s.CoreV1Api(self.api).create_namespace({"metadata": {"name": self.NAMESPACE}})
            operator = operator_kubeconfig(self.cluster, permission_rules())
            options = Options(kubeconfig=str(operator))
            self.operator = OperatorThread(
                OperatorConfig(options=options, namespaces=[self.NAMESPACE])
            ).start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self.api, self.NAMESPACE

    def __exit__(self, *_exc: object) -> None:
        if self.operator is not None:
            self.operator.stop()
        if self.api is not None:
            self.api.close()
        if self.cluster is not None:
            self.cluster.stop()
