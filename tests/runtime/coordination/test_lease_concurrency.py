"""Both cluster backends (RestLease, the keeper's; KubernetesLease, its fallback) called from
several threads at once, against the local cluster's real API server through a front that
holds one method's requests (:mod:`.slow_api`): a fence is answered while a write's round
trip is held (no mutex, not the same socket), and still from a read of the Lease begun
after it asked; reads at once share one GET."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_runtime.coordination import (
    FencedError,
    KubernetesLease,
    holder_identity,
)
from rolloutrun_runtime.lease_rest import ApiAccess, RestLease

from .slow_api import ANSWER_WITHIN_S, SlowApi, in_thread

ENDPOINTS = "rolloutrun.dev/endpoints-gym"


def through(backend: str, slow: SlowApi, cluster: LocalCluster, name: str, tmp: Path) -> Any:
    """The trainer's Lease (incarnation 1) of ``backend``, talking to the slow front."""
    identity = holder_identity("run-i1-trainer", 1)
    if backend == "rest":
        access = ApiAccess(slow.url, None, lambda: cluster.token)
        return RestLease(name, "default", identity, 1, access)
    from kubernetes import config

    client = config.new_client_from_config(config_file=str(slow.kubeconfig(tmp / "kubeconfig")))
    return KubernetesLease(name, "default", identity, 1, api_client=client)


def annotate(api: Any, name: str, value: str) -> None:
    """What the operator writes on the Lease (a replaced member's address)."""
    from kubernetes import client as k8s

    leases: Any = k8s.CoordinationV1Api(api)
    leases.patch_namespaced_lease(
        name,
        "default",
        {"metadata": {"annotations": {ENDPOINTS: value}}},
        _content_type="application/merge-patch+json",
    )


@pytest.mark.parametrize("backend", ["rest", "client"])
def test_a_fence_is_answered_while_a_write_is_held_and_reads_the_lease_anew(
    backend, api, cluster, slow, lease_name, tmp_path
):
    lease = through(backend, slow, cluster, lease_name, tmp_path)
    lease.acquire(timeout=10)
    slow.hold("PUT")
    writing, wrote = in_thread(lambda: lease.record_progress(train_step=7))
    try:
        slow.arrived("PUT")  # the write's round trip is in flight, held by the server
        annotate(api, lease_name, "moved")  # after the write's read: only a new read sees it
        fencing, fenced = in_thread(lease.ensure_held)
        fencing.join(ANSWER_WITHIN_S)
        assert fenced == [None] and writing.is_alive()
        reading, read = in_thread(lambda: lease.annotations(fresh=True))
        reading.join(ANSWER_WITHIN_S)
        assert read and read[0][ENDPOINTS] == "moved" and writing.is_alive()
    finally:
        slow.release()
    writing.join(30)
    # The held write met the operator's newer version: its compare-and-write read again
    assert wrote == [None]
    assert lease.annotations(fresh=True)["rolloutrun.dev/train-step"] == "7"
    assert lease.annotations(fresh=True)[ENDPOINTS] == "moved"


@pytest.mark.parametrize("backend", ["rest", "client"])
def test_after_a_takeover_fences_refuse_at_once_while_a_write_is_held(
    backend, api, cluster, slow, lease_name, tmp_path
):
    lease = through(backend, slow, cluster, lease_name, tmp_path)
    lease.acquire(timeout=10)
    slow.hold("PUT")
    writing, wrote = in_thread(lambda: lease.record_progress(latest_manifest="gs://b/stale.json"))
    try:
        slow.arrived("PUT")
        newer = KubernetesLease(lease_name, "default", "run-i2-trainer/2", 2, api_client=api)
        newer.acquire(timeout=10)  # straight to the API server
        fencing = [in_thread(lease.ensure_held) for _ in range(4)]
        for thread, _ in fencing:
            thread.join(ANSWER_WITHIN_S)
        assert writing.is_alive()  # every fence answered while the write is still held
        assert all(len(out) == 1 and isinstance(out[0], FencedError) for _, out in fencing)
    finally:
        slow.release()
    writing.join(30)
    assert len(wrote) == 1 and isinstance(wrote[0], FencedError)
    assert "rolloutrun.dev/latest-manifest" not in newer.annotations(fresh=True)


def test_reads_at_once_share_one_get_begun_after_each_asked(api, cluster, slow, lease_name):
    lease = through("rest", slow, cluster, lease_name, Path())
    lease.acquire(timeout=10)
    slow.hold("GET", at="response")
    first, early = in_thread(lambda: lease.annotations(fresh=True))
    try:
        slow.arrived("GET")  # the first read's answer is in hand: the Lease before the note
        annotate(api, lease_name, "moved")
        later = [in_thread(lambda: lease.annotations(fresh=True)) for _ in range(7)]
        later.append(in_thread(lease.ensure_held))
        time.sleep(2.0)  # a wait for the eight to ask, not a timed assertion
        gets = slow.seen["GET"]
    finally:
        slow.release()
    for thread, _ in [(first, early), *later]:
        thread.join(30)
    assert ENDPOINTS not in early[0]
    # None of the eight took the first read's older answer; one GET served them all
    assert [out[0][ENDPOINTS] for _, out in later[:-1]] == ["moved"] * 7
    assert later[-1][1] == [None]
    assert slow.seen["GET"] - gets == 1
