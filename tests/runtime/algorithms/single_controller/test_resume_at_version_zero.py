"""Resume before the first step: a snapshot anchored to the bootstrap at weight version 0.

Why its own tests: the generation workers start at version 0, and a resume at version 0
syncs them to the version they already hold. The engine used to refuse that refit
(``refit to version 0 but version 0 is installed``) and every incarnation crash-looped on
the same snapshot; a preemption that landed before step 1 committed was enough. These run
the real controller, in-process workers and Gym servers (see ``tests.support.rollout_checkpoints``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import SnapshotOutcome
from rolloutrun_runtime.algorithms.single_controller import SingleController
from tests.support.rollout_checkpoints import (
    harness,
    run_to_end,
    run_until_stopped,
    tiny_config,
    weights_digest,
)

DETERMINISTIC = {"checkpointing": {"deterministic": True}}


def snapshot_before_first_commit(controller: SingleController, outcomes: list[Any]) -> Any:
    """Right before step 1's optimizer commit (version 0, groups trained on but not yet
    committed), force a snapshot and then stop the run there (a crash): returns the stop."""
    original = controller.train_pump.commit_step
    stop = asyncio.Event()

    async def snapshot_then_stop(selected: Any) -> None:
        if selected.step == 1:
            outcomes.append(await controller.rollout_snapshots.attempt(force=True, reason="test"))
            stop.set()
            await asyncio.Event().wait()  # the crash: step 1 never commits
        await original(selected)

    controller.train_pump.commit_step = snapshot_then_stop  # type: ignore[method-assign]
    return stop


async def test_resume_at_version_zero_is_bit_identical_and_repeatable(tmp_path: Path) -> None:
    """Killed before step 1 committed, with a snapshot at version 0: the next incarnation
    resumes from it (the workers hold version 0 already), is killed the same way again,
    resumes again, and ends with the weights of an uninterrupted run, bit for bit."""
    async with harness() as h:
        base = await h.start_gyms(tiny_config(tmp_path / "a", **DETERMINISTIC))
        straight = await h.controller(base)
        await run_to_end(straight)
        expected = weights_digest(straight)

        cfg = base.model_copy(update={"log_dir": str(tmp_path / "b" / "run")})
        first = await h.controller(cfg)
        assert await first.restore() is None  # a fresh start: nothing to resume
        outcomes: list[Any] = []
        await run_until_stopped(first, snapshot_before_first_commit(first, outcomes))
        assert outcomes == [SnapshotOutcome.PUBLISHED]

        second = await h.controller(cfg)
        restored = await second.restore()
        assert restored is not None and restored.train_step == restored.anchor_step == 0
        assert second.trainer_version == 0 and restored.replay_groups  # step 1's groups
        await run_until_stopped(second, snapshot_before_first_commit(second, outcomes))
        assert outcomes == [SnapshotOutcome.PUBLISHED] * 2

        third = await h.controller(cfg)
        restored = await third.restore()
        assert restored is not None and restored.train_step == 0
        await run_to_end(third)
        assert third.trainer_version == cfg.grpo.max_steps
        assert weights_digest(third) == expected
