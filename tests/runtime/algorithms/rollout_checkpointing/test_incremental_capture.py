"""A snapshot's cut takes what changed since the previous capture, not the buffer: the
replay buffer, the data plane, the ledger's group texts and the finalizer results are
copy-on-write views. What it writes is what a capture of whole copies at the same cut
writes, however the live state changes after it."""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
from pathlib import Path

import numpy as np

from bench.rollout_checkpoint import GROUP_SIZE, _filled_controller, _row
from rolloutrun_runtime.algorithms.replay_buffer import ReplayBuffer
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import (
    RolloutSnapshotter,
    SnapshotOutcome,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    CapturedRolloutState,
    CaptureKind,
    RolloutParts,
)
from rolloutrun_runtime.contract.layout import CONTROLLER_STATE_FILE, DATA_PLANE_PREFIX
from rolloutrun_runtime.data_plane import PARTITIONS, DataPlane
from rolloutrun_runtime.experience.rollout_recovery import PromptRef, sibling_id_for

GROUPS = 120


def _whole_copies(parts: RolloutParts) -> RolloutParts:
    """The same state in maps that never logged: their capture copies everything."""
    plane = DataPlane()
    for partition in PARTITIONS:
        for key in parts.data_plane.list(partition):
            plane.put(partition, key, parts.data_plane.get(partition, key))
    buffer = ReplayBuffer(parts.buffer.capacity)
    for group in parts.buffer.groups():
        buffer.add(group)
    return dataclasses.replace(
        parts,
        data_plane=plane,
        buffer=buffer,
        ledger=copy.deepcopy(parts.ledger),
        runtime_state=copy.deepcopy(parts.runtime_state),
    )


def _files(captured: CapturedRolloutState) -> dict[str, bytes]:
    return RolloutSnapshotter.write_controller_sidecars(captured)


def _same_files(incremental: dict[str, bytes], whole: dict[str, bytes]) -> None:
    assert incremental.keys() == whole.keys()
    planes = []
    for files in (incremental, whole):
        prefix = len(DATA_PLANE_PREFIX)
        dp = {k[prefix:]: v for k, v in files.items() if k.startswith(DATA_PLANE_PREFIX)}
        planes.append(DataPlane.from_files(dp))
    for name in incremental:
        if not name.startswith(DATA_PLANE_PREFIX):
            assert incremental[name] == whole[name], name
    (left, left_meta), (right, right_meta) = planes
    assert left_meta == right_meta
    for partition in PARTITIONS:
        assert left.list(partition) == right.list(partition)
        for key in left.list(partition):
            a, b = left.get(partition, key), right.get(partition, key)
            assert a.keys() == b.keys()
            assert all(np.array_equal(a[f], b[f]) for f in a), (partition, key)


async def test_a_cut_copies_what_changed_and_writes_what_whole_copies_write(
    tmp_path: Path,
) -> None:
    controller = await _filled_controller(GROUPS, tmp_path)
    try:
        snapshots = controller.rollout_snapshots
        parts = snapshots._parts
        ledger, plane, state = controller.ledger, controller.data_plane, parts.runtime_state
        assert ledger is not None
        assert await snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        rng = np.random.default_rng(1)
        async with controller.barrier.mutation("train_step") as cut:
            # one group trained and gone, one row replaced, one group reserved
            trained = "pg000004"
            ledger.claim(cut, [trained], 1)
            ledger.remove_trained(cut, [trained], 1)
            controller.buffer.take([trained])
            plane.clear("train", [sibling_id_for(trained, i) for i in range(GROUP_SIZE)])
            state.finalizer_results.pop(trained)
            plane.put("train", sibling_id_for("pg000009", 0), _row(rng))
            ledger.reserve_group(
                cut,
                group_id="pgnew",
                admission_id="step2",
                prompt=PromptRef(5, 1, 5),
                target_step=2,
                start_weight_version=1,
                group_size=GROUP_SIZE,
            )
        async with controller.barrier.checkpoint() as cut:
            captured = snapshots.capture(cut, CaptureKind.ROLLOUT_SNAPSHOT)
            whole = RolloutSnapshotter(_whole_copies(parts), manifests=None).capture(
                cut, CaptureKind.ROLLOUT_SNAPSHOT
            )
        ledger_capture = captured.ledger_capture
        assert ledger_capture is not None
        assert (ledger_capture.serialized, ledger_capture.texts.changed) == (1, 2)
        assert captured.data_plane.changed_rows() == {"train": GROUP_SIZE + 1, "staging": 0}
        assert captured.replay_view.changed == 1  # type: ignore[attr-defined]
        assert captured.finalizer_results.changed == 1  # type: ignore[attr-defined]
        # the live state goes on after the cut: the capture does not see it
        async with controller.barrier.mutation("prompt_reservations") as cut:
            plane.put("train", sibling_id_for("pg000010", 1), _row(rng))
            ledger.discard(cut, "pgnew", "dropped")
            controller.buffer.take(["pg000011"])
        incremental = _files(captured)
        _same_files(incremental, _files(whole))
        replay = json.loads(incremental[CONTROLLER_STATE_FILE])["replay"]
        assert [g["group_id"] for g in replay] == [f"pg{i:06d}" for i in range(GROUPS) if i != 4]
        assert await snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
    finally:
        gc.unfreeze()
