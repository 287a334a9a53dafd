"""Which member pods ``rolloutrun run --preempt-every`` (and the elastic bench) may delete.

A pod of the current incarnation that runs and is not terminating, while that incarnation's
trainer is one: once the trainer is gone the incarnation is ending (the operator stops its
Gyms and workers), so deleting one of those preempts nothing, and used to count against
``--max-preemptions`` all the same."""

from __future__ import annotations

import datetime as dt

from kubernetes import client as k8s

from rolloutrun_localcluster.embedded import serving_uids
from rolloutrun_operator import naming


def pod(name: str, role: str, incarnation: int, *, phase: str = "Running", gone: bool = False):
    labels = {naming.LABEL_ROLE: role, naming.LABEL_INCARNATION: str(incarnation)}
    deleted = dt.datetime.now(dt.UTC) if gone else None
    meta = k8s.V1ObjectMeta(name=name, uid=f"uid-{name}", labels=labels, deletion_timestamp=deleted)
    return name, k8s.V1Pod(metadata=meta, status=k8s.V1PodStatus(phase=phase))


def test_the_running_members_of_the_current_incarnation_serve() -> None:
    pods = dict(
        [
            pod("r-i2-trainer", "trainer", 2),
            pod("r-i2-gym-0", "gym", 2),
            pod("r-i2-gym-1", "gym", 2, gone=True),  # already being deleted
            pod("r-i2-worker-0", "worker", 2, phase="Pending"),
            pod("r-i1-gym-0", "gym", 1),  # the last incarnation's, still stopping
        ]
    )
    assert serving_uids(pods, "2") == {
        "r-i2-trainer": "uid-r-i2-trainer",
        "r-i2-gym-0": "uid-r-i2-gym-0",
    }
    assert serving_uids(pods, "2", {"gym"}) == {"r-i2-gym-0": "uid-r-i2-gym-0"}


def test_an_incarnation_whose_trainer_is_gone_has_no_member_to_preempt() -> None:
    ending = dict(
        [
            pod("r-i2-trainer", "trainer", 2, gone=True),
            pod("r-i2-gym-0", "gym", 2),
            pod("r-i2-gym-1", "gym", 2),
        ]
    )
    assert serving_uids(ending, "2", {"gym"}) == {}  # before: both Gyms
    starting = dict(
        [pod("r-i3-trainer", "trainer", 3, phase="Pending"), pod("r-i3-gym-0", "gym", 3)]
    )
    assert serving_uids(starting, "3") == {}
