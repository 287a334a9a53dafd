"""What keeps a snapshot's pump pause flat: automatic GC is held from the cut until the files
are written (no pass over every buffered record lands in the cut or right after it), and the
capture's checks and JSON run after the cut, on its copies."""

from __future__ import annotations

import asyncio
import gc

from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import SnapshotOutcome
from tests.support.rollout_checkpoints import harness, run_to_end, tiny_config


async def test_gc_is_held_from_the_cut_until_the_snapshot_is_published(tmp_path) -> None:
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 1}))
        enabled_at_publication: list[bool] = []
        controller = await h.controller(
            cfg, fence=lambda: enabled_at_publication.append(gc.isenabled())
        )
        await run_to_end(controller)
        enabled_at_publication.clear()
        outcome = await controller.rollout_snapshots.attempt(force=True)
        assert outcome is SnapshotOutcome.PUBLISHED
        # the fence runs in the publication (off the loop, after the write)
        assert enabled_at_publication == [False]
        assert gc.isenabled()


async def test_an_incomplete_capture_still_fails_the_attempt(tmp_path) -> None:
    """The inventory moved out of the cut: rows missing at the cut still fail the attempt
    (nothing is published) and the live state is untouched."""
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 1}))
        controller = await h.controller(cfg)
        await run_to_end(controller)
        snapshots = controller.rollout_snapshots
        published = len(snapshots.published)
        ghost = ReplayGroup("ghost", 0, None, ("ghost_g0",), (0.0,), 1)
        controller.buffer.add(ghost)  # references a row the data plane does not hold
        outcome = await snapshots.attempt(force=True)
        assert outcome is SnapshotOutcome.FAILED
        assert len(snapshots.published) == published
        assert "train/ghost_g0" in h.records[-1]["error"]
        controller.buffer.take(["ghost"])
        assert await snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        assert gc.isenabled()


async def test_serializing_and_publishing_a_snapshot_is_one_thread_hop(
    tmp_path, monkeypatch
) -> None:
    """Each hop off the loop is a hand-over of the interpreter lock and a wake-up of the
    loop: the files are serialized and published in one (the anchor's check aside)."""
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 1}))
        controller = await h.controller(cfg)
        await run_to_end(controller)
        snapshots = controller.rollout_snapshots
        hops: list[str] = []
        to_thread = asyncio.to_thread

        def counted(func, /, *args, **kwargs):
            hops.append(getattr(func, "__name__", repr(func)))
            return to_thread(func, *args, **kwargs)

        monkeypatch.setattr(asyncio, "to_thread", counted)
        outcome = await snapshots.attempt(force=True)
        monkeypatch.undo()
        assert outcome is SnapshotOutcome.PUBLISHED
        durable_check = getattr(snapshots._anchor_is_durable, "__name__", None)
        assert [hop for hop in hops if hop != durable_check] == ["_serialize_and_publish"]
