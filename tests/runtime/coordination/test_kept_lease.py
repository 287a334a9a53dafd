"""KeptLease: the trainer's Kubernetes Lease held through a keeper process, over real HTTP
against the local cluster's API server. The same semantics as KubernetesLease in-process
(acquire, progress, release, fencing by a newer incarnation); a dead keeper is a lost lease;
a dead trainer takes its keeper with it without a release, and never imports kubernetes
itself (that the trainer's entry point starts its keeper before torch:
tests/runtime/test_trainer_startup_imports.py). Calls from several trainer threads are in
flight at once: a fence is answered while another call's request is held by a slow API
server (:mod:`.slow_api`), and a keeper that dies fails every call in flight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import eventually
from rolloutrun_runtime.contract.pod import (
    ENV_INCARNATION,
    ENV_LEASE_NAME,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
)
from rolloutrun_runtime.coordination import FencedError, KubernetesLease, LeaseHolder
from rolloutrun_runtime.lease_keeper import KeptLease

from .slow_api import ANSWER_WITHIN_S, SlowApi, in_thread

REPO = Path(__file__).resolve().parents[3]


def pod_env(cluster: LocalCluster, name: str, incarnation: int) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), str(REPO / "operator")]),
        "KUBECONFIG": str(cluster.kubeconfig_path),
        ENV_LEASE_NAME: name,
        ENV_POD_NAMESPACE: "default",
        ENV_POD_NAME: f"run-i{incarnation}-trainer",
        ENV_INCARNATION: str(incarnation),
    }


def slow_env(cluster: LocalCluster, slow: SlowApi, name: str, tmp_path: Path) -> dict[str, str]:
    """The pod environment of incarnation 1, its kubeconfig naming the slow front."""
    kubeconfig = slow.kubeconfig(tmp_path / "slow-kubeconfig")
    return {**pod_env(cluster, name, 1), "KUBECONFIG": str(kubeconfig)}


def holder(api: Any, name: str) -> str | None:
    from kubernetes import client as k8s

    leases: Any = k8s.CoordinationV1Api(api)
    return leases.read_namespaced_lease(name, "default").spec.holder_identity


def test_a_kept_lease_acquires_records_and_releases_through_its_keeper(cluster, api, lease_name):
    import datetime as dt

    lease = KeptLease(environ=pod_env(cluster, lease_name, 1))
    assert isinstance(lease, LeaseHolder) and lease.identity == "run-i1-trainer/1"
    lease.acquire(timeout=10)
    lease.start_renewing(interval=0.2)
    lease.renew()
    lease.ensure_held()
    moment = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    lease.record_progress(
        train_step=3, latest_manifest="gs://b/m3.json", latest_manifest_time=moment
    )
    notes = lease.annotations(fresh=True)
    assert notes["rolloutrun.dev/train-step"] == "3"
    assert notes["rolloutrun.dev/latest-manifest-time"] == "2026-01-02T03:04:05Z"
    assert holder(api, lease_name) == "run-i1-trainer/1"
    lease.stop(release=True)
    assert holder(api, lease_name) is None
    assert lease.process.poll() == 0 and lease.lost is None


def test_the_keeper_holds_the_lease_without_importing_the_kubernetes_client(
    cluster, api, lease_name, capfd
):
    """Its ~0.55 s of import CPU would compete with the trainer's torch import for the pod's
    cores; the keeper's own imports (``-X importtime``, on its stderr) leave it out."""
    lease = KeptLease(environ={**pod_env(cluster, lease_name, 1), "PYTHONPROFILEIMPORTTIME": "1"})
    lease.acquire(timeout=10)
    lease.record_progress(train_step=1)
    assert holder(api, lease_name) == "run-i1-trainer/1"
    lease.stop(release=True)
    assert holder(api, lease_name) is None
    imported = [
        line.split("|")[-1].strip()
        for line in capfd.readouterr().err.splitlines()
        if line.startswith("import time:")
    ]
    assert "rolloutrun_runtime.lease_rest" in imported  # the probe saw the keeper's imports
    assert [name for name in imported if name.split(".")[0] == "kubernetes"] == []


def test_a_newer_incarnation_fences_the_kept_lease(cluster, api, lease_name):
    lost = threading.Event()
    old = KeptLease(on_lost=lambda error: lost.set(), environ=pod_env(cluster, lease_name, 1))
    old.acquire(timeout=10)
    old.start_renewing(interval=0.05)
    new = KubernetesLease(lease_name, "default", "run-i2-trainer/2", 2, api_client=api)
    new.acquire(timeout=10)
    eventually(lost.is_set, timeout=30, what="the keeper's renewal to find the lease lost")
    with pytest.raises(FencedError):
        old.ensure_held()
    with pytest.raises(FencedError):
        old.record_progress(latest_manifest="gs://b/stale.json")
    old.stop(release=True)  # never releases what the newer incarnation holds
    assert holder(api, lease_name) == "run-i2-trainer/2"


def test_a_keeper_that_dies_is_a_lost_lease(cluster, api, lease_name):
    errors: list[FencedError] = []
    lease = KeptLease(on_lost=errors.append, environ=pod_env(cluster, lease_name, 1))
    lease.acquire(timeout=10)
    lease.process.send_signal(signal.SIGKILL)
    eventually(lambda: errors, timeout=30, what="on_lost after the keeper died")
    assert "keeper exited" in str(errors[0])
    with pytest.raises(FencedError):
        lease.ensure_held()
    lease.stop(release=True)


def test_a_preemption_notice_leaves_the_keeper_holding_the_lease(cluster, api, lease_name):
    """SIGTERM to every process of the pod (a runtime that signals the group, or the local
    cluster's kill of a pod's processes) is the trainer's notice: its forced snapshot needs
    the Lease, so the keeper ignores it and ends only with its trainer."""
    errors: list[FencedError] = []
    lease = KeptLease(on_lost=errors.append, environ=pod_env(cluster, lease_name, 1))
    lease.acquire(timeout=10)
    lease.process.send_signal(signal.SIGTERM)
    lease.process.send_signal(signal.SIGINT)
    lease.record_progress(latest_manifest="file:///forced/MANIFEST.json")  # answered: alive
    lease.ensure_held()
    assert lease.process.poll() is None and not errors
    lease.stop(release=True)
    assert holder(api, lease_name) is None


TRAINER = """
import json, os, sys, time
from rolloutrun_runtime.lease_keeper import KeptLease
lease = KeptLease()
lease.acquire(timeout=10)
lease.start_renewing(interval=0.1)
forked = os.fork()  # a process of the trainer that outlives it, holding the keeper's pipe
if forked == 0:
    time.sleep(600)
    os._exit(0)
seen = {"keeper": lease.process.pid, "forked": forked, "kubernetes": "kubernetes" in sys.modules}
print(json.dumps(seen))
sys.stdout.flush()
time.sleep(600)
"""


def exited(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_killed_trainer_takes_its_keeper_along_without_a_release(cluster, api, lease_name):
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER],
        env=pod_env(cluster, lease_name, 1),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert trainer.stdout is not None
    seen = json.loads(trainer.stdout.readline())
    try:
        assert seen["kubernetes"] is False  # the client lives in the keeper only
        assert holder(api, lease_name) == "run-i1-trainer/1"
        trainer.kill()
        trainer.wait()
        # Its input never ends (the forked process holds the pipe open): the kernel's
        # parent-death signal ends the keeper.
        eventually(lambda: exited(seen["keeper"]), timeout=30, what="the keeper to exit")
        assert not exited(seen["forked"])
        assert holder(api, lease_name) == "run-i1-trainer/1"  # not released: it expires
    finally:
        trainer.kill()
        trainer.wait()
        os.kill(seen["forked"], signal.SIGKILL)


def test_a_fence_is_answered_while_a_progress_write_is_held_by_the_api_server(
    cluster, api, slow, lease_name, tmp_path
):
    """Measured under load, a fence waited up to 2.4 s behind other calls on the keeper's
    one pipe; now each call is in flight on its own, and the fence still reads the Lease."""
    lease = KeptLease(environ=slow_env(cluster, slow, lease_name, tmp_path))
    lease.acquire(timeout=10)
    slow.hold("PUT")
    writing, wrote = in_thread(lambda: lease.record_progress(train_step=7))
    try:
        slow.arrived("PUT")  # the write's round trip is in flight, held by the server
        gets = slow.seen["GET"]
        fencing, fenced = in_thread(lease.ensure_held)
        fencing.join(ANSWER_WITHIN_S)
        assert fenced == [None] and writing.is_alive()
        assert slow.seen["GET"] == gets + 1  # decided by a read of its own, not a cached one
    finally:
        slow.release()
    writing.join(30)
    assert wrote == [None]
    assert lease.annotations(fresh=True)["rolloutrun.dev/train-step"] == "7"
    lease.stop(release=True)
    assert holder(api, lease_name) is None


def test_after_a_takeover_each_call_in_flight_gets_its_own_answer(
    cluster, api, slow, lease_name, tmp_path
):
    lease = KeptLease(environ=slow_env(cluster, slow, lease_name, tmp_path))
    lease.acquire(timeout=10)
    slow.hold("PUT")
    writing, wrote = in_thread(lambda: lease.record_progress(latest_manifest="gs://b/stale.json"))
    try:
        slow.arrived("PUT")
        newer = KubernetesLease(lease_name, "default", "run-i2-trainer/2", 2, api_client=api)
        newer.acquire(timeout=10)
        newer.record_progress(train_step=99)
        fences = [in_thread(lease.ensure_held) for _ in range(4)]
        reads = [in_thread(lambda: lease.annotations(fresh=True)) for _ in range(4)]
        for thread, _ in fences + reads:
            thread.join(ANSWER_WITHIN_S)
        assert writing.is_alive()  # all eight answered while the write is still held
        assert all(len(out) == 1 and isinstance(out[0], FencedError) for _, out in fences)
        assert [out[0]["rolloutrun.dev/train-step"] for _, out in reads] == ["99"] * 4
    finally:
        slow.release()
    writing.join(30)
    assert len(wrote) == 1 and isinstance(wrote[0], FencedError)
    lease.stop(release=True)  # never releases what the newer incarnation holds
    assert holder(api, lease_name) == "run-i2-trainer/2"
    assert "rolloutrun.dev/latest-manifest" not in newer.annotations(fresh=True)


def test_a_keeper_that_dies_fails_every_call_in_flight(cluster, api, slow, lease_name, tmp_path):
    errors: list[FencedError] = []
    lease = KeptLease(on_lost=errors.append, environ=slow_env(cluster, slow, lease_name, tmp_path))
    lease.acquire(timeout=10)
    slow.hold("GET", at="response")
    try:
        writing, wrote = in_thread(lambda: lease.record_progress(train_step=3))
        slow.arrived("GET")  # the write's read
        fencing, fenced = in_thread(lease.ensure_held)
        slow.arrived("GET", 2)  # and the fence's, both in flight
        lease.process.send_signal(signal.SIGKILL)
        for thread in (writing, fencing):
            thread.join(30)
        assert isinstance(wrote[0], FencedError) and isinstance(fenced[0], FencedError)
        eventually(lambda: errors, timeout=30, what="on_lost after the keeper died")
        with pytest.raises(FencedError):
            lease.ensure_held()
    finally:
        slow.release()
    lease.stop(release=True)
    assert holder(api, lease_name) == "run-i1-trainer/1"  # not released: it expires
