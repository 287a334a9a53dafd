"""Taint-based eviction as a real cluster does it: every new pod gets the two 300 s
``NoExecute`` tolerations (DefaultTolerationSeconds), and a lost node's pods are deleted
with ``DisruptionTarget`` ``DeletionByTaintManager`` once their toleration runs out (the
pure rules, and on the cluster through kubectl and a node loss)."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kubernetes import client as k8s

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.kubelet import free_pod_network
from rolloutrun_localcluster.taint_eviction import (
    NOT_READY_TAINT,
    UNREACHABLE_TAINT,
    eviction_due,
    no_execute_taints,
    with_default_tolerations,
)
from rolloutrun_localcluster.testing import api_client, eventually
from tests.support.kube_objects import pod_gone, pod_in_phase
from tests.support.kubectl import kubectl

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=UTC)
ADDED = "2026-12-04T11:59:00Z"


def _default(key: str) -> dict[str, Any]:
    return {"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}


def _taint(key: str, effect: str = "NoExecute") -> dict[str, Any]:
    return {"key": key, "effect": effect, "timeAdded": ADDED}


def test_new_pods_get_both_default_tolerations_unless_they_tolerate_the_taint() -> None:
    assert with_default_tolerations([]) == [_default(NOT_READY_TAINT), _default(UNREACHABLE_TAINT)]
    own = {"key": UNREACHABLE_TAINT, "operator": "Exists", "effect": "NoExecute"}
    assert with_default_tolerations([own]) == [own, _default(NOT_READY_TAINT)]
    every_key = {"operator": "Exists"}
    assert with_default_tolerations([every_key]) == [every_key]
    scheduling_only = {"key": UNREACHABLE_TAINT, "operator": "Exists", "effect": "NoSchedule"}
    assert with_default_tolerations([scheduling_only]) == [
        scheduling_only,
        _default(NOT_READY_TAINT),
        _default(UNREACHABLE_TAINT),
    ]


def test_when_a_pod_on_a_tainted_node_is_deleted() -> None:
    node = {"spec": {"taints": [_taint(UNREACHABLE_TAINT), _taint("gpu", "NoSchedule")]}}
    taints = no_execute_taints(node)
    assert taints == [_taint(UNREACHABLE_TAINT)]
    defaults = with_default_tolerations([])
    assert eviction_due(defaults, taints, NOW) == datetime(2026, 12, 4, 12, 4, tzinfo=UTC)
    assert eviction_due(defaults, [], NOW) is None
    assert eviction_due([], taints, NOW) == NOW  # not tolerated: now
    forever = {"key": UNREACHABLE_TAINT, "operator": "Exists"}
    assert eviction_due([forever, *defaults], taints, NOW) is None  # the first match is used
    brief = {**_default(UNREACHABLE_TAINT), "tolerationSeconds": 0}
    assert eviction_due([brief], taints, NOW) == NOW
    both = [_taint(UNREACHABLE_TAINT), _taint("maintenance")]
    mixed = [{**_default("maintenance"), "tolerationSeconds": 30}, *defaults]
    assert eviction_due(mixed, both, NOW) == datetime(2026, 12, 4, 11, 59, 30, tzinfo=UTC)


def _pod(name: str, tolerations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": "ignored:latest", "command": ["sleep", "300"]}],
    }
    if tolerations is not None:
        spec["tolerations"] = tolerations
    return {"metadata": {"name": name}, "spec": spec}


def test_a_lost_nodes_pods_go_when_their_toleration_runs_out(tmp_path: Path) -> None:
    with LocalCluster(tmp_path, pod_network=free_pod_network()) as cluster:
        core: Any = k8s.CoreV1Api(api_client(cluster))
        core.create_namespaced_pod("default", _pod("defaults"))
        brief = [{**_default(UNREACHABLE_TAINT), "tolerationSeconds": 3}]
        core.create_namespaced_pod("default", _pod("brief", brief))
        forever = [{"key": UNREACHABLE_TAINT, "operator": "Exists", "effect": "NoExecute"}]
        core.create_namespaced_pod("default", _pod("forever", forever))
        shown = kubectl(cluster, "get", "pod", "defaults", "-o", "jsonpath={.spec.tolerations}")
        assert json.loads(shown) == [_default(NOT_READY_TAINT), _default(UNREACHABLE_TAINT)]
        for name in ("defaults", "brief", "forever"):
            eventually(
                lambda name=name: pod_in_phase(core, "default", name, "Running"),
                what=f"{name} running",
            )
        cluster.lose_node("freeze")
        lost_at = datetime.now(UTC)
        try:
            evicted = eventually(
                lambda: _deleting(core, "brief"), timeout=30, what="brief pod evicted"
            )
            # 3 s from the taint's timeAdded, which is kept to whole seconds
            assert datetime.now(UTC) - lost_at >= timedelta(seconds=2)
            target = next(c for c in evicted.status.conditions if c.type == "DisruptionTarget")
            assert (target.status, target.reason) == ("True", "DeletionByTaintManager")
            assert target.message == "Taint manager: deleting due to NoExecute taint"
            for name in ("defaults", "forever"):  # 300 s, and for ever
                assert core.read_namespaced_pod(name, "default").metadata.deletion_timestamp is None
        finally:
            cluster.restore_node()
        eventually(lambda: pod_gone(core, "default", "brief"), what="evicted pod gone")
        for name in ("defaults", "forever"):
            pod = core.read_namespaced_pod(name, "default")
            assert pod.metadata.deletion_timestamp is None and pod.status.phase == "Running"


def _deleting(core: Any, name: str) -> Any:
    pod = core.read_namespaced_pod(name, "default")
    return pod if pod.metadata.deletion_timestamp is not None else None
