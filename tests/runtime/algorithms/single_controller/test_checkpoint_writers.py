"""A trainer checkpoint another trajectory committed is never this run's anchor (issue 10).

The real controller against real Gym servers: a ``step_<N>`` committed by another writer with
other weights makes this run's commit of N a clash; the run goes on, anchored to its own
last step, and the foreign entry stays as its writer left it.
"""

from __future__ import annotations

import json

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
    BOOTSTRAP_ANCHOR,
    ManifestStore,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import SnapshotOutcome
from rolloutrun_runtime.algorithms.trainer_checkpoint import CheckpointWriter, TrainerCheckpointer
from rolloutrun_runtime.storage import open_storage
from tests.support.rollout_checkpoints import harness, run_to_end, tiny_config


async def test_a_step_another_trajectory_committed_is_not_anchored(tmp_path, caplog) -> None:
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 1}))
        storage = open_storage(cfg.resolved_storage_uri())
        foreign = CheckpointWriter(7, "ckpt-trainer-x/7", "elsewhere:1")
        other = {"model.pt": b"other weights", "optimizer.pt": b"other moments"}
        TrainerCheckpointer(storage, 3, writer=foreign).publish_files(1, other)
        controller = await h.controller(cfg)
        await run_to_end(controller)  # its final trainer checkpoint, step_1, clashes
        assert "trainer checkpoint not anchored" in caplog.text
        assert "incarnation 7 (lease holder ckpt-trainer-x/7" in caplog.text
        assert controller.read_progress().durable_step is None
        assert await controller.rollout_snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        store = ManifestStore(storage, cfg.name)
        assert store.load_manifest(store.committed_ids()[-1]).anchor == BOOTSTRAP_ANCHOR
        marker = json.loads(storage.read_bytes("step_1/COMMITTED"))
        assert marker["writer"]["incarnation"] == 7
        assert storage.read_bytes("step_1/model.pt") == b"other weights"
