"""PodGC as kube-controller-manager runs it: a pod whose Node was deleted ends ``Failed`` with
``DisruptionTarget`` ``DeletionByPodGC`` and is force-deleted once the node stayed missing
for the quarantine; a pod deleted before it was scheduled ends ``Failed`` (the pure rules,
and on a two-node cluster through kubectl)."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from rolloutrun_localcluster import podgc
from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.kubelet import free_pod_network
from rolloutrun_localcluster.processes import pod_tag, tagged_pids
from rolloutrun_localcluster.testing import api_client, eventually
from tests.support.kube_objects import pod_gone, pod_in_phase
from tests.support.kubectl import kubectl

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
FINALIZER = "example.com/hold"


def _pod(name: str, node: str | None = None, deleting: bool = False, phase: str = "Running"):
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-04T12:00:00Z"
    spec = {"nodeName": node} if node else {}
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def test_a_missing_node_is_quarantined_and_a_node_back_keeps_its_pods() -> None:
    pods = [_pod("a", "gone"), _pod("b", "here"), _pod("c")]
    first = podgc.missing_nodes(pods, {"here"}, {}, now=100.0)
    assert first == {"gone": 100.0}
    assert podgc.plan(pods, first, now=139.0, quarantine=40.0) == []
    later = podgc.missing_nodes(pods, {"here"}, first, now=140.0)
    assert later == {"gone": 100.0}  # the first sighting counts
    assert podgc.plan(pods, later, now=140.0, quarantine=40.0) == [
        podgc.Collect("ns", "a", "uid-a", orphaned=True)
    ]
    assert podgc.missing_nodes(pods, {"here", "gone"}, later, now=150.0) == {}


def test_only_unscheduled_pods_being_deleted_are_collected_without_a_node() -> None:
    pods = [_pod("pending"), _pod("deleted", deleting=True), _pod("bound", "here", True)]
    assert podgc.plan(pods, {}, now=0.0, quarantine=40.0) == [
        podgc.Collect("ns", "deleted", "uid-deleted", orphaned=False)
    ]


def test_the_status_written_before_the_delete() -> None:
    status = {"phase": "Running", "conditions": [{"type": "Ready", "status": "False"}]}
    orphaned = podgc.failed_status(status, orphaned=True, now=NOW)
    assert orphaned is not None and orphaned["phase"] == "Failed"
    target = orphaned["conditions"][-1]
    assert target["type"] == "DisruptionTarget" and target["status"] == "True"
    assert target["reason"] == "DeletionByPodGC" == podgc.ORPHANED_REASON
    assert target["message"] == "PodGC: node no longer exists"
    assert orphaned["conditions"][0] == {"type": "Ready", "status": "False"}
    unscheduled = podgc.failed_status({"phase": "Pending"}, orphaned=False, now=NOW)
    assert unscheduled == {"phase": "Failed"}
    assert podgc.failed_status({"phase": "Succeeded"}, orphaned=True, now=NOW) is None


def _held(name: str, node: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": "ignored:latest", "command": ["sleep", "300"]}],
        "nodeSelector": {"kubernetes.io/hostname": node or "no-such-node"},
    }
    return {"metadata": {"name": name, "finalizers": [FINALIZER]}, "spec": spec}


def _release(core: Any, name: str) -> None:
    core.patch_namespaced_pod(name, "default", {"metadata": {"finalizers": None}})


def test_a_deleted_node_s_pods_and_a_pod_deleted_unscheduled_end_failed(tmp_path: Path) -> None:
    quarantine = 1.5
    options: dict[str, Any] = {"nodes": 2, "pod_gc": (0.2, quarantine)}
    with LocalCluster(tmp_path, pod_network=free_pod_network(), **options) as cluster:
        core: Any = k8s.CoreV1Api(api_client(cluster))
        core.create_namespaced_pod("default", _held("held", "local-2"))
        free = _held("free", "local-2")
        free["metadata"].pop("finalizers")
        core.create_namespaced_pod("default", free)
        core.create_namespaced_pod("default", _held("never-scheduled", None))
        for name in ("held", "free"):
            eventually(
                lambda name=name: pod_in_phase(core, "default", name, "Running"),
                what=f"{name} running",
            )
        tag = pod_tag(core.read_namespaced_pod("free", "default").metadata.uid)
        assert tagged_pids(tag)
        kubectl(cluster, "delete", "node", "local-2")
        deleted_at = time.monotonic()
        core.delete_namespaced_pod("never-scheduled", "default")

        unscheduled = eventually(
            lambda: pod_in_phase(core, "default", "never-scheduled", "Failed"),
            what="unscheduled pod failed",
        )
        assert not any(c.type == "DisruptionTarget" for c in unscheduled.status.conditions or [])
        held = eventually(
            lambda: pod_in_phase(core, "default", "held", "Failed"), what="orphaned pod failed"
        )
        assert time.monotonic() - deleted_at >= quarantine
        target = next(c for c in held.status.conditions if c.type == "DisruptionTarget")
        assert (target.status, target.reason) == ("True", "DeletionByPodGC")
        assert target.message == "PodGC: node no longer exists"
        assert held.metadata.deletion_timestamp is not None
        assert held.metadata.deletion_grace_period_seconds == 0
        eventually(lambda: pod_gone(core, "default", "free"), what="unheld orphan gone")
        eventually(lambda: not tagged_pids(tag), what="its processes killed")
        described = kubectl(cluster, "get", "pod", "held", "-o", "jsonpath={.status.phase}")
        assert described == "Failed"
        for name in ("held", "never-scheduled"):
            _release(core, name)
            eventually(lambda name=name: pod_gone(core, "default", name), what=f"{name} gone")
