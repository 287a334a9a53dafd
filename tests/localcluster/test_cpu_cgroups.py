"""Per-pod CPU cgroups: the kubelet's mapping of requests and limits, with real processes.

A pod's processes (those forked later too) are in its cgroup, a CPU limit caps what they
get, the cgroup goes with the pod, and a node without a writable cpu controller says so and
still runs its pods. The real-process tests need the cgroup v1 cpu controller writable (root
on a v1 machine); elsewhere they are skipped and the fallback test is what runs."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_localcluster import cpucontrol
from rolloutrun_localcluster.cpucontrol import (
    BEST_EFFORT,
    BURSTABLE,
    GUARANTEED,
    PodCpu,
    cpu_millis,
    pod_cpu,
    qos_class,
)
from rolloutrun_localcluster.testing import api_client, eventually, local_cluster
from tests.support.kube_objects import pod_gone

PY = sys.executable


def _cpu_writable() -> bool:
    root = Path(cpucontrol.CPU_CGROUP_ROOT)
    probe = root / f"rolloutrun-probe-{time.monotonic_ns()}"
    try:
        probe.mkdir()
    except OSError:
        return False
    probe.rmdir()
    return (root / "cpu.cfs_quota_us").is_file()


needs_cgroups = pytest.mark.skipif(not _cpu_writable(), reason="no writable cgroup v1 cpu")


def _container(requests: dict[str, str] | None = None, limits: dict[str, str] | None = None):
    resources: dict[str, Any] = {}
    if requests:
        resources["requests"] = requests
    if limits:
        resources["limits"] = limits
    return {"name": "c", "resources": resources}


# ---------------------------------------------------------------- the mapping
def test_cpu_quantities_round_up_to_millicores() -> None:
    assert [cpu_millis(q) for q in ("250m", "0.5", "1", 2, "1.0001", "bad")] == [
        250,
        500,
        1000,
        2000,
        1001,
        0,
    ]


def test_qos_classes() -> None:
    assert qos_class({"containers": [_container()]}) == BEST_EFFORT
    assert qos_class({"containers": [_container({"cpu": "1"})]}) == BURSTABLE
    exact = {"cpu": "1", "memory": "1Gi"}
    assert qos_class({"containers": [_container(exact, exact)]}) == GUARANTEED
    assert qos_class({"containers": [_container(None, exact)]}) == GUARANTEED  # defaulted
    cpu_only = {"cpu": "1"}
    assert qos_class({"containers": [_container(cpu_only, cpu_only)]}) == BURSTABLE


def test_pod_shares_and_quota_as_the_kubelet_sets_them() -> None:
    assert pod_cpu({"containers": [_container()]}) == PodCpu(BEST_EFFORT, 0, 2, None)
    two = [_container({"cpu": "250m"}, {"cpu": "1"}), _container({"cpu": "500m"}, {"cpu": "1"})]
    assert pod_cpu({"containers": two}) == PodCpu(BURSTABLE, 750, 768, 200_000)
    # one container without a limit: no pod quota
    some = [_container({"cpu": "250m"}, {"cpu": "1"}), _container({"cpu": "500m"})]
    assert pod_cpu({"containers": some}).quota_us is None
    # an init container's larger request (and limit) counts: it runs alone, first
    spec = {"initContainers": [_container({"cpu": "2"}, {"cpu": "2"})], "containers": two}
    assert pod_cpu(spec) == PodCpu(BURSTABLE, 2000, 2048, 200_000)
    pods = [pod_cpu({"containers": two}), PodCpu(BEST_EFFORT, 0, 2, None)]
    assert cpucontrol.burstable_shares(pods) == 768


# ---------------------------------------------------------------- real processes
BUSY_AND_FORK = """
import os, sys, time
child = os.fork()          # a process started later, as a Ray node's are
end = time.time() + 600
while time.time() < end:
    pass
"""


def _pod(name: str, limits: dict[str, str] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": "ignored:latest",
        "command": [PY, "-c", BUSY_AND_FORK],
    }
    if limits:
        container["resources"] = {"limits": limits}
    return {
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [container],
        },
    }


@contextlib.contextmanager
def _cluster(directory: Path) -> Iterator[tuple[Any, Any]]:
    """A fresh cluster (its node's cgroup made at start, removed at stop) and its core API."""
    from kubernetes import client as k8s

    for cluster in local_cluster(directory):
        api = api_client(cluster)
        try:
            yield cluster, k8s.CoreV1Api(api)
        finally:
            api.close()


def _cpu_seconds(pids: set[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / 100.0  # USER_HZ


def _throttled(directory: Path) -> int:
    stat = dict(line.split() for line in (directory / "cpu.stat").read_text().splitlines())
    return int(stat["nr_throttled"])


@needs_cgroups
def test_a_limited_pods_processes_forked_later_included_get_no_more_than_its_quota(
    tmp_path: Path,
) -> None:
    with _cluster(tmp_path / "cluster") as (cluster, core):
        core.create_namespaced_pod("default", _pod("busy", {"cpu": "200m", "memory": "1Gi"}))
        pod = eventually(
            lambda: (
                (p := core.read_namespaced_pod("busy", "default")).status.phase == "Running" and p
            )
        )
        control = cluster.kubelet.cpu
        assert control is not None
        uid = pod.metadata.uid
        pids = eventually(lambda: len(found := control.pids(uid)) >= 2 and found)
        path, settings = control.pods[uid]
        assert settings.qos == GUARANTEED and settings.quota_us == 20_000
        assert path.parent == control.node_dir  # Guaranteed: in the node's cgroup
        assert (path / "cpu.cfs_quota_us").read_text().strip() == "20000"
        assert (path / "cpu.shares").read_text().strip() == "204"
        assert pod.status.qos_class == GUARANTEED
        before, started = _cpu_seconds(pids), time.monotonic()
        throttled = _throttled(path)
        time.sleep(2.0)
        used = _cpu_seconds(pids) - before
        elapsed = time.monotonic() - started
        # two busy processes, 0.2 CPU between them (a tick's rounding per process)
        assert used <= 0.2 * elapsed + 0.05, (used, elapsed)
        assert _throttled(path) > throttled
        core.delete_namespaced_pod("busy", "default", grace_period_seconds=0)
        eventually(lambda: pod_gone(core, "default", "busy"), what="pod deleted")
        eventually(lambda: not path.exists(), what="the pod's cgroup removed")
        assert uid not in control.pods
    assert not control.node_dir.exists()  # the node's cgroup went with the cluster


@needs_cgroups
def test_tiers_burstable_shares_follow_their_pods_and_besteffort_gets_two(tmp_path: Path) -> None:
    with _cluster(tmp_path / "cluster") as (cluster, core):
        burstable = _pod("burstable")
        burstable["spec"]["containers"][0]["resources"] = {"requests": {"cpu": "500m"}}
        core.create_namespaced_pod("default", burstable)
        core.create_namespaced_pod("default", _pod("besteffort"))
        control = cluster.kubelet.cpu
        assert control is not None
        eventually(lambda: len(control.pods) == 2)
        tiers = {
            cpu.qos: (path.parent.name, (path / "cpu.shares").read_text().strip())
            for path, cpu in control.pods.values()
        }
        assert tiers == {BURSTABLE: ("burstable", "512"), BEST_EFFORT: ("besteffort", "2")}
        read = (control.node_dir / "burstable" / "cpu.shares").read_text
        assert read().strip() == "512"
        assert (control.node_dir / "besteffort" / "cpu.shares").read_text().strip() == "2"
        core.delete_namespaced_pod("burstable", "default", grace_period_seconds=0)
        eventually(lambda: read().strip() == "2", what="the tier's shares without it")


def test_without_a_cpu_controller_the_node_says_so_and_pods_still_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cgroup root with no cpu controller (a cgroup v2 machine, a container without
    ``/sys/fs/cgroup/cpu``): one warning, the node's annotation, pods run as before."""
    monkeypatch.setenv(cpucontrol.ENV_CPU_CGROUP, str(tmp_path / "no-controller"))
    with _cluster(tmp_path / "cluster") as (cluster, core):
        assert cluster.kubelet.cpu is None
        node = core.read_node("local")
        note = node.metadata.annotations[cpucontrol.CPU_CONTROL_ANNOTATION]
        assert note.startswith("off: no cgroup v1 cpu controller at")
        pod = _pod("runs", {"cpu": "100m"})
        pod["spec"]["containers"][0]["command"] = [PY, "-c", "print('ran')"]
        core.create_namespaced_pod("default", pod)
        eventually(lambda: core.read_namespaced_pod("runs", "default").status.phase == "Succeeded")
        assert core.read_namespaced_pod_log("runs", "default") == "ran\n"
    warnings = [r for r in caplog.records if "without CPU control" in r.getMessage()]
    assert len(warnings) == 1
