"""The runtime's half of the pod contract: config path, listen address, the lease in the run.

Fencing end to end within one machine: two trainers' leases on one lease file, the older
incarnation's trainer-checkpoint commit is refused once the newer one took the lease, and
nothing of it becomes durable.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from pathlib import Path

import pytest

from rolloutrun_runtime.coordination import (
    ANNOTATION_ANCHOR_STEP,
    ANNOTATION_LATEST_MANIFEST,
    ANNOTATION_LATEST_MANIFEST_TIME,
    ANNOTATION_REWARD,
    ANNOTATION_TRAIN_STEP,
    FencedError,
    FileLease,
)
from rolloutrun_runtime.pod import (
    PodLease,
    fenced_checkpointer,
    generation_address,
    resolve_config_path,
)
from rolloutrun_runtime.storage import open_storage


def test_a_missing_absolute_config_path_is_found_under_the_local_cluster_pod_root(tmp_path):
    inside = tmp_path / "root" / "etc" / "rolloutrun" / "run.yaml"
    inside.parent.mkdir(parents=True)
    inside.write_text("seed: 1\n")
    env = {"ROLLOUTRUN_LOCALCLUSTER_ROOT": str(tmp_path / "root")}
    assert resolve_config_path("/etc/rolloutrun/run.yaml", env) == str(inside)
    # Outside the local cluster, or when the path exists, the path is used as given.
    assert resolve_config_path("/etc/rolloutrun/run.yaml", {}) == "/etc/rolloutrun/run.yaml"
    assert resolve_config_path(str(inside), env) == str(inside)
    assert resolve_config_path("/nowhere/run.yaml", env) == "/nowhere/run.yaml"


def test_generation_servers_listen_on_the_pod_ip_and_the_generation_port():
    env = {"POD_IP": "127.0.0.9", "ROLLOUTRUN_GENERATION_PORT": "8100"}
    assert generation_address(env) == ("127.0.0.9", 8100)
    assert generation_address({}) == ("127.0.0.1", 0)


def lease_files(path: Path, incarnation: int) -> FileLease:
    return FileLease(
        path, f"trainer-i{incarnation}/{incarnation}", incarnation, duration_seconds=30
    )


def test_a_trainer_of_an_older_incarnation_never_commits_a_checkpoint(tmp_path):
    lease_path = tmp_path / "lease.json"
    storage_uri = f"file://{tmp_path / 'storage'}"
    old = lease_files(lease_path, 1)
    old.acquire(timeout=5)
    old_pod = PodLease(old)
    old_checkpointer = fenced_checkpointer(open_storage(storage_uri), 3, old_pod.fence, None)
    old_checkpointer.publish_files(2, {"model.pt": b"weights-2"})
    assert old_checkpointer.committed_steps() == [2]

    new = lease_files(lease_path, 2)
    new.acquire(timeout=5)  # the next incarnation takes the lease over at once
    with pytest.raises(FencedError):
        old_checkpointer.publish_files(4, {"model.pt": b"weights-4"})
    assert old_checkpointer.committed_steps() == [2]  # nothing of step 4 is durable

    anchors: list[int] = []
    new_checkpointer = fenced_checkpointer(
        open_storage(storage_uri), 3, PodLease(new).fence, anchors.append
    )
    new_checkpointer.publish_files(4, {"model.pt": b"weights-4"})
    assert new_checkpointer.committed_steps() == [2, 4] and anchors == [4]


def test_progress_reaches_the_lease_in_order_off_the_event_loop(tmp_path):
    lease = lease_files(tmp_path / "lease.json", 3)
    lease.acquire(timeout=5)
    pod = PodLease(lease)
    for step in range(1, 6):
        pod.on_step({"step": step})
    pod.on_anchor(4)
    published = dt.datetime(2026, 5, 1, 10, 0, 0, tzinfo=dt.UTC)
    pod.on_published(
        {
            "train_step": 3,  # the snapshot's captured step: older, never written back
            "anchor_step": 2,  # anchored to an older step_<N>: the recorded anchor stays 4
            "manifest_uri": "file:///s/rollout_snapshots/snapshot_000002/MANIFEST.json",
            "published_at": published.timestamp(),
        }
    )
    pod.close()  # waits for the queued writes
    annotations = json.loads((tmp_path / "lease.json").read_text())["annotations"]
    assert annotations[ANNOTATION_TRAIN_STEP] == "5"
    assert annotations[ANNOTATION_ANCHOR_STEP] == "4"
    assert annotations[ANNOTATION_LATEST_MANIFEST].endswith("snapshot_000002/MANIFEST.json")
    assert annotations[ANNOTATION_LATEST_MANIFEST_TIME] == "2026-05-01T10:00:00Z"


def test_each_step_writes_its_mean_reward_with_its_step(tmp_path):
    lease = lease_files(tmp_path / "lease.json", 1)
    lease.acquire(timeout=5)
    pod = PodLease(lease)
    pod.on_step({"step": 1, "reward_mean": 0.123456789})
    pod.on_step({"step": 2, "reward_mean": float("nan")})  # no number: the last one stays
    pod.close()
    annotations = json.loads((tmp_path / "lease.json").read_text())["annotations"]
    assert annotations[ANNOTATION_TRAIN_STEP] == "2"
    assert annotations[ANNOTATION_REWARD] == "0.123457"


async def test_a_lost_lease_cancels_the_run():
    pod = PodLease(None)
    task = asyncio.ensure_future(asyncio.sleep(60))
    pod.attach(asyncio.get_running_loop(), task)
    error = FencedError("lease now held by 'trainer-i2/2'")
    await asyncio.to_thread(pod.lost, error)  # the renewal thread reports the loss
    with pytest.raises(asyncio.CancelledError):
        await task
    assert pod.lost_error is error


def test_progress_recorded_while_a_write_is_slow_joins_one_write(tmp_path):
    """Only the newest values matter: while the API server is slow, each step's progress
    is not a write of its own (they queued on the Lease keeper, ahead of the fences)."""
    import fcntl

    path = tmp_path / "lease.json"
    lease = lease_files(path, 1)
    lease.acquire(timeout=5)
    pod = PodLease(lease)
    with open(path.with_name("lease.json.lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the first write waits on the store, for real
        pod.on_step({"step": 1})
        for step in range(2, 51):
            pod.on_step({"step": step, "reward_mean": step / 100})
        pod.on_published({"manifest_uri": "file:///s/m1.json", "published_at": 1.0e9})
        pod.on_published({"manifest_uri": "file:///s/m2.json", "published_at": None})
        fcntl.flock(held, fcntl.LOCK_UN)
    pod.close()
    stored = json.loads(path.read_text())
    assert int(stored["version"]) <= 3  # the acquire, the slow write and one more
    notes = stored["annotations"]
    assert (notes[ANNOTATION_TRAIN_STEP], notes[ANNOTATION_REWARD]) == ("50", "0.5")
    assert notes[ANNOTATION_LATEST_MANIFEST] == "file:///s/m2.json"
    # m2 came without a time: stamped at its write, never m1's (2001-09-09)
    assert not notes[ANNOTATION_LATEST_MANIFEST_TIME].startswith("2001")


def test_coalescing_keeps_the_newest_value_and_a_manifest_with_its_own_time():
    from rolloutrun_runtime.pod import coalesce

    then = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    queued = {"train_step": 3, "latest_manifest": "a", "latest_manifest_time": then}
    assert coalesce(queued, {"train_step": 4, "reward": None}) == {**queued, "train_step": 4}
    assert coalesce(queued, {"latest_manifest": "b", "latest_manifest_time": None}) == {
        "train_step": 3,
        "latest_manifest": "b",
    }
