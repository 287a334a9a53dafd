"""The progress mirror (no pass) writes what a pass would: the reward, checked times and the
step rate move with the train step, so status is never staler for lacking a pass."""

from __future__ import annotations

import datetime as dt

from rolloutrun_operator import naming
from rolloutrun_operator.watching import RunMemory, lease_progress, rate_after

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _lease(**notes: str) -> dict[str, object]:
    return {
        "metadata": {"annotations": notes},
        "spec": {"holderIdentity": "run-i1", "renewTime": "2026-01-01T00:00:00.000000Z"},
    }


def test_the_mirror_reads_the_lease_as_a_pass_does() -> None:
    progress = lease_progress(
        _lease(
            **{
                naming.ANNOTATION_TRAIN_STEP: "12",
                naming.ANNOTATION_REWARD: "0.5",
                naming.ANNOTATION_LATEST_MANIFEST: "file:///s/snapshot_000003/MANIFEST.json",
                naming.ANNOTATION_LATEST_MANIFEST_TIME: "yesterday",
            }
        )
    )
    # the reward is mirrored; a time the CRD's date-time format would refuse is dropped
    assert progress == {
        "trainStep": 12,
        "lastReward": 0.5,
        "latestManifestUri": "file:///s/snapshot_000003/MANIFEST.json",
    }
    too_big = lease_progress(_lease(**{naming.ANNOTATION_REWARD: "1e300"}))
    assert "lastReward" not in too_big


def test_a_new_reward_alone_waits_for_the_throttle_like_the_step() -> None:
    memory = RunMemory()
    memory.progress = {"trainStep": 3}
    assert memory.progress_due(101.0) == 0.0  # an incarnation's first step: at once
    memory.progress = {"trainStep": 3, "lastReward": 0.25}
    memory.mirrored = {"trainStep": 3, "lastReward": 0.5}
    memory.mirrored_at = 100.0
    due = memory.progress_due(101.0)
    assert due is not None and due > 0  # not at once: it changes every step
    memory.progress = {"trainStep": 3, "lastReward": 0.5, "anchorStep": 2}
    assert memory.progress_due(101.0) == 0.0  # a new anchor: at once


def test_the_step_rate_moves_with_the_mirrored_step() -> None:
    start = rate_after({}, 10, T0)
    assert start == {"stepRate": None, "stepWindow": f"10@{T0:%Y-%m-%dT%H:%M:%SZ}"}
    later = rate_after(start, 40, T0 + dt.timedelta(seconds=120))
    assert later["stepRate"] == 15.0  # 30 steps in 2 minutes
    assert rate_after(later, None, T0) == {}
