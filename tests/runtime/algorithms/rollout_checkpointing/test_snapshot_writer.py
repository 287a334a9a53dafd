"""The snapshot writer runs a periodic snapshot's write and publish on its own thread at a
lower CPU priority, and a forced (preemption) one at the process's (issue 15, throughput).

Real threads and a real run (Gym servers, controller, file:// storage): the nice value is
read from the kernel for the thread the work ran on.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import SnapshotOutcome
from rolloutrun_runtime.algorithms.rollout_checkpointing.writer import WRITER_NICE, SnapshotWriter
from rolloutrun_runtime.storage import open_storage
from tests.support.rollout_checkpoints import harness, run_to_end, tiny_config

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice is Linux's")


def _this_thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _expected_writer_nice() -> int:
    return min(19, os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICE)


async def test_background_work_runs_nicer_and_urgent_work_at_the_process_priority() -> None:
    writer = SnapshotWriter()
    try:
        background = await writer.run(_this_thread_nice)
        urgent = await writer.run(_this_thread_nice, urgent=True)
    finally:
        writer.close()
    assert background == _expected_writer_nice() == writer.thread_nice
    assert urgent == os.getpriority(os.PRIO_PROCESS, 0), "the default executor is not lowered"
    assert _this_thread_nice() == os.getpriority(os.PRIO_PROCESS, 0), "the loop is not lowered"


async def test_snapshots_after_each_step_publish_from_the_low_priority_writer(tmp_path) -> None:
    async with harness() as h:
        cfg = await h.start_gyms(
            tiny_config(tmp_path, grpo={"maxSteps": 3}, checkpointing={"snapshotEverySteps": 1})
        )
        controller = await h.controller(cfg)
        snapshots = controller.rollout_snapshots
        seen: list[int] = []
        publish = snapshots._publish

        def publish_and_note_priority(*args: object):  # the real publish, on its thread
            seen.append(_this_thread_nice())
            return publish(*args)

        snapshots._publish = publish_and_note_priority  # type: ignore[method-assign]
        await run_to_end(controller)
        assert seen and set(seen) == {_expected_writer_nice()}, "each periodic publish"
        assert await snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        assert seen[-1] == os.getpriority(os.PRIO_PROCESS, 0), "a forced attempt is urgent"
        store = ManifestStore(open_storage(cfg.resolved_storage_uri()), cfg.name)
        assert store.load_manifest(store.committed_ids()[-1]).train_step == 3
