"""Kopf runs unchanged against the emulator: it lists, watches, creates children, patches
status through the subresource, manages its finalizer and survives dropped and expired
watches."""

from __future__ import annotations

from typing import Any

from kubernetes import client as k8s

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import eventually
from tests.support.kopf_operator import GROUP, PLURAL, VERSION, KopfThread
from tests.support.kube_objects import gone as _gone


def _widget(name: str, size: int = 2, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Widget",
        "metadata": {"name": name},
        "spec": {"size": size, **spec},
    }


def test_kopf_operator_lifecycle(
    cluster: LocalCluster, client: Any, widgets: Any, namespace: str
) -> None:
    core: Any = k8s.CoreV1Api(client)

    def get(name: str) -> Any:
        return widgets.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    with KopfThread(cluster, namespace) as kopf_thread:
        widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _widget("w1"))
        created = eventually(
            lambda: (get("w1").get("status") or {}).get("phase") == "Created", what="status"
        )
        assert created
        w1 = get("w1")
        assert w1["metadata"]["finalizers"] == ["test.rolloutrun.dev/finalizer"]
        assert w1["metadata"]["generation"] == 1, (
            "status and metadata writes must not bump generation"
        )
        pod = eventually(lambda: _running(core, namespace, "w1-pod"), what="child pod running")
        assert pod.metadata.owner_references[0].uid == w1["metadata"]["uid"]
        assert core.read_namespaced_config_map("w1-config", namespace).data == {"size": "2"}

        # Kopf posts its handler log records as Events about the object.
        def posted() -> bool:
            found = core.list_namespaced_event(namespace, field_selector="involvedObject.name=w1")
            return any("children of w1 created" in (e.message or "") for e in found.items)

        eventually(posted, what="Kopf's event")

        # A spec change bumps the generation and reaches the field handler.
        widgets.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "w1", {"spec": {"size": 5}}
        )
        eventually(lambda: (get("w1").get("status") or {}).get("size") == 5, what="resize handled")
        assert get("w1")["metadata"]["generation"] == 2

        # The API server drops every watch (a restart), and forgets its history (410 Gone).
        assert cluster.drop_watches() > 0
        cluster.compact()
        cluster.drop_watches()
        widgets.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _widget("w2"))
        eventually(
            lambda: (get("w2").get("status") or {}).get("phase") == "Created",
            what="w2 after reconnect",
        )

        # Deletion: Kopf's finalizer holds the object until its delete handler ran; then
        # the garbage collector removes the adopted children and the kubelet stops the pod.
        widgets.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "w1")
        eventually(lambda: _gone(lambda: get("w1")), what="w1 deleted after its finalizer")
        assert core.read_namespaced_config_map("w1-deleted", namespace).data == {"by": "kopf"}
        eventually(
            lambda: _gone(lambda: core.read_namespaced_pod("w1-pod", namespace)),
            what="child pod GC",
        )
        eventually(
            lambda: _gone(lambda: core.read_namespaced_config_map("w1-config", namespace)),
            what="child CM GC",
        )
        assert kopf_thread.error is None
    assert kopf_thread.error is None


def _running(core: Any, namespace: str, name: str) -> Any:
    try:
        pod = core.read_namespaced_pod(name, namespace)
    except k8s.ApiException:
        return None
    return pod if pod.status.phase == "Running" else None
