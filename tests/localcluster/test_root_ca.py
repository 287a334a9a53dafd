"""``kube-root-ca.crt`` in every namespace, as a real cluster's root-ca-cert-publisher keeps
it: the CA a pod verifies the API server with (the pure repair rule, and on the cluster
through kubectl: made with a namespace, put back when deleted or edited, left alone in a
namespace being deleted)."""

from __future__ import annotations

from typing import Any

from kubernetes import client as k8s

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.controllers import (
    ROOT_CA_CONFIG_MAP,
    root_ca_config_map,
    root_ca_repair,
)
from rolloutrun_localcluster.testing import eventually
from tests.support.kubectl import kubectl

PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def test_the_repair_restores_data_and_description_and_keeps_the_rest() -> None:
    wanted = root_ca_config_map(PEM)
    assert wanted["metadata"]["name"] == "kube-root-ca.crt" == ROOT_CA_CONFIG_MAP
    assert wanted["data"] == {"ca.crt": PEM.decode()}
    assert root_ca_repair(None, wanted) == wanted
    kept = {
        "metadata": {
            **wanted["metadata"],
            "labels": {"team": "a"},
            "annotations": {**wanted["metadata"]["annotations"], "note": "x"},
            "resourceVersion": "5",
        },
        "data": dict(wanted["data"]),
    }
    assert root_ca_repair(kept, wanted) is None
    edited = {**kept, "data": {"ca.crt": "not a CA"}}
    repaired = root_ca_repair(edited, wanted)
    assert repaired is not None and repaired["data"] == wanted["data"]
    assert repaired["metadata"]["labels"] == {"team": "a"}
    assert repaired["metadata"]["annotations"]["note"] == "x"
    bare = {"metadata": {"name": ROOT_CA_CONFIG_MAP}, "data": dict(wanted["data"])}
    restored = root_ca_repair(bare, wanted)
    assert restored is not None
    assert restored["metadata"]["annotations"] == wanted["metadata"]["annotations"]


def _ca_in(cluster: LocalCluster, namespace: str) -> str | None:
    found = kubectl(cluster, "get", "configmaps", "-o", "name", namespace=namespace).split()
    if f"configmap/{ROOT_CA_CONFIG_MAP}" not in found:
        return None
    jsonpath = "jsonpath={.data.ca\\.crt}"
    return kubectl(
        cluster, "get", "configmap", ROOT_CA_CONFIG_MAP, "-o", jsonpath, namespace=namespace
    )


def test_every_namespace_has_the_clusters_ca_and_gets_it_back(
    cluster: LocalCluster, client: Any, namespace: str
) -> None:
    ca = cluster.ca_path.read_text()
    for space in ("default", "kube-system", namespace):
        assert eventually(lambda s=space: _ca_in(cluster, s), what=f"the CA in {space}") == ca
    kubectl(cluster, "delete", "configmap", ROOT_CA_CONFIG_MAP, namespace=namespace)
    assert eventually(lambda: _ca_in(cluster, namespace), what="the CA put back") == ca
    patch = '{"data": {"ca.crt": "edited"}}'
    kubectl(cluster, "patch", "configmap", ROOT_CA_CONFIG_MAP, "-p", patch, namespace=namespace)
    assert eventually(lambda: _ca_in(cluster, namespace) == ca, what="the edit undone")


def test_a_namespace_being_deleted_does_not_get_it_back(client: Any) -> None:
    core: Any = k8s.CoreV1Api(client)
    name = "t-root-ca-going"
    core.create_namespace({"metadata": {"name": name}})
    eventually(
        lambda: core.list_namespaced_config_map(name).items, what="the CA in the new namespace"
    )
    core.delete_namespace(name)

    def gone() -> bool:
        try:
            core.read_namespace(name)
        except k8s.ApiException as error:
            return error.status == 404
        return False

    eventually(gone, what="the namespace deleted, its ConfigMap not made again")
