"""Saving and restoring rollout state: capture kinds, the snapshot attempt and its skips, the
cadence independent of savePeriod, the resume chain and its refusals, stop-and-resume end to
end (no group lost or trained twice), deterministic resume, the preemption notice. Turn level,
where a snapshot also carries the Gyms' live episodes, is test_turn_level_checkpointing.py."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import (
    ResumeKind,
    UnrestorableError,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import (
    SnapshotError,
    SnapshotOutcome,
    should_snapshot_after_rollouts,
    should_snapshot_after_step,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    CaptureKind,
    RolloutRuntimeState,
)
from rolloutrun_runtime.algorithms.single_controller import OnStep
from rolloutrun_runtime.contract.layout import CONTROLLER_STATE_FILE, LEDGER_FILE, snapshot_dir
from rolloutrun_runtime.storage import open_storage
from tests.support.rollout_checkpoints import (
    assert_each_step_once_no_prompt_twice,
    crash_after_snapshot,
    final_journal,
    harness,
    republish,
    run_to_end,
    run_until_stopped,
    snapshot_after_commits,
    snapshot_file,
    tamper_snapshot_file,
    tiny_config,
    two_snapshots,
    weights_digest,
)

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"


async def test_stop_abruptly_and_resume_from_the_manifest(tmp_path) -> None:
    """Snapshots anchored to the bootstrap (savePeriod 100): stop after step 3 without a save,
    resume in a new controller, finish; the final journal has every step once."""
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path))
        first = await h.controller(cfg)
        outcomes: list = []
        stop = snapshot_after_commits(first, {1, 2}, outcomes, stop={3})
        await run_until_stopped(first, stop)
        assert outcomes == [SnapshotOutcome.PUBLISHED] * 2
        assert first.checkpointer is not None and first.checkpointer.latest_step() is None

        second = await h.controller(cfg)
        restored = await second.restore()
        assert restored is not None and restored.source.is_rollout_snapshot
        assert restored.anchor_step == 0 and restored.train_step == 2
        assert [s.step for s in restored.replay_steps] == list(range(1, restored.train_step + 1))
        assert second.trainer_version == restored.train_step
        await run_to_end(second)
        assert second.trainer_version == cfg.grpo.max_steps
    assert_each_step_once_no_prompt_twice(final_journal(cfg), cfg.grpo.max_steps)


async def test_cadence_is_independent_of_save_period(tmp_path) -> None:
    """savePeriod 10 over 5 steps: snapshots still publish (anchored to the bootstrap), each
    carrying the steps trained so far; the only trainer checkpoint is the final one."""
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, checkpointing={"savePeriod": 10}))
        controller = await h.controller(cfg)
        outcomes: list = []
        snapshot_after_commits(controller, {2, 4}, outcomes)
        await run_to_end(controller)
        assert outcomes == [SnapshotOutcome.PUBLISHED] * 2
        assert controller.checkpointer is not None
        assert controller.checkpointer.committed_steps() == [cfg.grpo.max_steps]
    store = ManifestStore(open_storage(cfg.resolved_storage_uri()), cfg.name)
    manifests = [store.load_manifest(sid) for sid in store.committed_ids()]
    assert [m.anchor.name for m in manifests] == ["bootstrap", "bootstrap"]
    assert [m.train_step for m in manifests] == [2, 4]
    assert [m.extra["replay_steps"] for m in manifests] == [2, 4]
    published = [r for r in h.records if r["rollout/checkpoint_outcome"] == "published"]
    assert len(published) == 2
    for record in published:
        assert set(record["timing/rollout_checkpoint"]) == {
            "barrier_wait_s",
            "cut_held_s",
            "env_phase_s",
            "write_s",
            "publish_s",
            "pump_paused_s",
            "cut_held_cpu_s",
            "serialize_ahead_s",
            "cut_preempted",
            "idle_wait_s",
        }
    assert [p["train_step"] for p in h.published] == [2, 4]


@pytest.mark.parametrize(
    ("step", "every", "expected"),
    [(1, 1, True), (2, 1, True), (1, 2, False), (2, 2, True), (4, 2, True), (3, 0, False)],
)
def test_which_train_steps_snapshot(step: int, every: int, expected: bool) -> None:
    assert should_snapshot_after_step(step, every) is expected


async def test_snapshot_every_steps_without_a_timer(tmp_path) -> None:
    """snapshotEverySteps 2 with the timer off: the pump is woken after steps 2 and 4, so
    the snapshots it publishes capture step 2 or later, each recorded as a train_step one."""
    async with harness() as h:
        cfg = await h.start_gyms(
            tiny_config(
                tmp_path,
                grpo={"maxSteps": 6},
                checkpointing={"snapshotIntervalSeconds": 0, "snapshotEverySteps": 2},
            )
        )
        controller = await h.controller(cfg)
        hold_step_until(controller, 4, lambda: any(is_published(r) for r in h.records))
        await run_to_end(controller)
    published = [r for r in h.records if r["rollout/checkpoint_outcome"] == "published"]
    assert published, h.records
    assert {r["reason"] for r in h.records} == {"train_step"}
    assert all(p["train_step"] >= 2 for p in h.published)
    # Woken twice before the run's end (after steps 2 and 4); one attempt at most per wake.
    assert len(h.records) <= 3


def is_published(record: dict[str, Any]) -> bool:
    return record["rollout/checkpoint_outcome"] == "published"


def hold_step_until(controller: Any, step: int, condition: Any) -> None:
    """After ``step`` commits, hold the train pump (≤ 30 s) until ``condition()``: the pump's
    own attempts land before the run ends (under CI load a 6-step run ended first, and its
    last attempt was cancelled with it)."""
    original = controller.train_pump.commit_step

    async def commit_then_wait(selected: Any) -> None:
        await original(selected)
        if selected.step == step:
            for _ in range(3000):
                if condition():
                    return
                await asyncio.sleep(0.01)

    controller.train_pump.commit_step = commit_then_wait


@pytest.mark.parametrize(
    ("since", "every", "expected"),
    [(0, 4, False), (3, 4, False), (4, 4, True), (9, 4, True), (9, 0, False)],
)
def test_which_rollout_counts_snapshot(since: int, every: int, expected: bool) -> None:
    assert should_snapshot_after_rollouts(since, every) is expected


async def test_snapshot_every_rollouts_without_a_timer_or_steps(tmp_path) -> None:
    """Issue 15: snapshotEveryRollouts 4 with the timer and the step cadence off: the pump is
    woken by rollout progress alone (every four attempts dispatched), whatever the steps."""
    async with harness() as h:
        cfg = await h.start_gyms(
            tiny_config(
                tmp_path,
                grpo={"maxSteps": 3},
                checkpointing={"snapshotIntervalSeconds": 0, "snapshotEveryRollouts": 4},
            )
        )
        controller = await h.controller(cfg)
        hold_step_until(controller, 2, lambda: any(is_published(r) for r in h.records))
        await run_to_end(controller)
    published = [r for r in h.records if r["rollout/checkpoint_outcome"] == "published"]
    assert published, h.records
    assert {r["reason"] for r in h.records} == {"rollout_progress"}


async def test_capture_kinds_and_the_attempts_skips(tmp_path) -> None:
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 2}))
        controller = await h.controller(cfg)
        await run_to_end(controller)
        snapshots = controller.rollout_snapshots
        # capture kinds: a trainer checkpoint refuses an open step, a snapshot re-indexes it
        open_group = controller.buffer.groups()[0] if len(controller.buffer) else None
        async with controller.barrier.checkpoint() as cut:
            trainer = snapshots.capture(cut, CaptureKind.TRAINER_CHECKPOINT)
            if open_group is not None:
                controller.buffer.take([open_group.group_id])
                controller.runtime_state.open_step_groups = [open_group]
                snap = snapshots.capture(cut, CaptureKind.ROLLOUT_SNAPSHOT)
                replay_ids = [g["group_id"] for g in snap.controller_state["replay"]]
                assert open_group.group_id in replay_ids
                with pytest.raises(SnapshotError, match="inside step"):
                    snapshots.capture(cut, CaptureKind.TRAINER_CHECKPOINT)
                controller.runtime_state.open_step_groups = []
                controller.buffer.add(open_group)
        assert trainer.kind is CaptureKind.TRAINER_CHECKPOINT
        assert [s["step"] for s in trainer.journal["steps"]] == [1, 2]
        files = snapshots.write_controller_sidecars(trainer)
        assert {CONTROLLER_STATE_FILE, LEDGER_FILE, "training_journal.json"} <= set(files)
        # the six-step attempt's skips
        assert await snapshots.attempt() is SnapshotOutcome.PUBLISHED
        assert await snapshots.attempt() is SnapshotOutcome.SKIPPED_UNCHANGED
        assert await snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        controller.state.optimizer_commit_in_progress = True
        assert await snapshots.attempt(force=True) is SnapshotOutcome.SKIPPED_COMMIT_WINDOW
        controller.state.optimizer_commit_in_progress = False
        controller.state.durable_step = 1  # claims step_1 durable: storage has only step_2
        assert await snapshots.attempt(force=True) is SnapshotOutcome.SKIPPED_ANCHOR_NOT_DURABLE
        outcomes = [r["rollout/checkpoint_outcome"] for r in h.records]
        assert outcomes == [
            "published",
            "skipped_unchanged",
            "published",
            "skipped_commit_window",
            "skipped_anchor_not_durable",
        ]


async def test_a_fence_that_refuses_stops_the_publication_and_the_run(tmp_path) -> None:
    """The fence hook (the pod's lease) runs before every commit; its error is not retried:
    no manifest is written and the error reaches the caller unchanged."""

    class LeaseLost(RuntimeError):
        pass

    held = [True]

    def fence() -> None:
        if not held[0]:
            raise LeaseLost("another incarnation holds the lease")

    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 1}))
        controller = await h.controller(cfg, fence=fence)
        await run_to_end(controller)
        store = ManifestStore(open_storage(cfg.resolved_storage_uri()), cfg.name)
        assert await controller.rollout_snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        committed = store.committed_ids()
        held[0] = False
        with pytest.raises(LeaseLost):
            await controller.rollout_snapshots.attempt(force=True)
        with pytest.raises(LeaseLost):
            await controller.trainer_checkpoint(defer=False)
        assert store.committed_ids() == committed


async def test_a_slow_fence_does_not_hold_the_event_loop(tmp_path) -> None:
    """A pod's fence is a read of the Lease from the API server; while a trainer checkpoint
    waits on it, the loop (pumps, Gym calls) goes on. Before, the fence ran on the loop."""
    fencing: list[tuple[float, float]] = []
    slow = [False]

    def fence() -> None:
        if slow[0]:
            start = time.monotonic()
            time.sleep(0.5)
            fencing.append((start, time.monotonic()))

    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 1}))
        controller = await h.controller(cfg, fence=fence)
        await run_to_end(controller)
        ticks: list[float] = []

        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        slow[0] = True
        try:
            await controller.trainer_checkpoint(defer=False)
        finally:
            ticker.cancel()
        assert len(fencing) == 1
        start, end = fencing[0]
        assert any(start < t < end for t in ticks), "the loop stood still during the fence"


# ---------------------------------------------------------------------------- refusals
async def test_restore_refusals_and_fallbacks(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING)
    async with harness() as h:
        cfg = await h.start_gyms(
            tiny_config(tmp_path, grpo={"maxSteps": 2}, checkpointing={"savePeriod": 1})
        )
        store = await two_snapshots(h, cfg)
        newest = store.committed_ids()[-1]
        ledger = snapshot_file(store.storage, snapshot_dir(newest), LEDGER_FILE)

        async def refused_for_an_older_entry(match: str, refused_uri: str) -> None:
            """The newest entry is refused (its reason logged); the next older one restores."""
            caplog.clear()
            fresh = await h.controller(cfg)
            restored = await fresh.restore()
            assert restored is not None and restored.source.path != refused_uri
            assert restored.train_step == 2 and fresh.trainer_version == 2
            refused = refused_uri.rsplit("/", 2)[-2]  # snapshot_<id>
            assert re.search(f"passing over snapshot .*{refused}: .*{match}", caplog.text)

        # truncated sidecar (its checksum in the manifest matches): refused, named, fallback
        bad = republish(store, cfg, newest, **{LEDGER_FILE: ledger[: len(ledger) // 2]})
        await refused_for_an_older_entry("sha256", bad.manifest_uri)
        store.storage.delete(f"{snapshot_dir(newest + 1)}/MANIFEST.json")
        # unknown sidecar schema, recorded consistently: refused, naming the schema
        document = json.loads(ledger)
        document["schema_version"] = 99
        bad = json.dumps(document).encode()
        controller_state = json.loads(
            snapshot_file(store.storage, snapshot_dir(newest), CONTROLLER_STATE_FILE)
        )
        controller_state.pop("rollout_recovery", None)
        republished = republish(
            store,
            cfg,
            newest,
            **{LEDGER_FILE: bad, CONTROLLER_STATE_FILE: json.dumps(controller_state).encode()},
        )
        await refused_for_an_older_entry("schema 99", republished.manifest_uri)
        store.storage.delete(f"{snapshot_dir(newest + 2)}/MANIFEST.json")

        # a missing anchor: the newest snapshot (anchored to step_2) is passed over, the older
        # one (bootstrap anchor, train step 1) ties with step_1 and is preferred
        marker = store.storage.read_bytes("step_2/COMMITTED")
        store.storage.delete("step_2/COMMITTED")
        choice = (await h.controller(cfg)).rollout_restorer.plan()
        assert any("not durable" in why for _, why in choice.skipped)
        assert choice.kind is ResumeKind.SNAPSHOT and choice.candidate is not None
        assert choice.candidate.manifest.train_step == 1
        store.storage.write_bytes("step_2/COMMITTED", marker)

        # a file changed after publication: passed over (logged), the trainer checkpoint wins
        tamper_snapshot_file(store.storage, snapshot_dir(newest), LEDGER_FILE, ledger + b" ")
        caplog.clear()
        choice = (await h.controller(cfg)).rollout_restorer.plan()
        assert any("checksum mismatch" in why for _, why in choice.skipped)
        assert "checksum mismatch" in caplog.text
        assert choice.kind is ResumeKind.TRAINER_CHECKPOINT and choice.trainer_step == 2

        # another run's storage: refused by name, before anything is read
        other = cfg.model_copy(update={"name": "other"})
        with pytest.raises(Exception, match="belongs to run"):
            (await h.controller(other)).rollout_snapshots.ensure_bootstrap_anchor()
        # a changed rollout-relevant config: every entry is refused (snapshots naming the key),
        # which no restart can change
        changed = cfg.model_copy(update={"seed": cfg.seed + 1})
        with pytest.raises(UnrestorableError, match="seed") as refused:
            (await h.controller(changed)).rollout_restorer.plan()
        assert all("config" in why for _, why in refused.value.refused)


async def test_schema_4_sidecar_fixture_still_restores(tmp_path) -> None:
    """A schema-4 ledger sidecar (no spare pool) restores; the pool comes from runtime state."""
    fixture = (FIXTURES / "rollout_recovery_schema4.json").read_bytes()
    assert json.loads(fixture)["schema_version"] == 4
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 2}))
        store = await two_snapshots(h, cfg)
        newest = store.committed_ids()[-1]
        entry = snapshot_dir(newest)
        controller_state = json.loads(snapshot_file(store.storage, entry, CONTROLLER_STATE_FILE))
        controller_state.pop("rollout_recovery", None)  # a schema-4 era record had no facts
        runtime = RolloutRuntimeState.from_json(
            json.loads(snapshot_file(store.storage, entry, "rollout/runtime_state.json"))
        )
        republish(
            store,
            cfg,
            newest,
            **{
                LEDGER_FILE: fixture,
                CONTROLLER_STATE_FILE: json.dumps(controller_state).encode(),
            },
        )
        resumed = await h.controller(cfg)
        restored = await resumed.restore()
        assert restored is not None and restored.ledger is not None
        assert restored.source.path == store.storage.uri_for(
            f"{snapshot_dir(newest + 1)}/MANIFEST.json"
        )
        assert sorted(g.group_id for g in restored.ledger.groups()) == [
            "pgfixture0000",
            "pgfixture0001",
        ]
        assert resumed.runtime_state.spare_prompts == runtime.spare_prompts
        assert resumed.runtime_state.batch_shortfall == {3: 0}


async def test_deterministic_resume_is_bit_identical(tmp_path) -> None:
    """deterministic: true — stop after step 3 (snapshot after step 2, bootstrap anchor),
    resume, finish: the weights equal an uninterrupted run's, bit for bit."""
    sections = {"checkpointing": {"deterministic": True}}
    async with harness() as h:
        base = await h.start_gyms(tiny_config(tmp_path / "a", **sections))
        straight = await h.controller(base)
        await run_to_end(straight)
        expected = weights_digest(straight)

        cfg = base.model_copy(update={"log_dir": str(tmp_path / "b" / "run")})
        first = await h.controller(cfg)
        await crash_after_snapshot(first)
        second = await h.controller(cfg)
        restored = await second.restore()
        assert restored is not None and restored.train_step == 2
        await run_to_end(second)
        assert weights_digest(second) == expected


async def test_preemption_notice_publishes_a_snapshot_then_stops_the_run(tmp_path) -> None:
    """SIGTERM's path: the notice forces a snapshot within the grace, then the run stops
    (the entry point exits 143); the next incarnation resumes from that snapshot."""
    from rolloutrun_runtime.trainer import SNAPSHOTS_LOG, run_trainer

    async with harness() as h:
        cfg = await h.start_gyms(
            tiny_config(tmp_path, grpo={"maxSteps": 50}, checkpointing={"savePeriod": 100})
        )
        notice = asyncio.Event()

        def on_step(record):
            if record["step"] == 2:
                notice.set()

        run = asyncio.ensure_future(run_trainer(cfg, hooks=OnStep(on_step), preemption=notice))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, 120)
        lines = (Path(cfg.log_dir) / SNAPSHOTS_LOG).read_text().splitlines()
        records = [json.loads(line) for line in lines]
        preemption = [r for r in records if r["reason"] == "preemption"]
        # A second one when the step the notice found begun committed after the first's cut.
        outcomes = [r["rollout/checkpoint_outcome"] for r in preemption]
        assert outcomes in (["published"], ["published"] * 2)
        resumed = await h.controller(cfg)
        choice = resumed.rollout_restorer.plan()
        assert choice.kind is ResumeKind.SNAPSHOT and choice.candidate is not None
        assert choice.candidate.manifest_uri == preemption[-1]["manifest_uri"]
        assert choice.candidate.manifest.train_step >= 2
