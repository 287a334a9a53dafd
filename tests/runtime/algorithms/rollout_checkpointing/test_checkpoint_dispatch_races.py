"""Snapshots racing the pumps: admission, finalize and the optimizer-commit window.

A snapshot may start at any moment the pumps are running. These tests let attempts race a
real run back to back and check that every snapshot published is one a restore accepts
whole (inventory, ledger facts, cursor), and that a snapshot cut inside an unfinished step
(groups selected, optimizer not yet applied) hands exactly those groups back to the step.
"""

from __future__ import annotations

import asyncio
from collections import Counter

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import (
    ResumeChoice,
    ResumeKind,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import SnapshotOutcome
from rolloutrun_runtime.storage import open_storage
from tests.support.rollout_checkpoints import (
    assert_each_step_once_no_prompt_twice,
    final_journal,
    harness,
    run_to_end,
    run_until_stopped,
    tiny_config,
)

#: Attempts raced against one run (each forced, so each that is not skipped publishes).
RACING_ATTEMPTS = 40


async def test_back_to_back_snapshots_race_the_pumps_and_each_restores_whole(tmp_path) -> None:
    async with harness() as h:
        cfg = await h.start_gyms(
            tiny_config(
                tmp_path,
                grpo={"maxSteps": 4},
                checkpointing={"savePeriod": 2, "keepLatest": 200},
            )
        )
        controller = await h.controller(cfg)
        run = asyncio.ensure_future(run_to_end(controller))
        outcomes: list[SnapshotOutcome] = []
        while not run.done() and len(outcomes) < RACING_ATTEMPTS:
            outcomes.append(await controller.rollout_snapshots.attempt(force=True))
            await asyncio.sleep(0)
        await run
        counts = Counter(outcomes)
        assert set(counts) <= {SnapshotOutcome.PUBLISHED, SnapshotOutcome.SKIPPED_COMMIT_WINDOW}
        assert counts[SnapshotOutcome.PUBLISHED] >= 1
        # every published snapshot restores whole (checksums, ledger facts, inventory, cursor)
        store = ManifestStore(open_storage(cfg.resolved_storage_uri()), cfg.name)
        restorer = (await h.controller(cfg)).rollout_restorer
        restored_steps = []
        for snapshot_id in store.committed_ids():
            candidate = store.verify(
                snapshot_id, config=cfg, anchor_is_durable=restorer.anchor_is_durable
            )
            restored = restorer.restore(ResumeChoice(ResumeKind.SNAPSHOT, candidate=candidate))
            assert restored is not None
            assert [s.step for s in restored.replay_steps] == list(
                range(restored.anchor_step + 1, restored.train_step + 1)
            )
            restored_steps.append(restored.train_step)
        assert restored_steps == sorted(restored_steps)
    assert_each_step_once_no_prompt_twice(final_journal(cfg), cfg.grpo.max_steps)


async def test_a_snapshot_inside_an_unfinished_step_returns_its_groups_to_it(tmp_path) -> None:
    """Cut between selecting step 2's groups and applying it: the snapshot's replay view
    holds them, the resumed run trains exactly those groups as step 2."""
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 4}))
        first = await h.controller(cfg)
        original_commit = first.train_pump.commit_step
        open_groups: list[str] = []
        stop = asyncio.Event()

        async def commit_with_a_snapshot_first(selected):
            if selected.step == 2:
                open_groups.extend(g.group_id for g in selected.groups)
                assert first.read_progress().optimizer_commit_in_progress is False
                outcome = await first.rollout_snapshots.attempt(force=True, reason="test")
                assert outcome is SnapshotOutcome.PUBLISHED
            await original_commit(selected)
            if selected.step == 3:
                stop.set()

        first.train_pump.commit_step = commit_with_a_snapshot_first  # type: ignore[method-assign]
        await run_until_stopped(first, stop)
        assert open_groups

        second = await h.controller(cfg)
        restored = await second.restore()
        assert restored is not None and restored.train_step == 1
        assert set(open_groups) <= {g.group_id for g in restored.replay_groups}
        await run_to_end(second)
        step_2 = next(r for r in second.history if r["step"] == 2)
        assert step_2["groups"] == len(open_groups)
    journal = final_journal(cfg)
    assert_each_step_once_no_prompt_twice(journal, cfg.grpo.max_steps)
    trained_at_2 = [g["group_id"] for g in journal["steps"][1]["groups"]]
    assert sorted(trained_at_2) == sorted(open_groups)
