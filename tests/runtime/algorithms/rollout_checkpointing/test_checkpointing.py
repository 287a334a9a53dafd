"""Saving and restoring rollout state: capture kinds, the snapshot attempt and its skips, the
cadence independent of savePeriod, the resume chain and its refusals, stop-and-resume end to
end (no group lost or trained twice), deterministic resume, turn level through the Gym."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
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
from rolloutrun_runtime.environments.checkpointing import EnvironmentEpisode
from rolloutrun_runtime.experience.rollout_recovery import (
    AttemptStatus,
    Granularity,
    LedgerRestartError,
    PromptRef,
    RecoveryLedger,
    RestoreLevel,
    RolloutAttempt,
    read_recovery_sidecar,
)
from rolloutrun_runtime.storage import open_storage
from tests.support.data_plane import HEADERS, announce
from tests.support.rollout_checkpoints import (
    GYM_TOKEN,
    assert_each_step_once_no_prompt_twice,
    crash_after_snapshot,
    final_journal,
    harness,
    republish,
    run_to_end,
    run_until_stopped,
    snapshot_after_commits,
    snapshot_file,
    snapshot_ledger_chunks,
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


async def test_turn_level_capture_and_restore_through_the_gym_control_plane(tmp_path) -> None:
    """targetLevel turn, multi-turn episodes: a snapshot parks live episodes and exports
    them; after a stop, the resumed run hands them back to their Gym instances and continues
    them under attempt + 1 (not from turn 0); the run finishes with every step once."""
    cfg = _turn_config(tmp_path, max_steps=8)
    async with harness() as h:
        cfg = await h.start_gyms(cfg)
        await _stop_after_a_snapshot_with_episodes(h, cfg)

        second = await h.controller(cfg)
        restored = await second.restore()
        assert restored is not None and restored.environment_snapshot is not None
        resumed = second.resumption.restored_episodes
        assert resumed, "no episode was handed back to its Gym instance"
        assert set(resumed.values()) <= {"gym-0", "gym-1"}
        await run_to_end(second)
    assert_each_step_once_no_prompt_twice(final_journal(cfg), cfg.grpo.max_steps)


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


def _with_request_limit(cfg, limit: int):
    return cfg.model_copy(update={"gym": cfg.gym.model_copy(update={"request_max_bytes": limit})})


async def test_refused_episode_restores_are_trace_events_and_a_metric(tmp_path) -> None:
    """Issue 12, "Sizes": an episode whose record does not fit a Gym request (this
    incarnation's gym.requestMaxBytes is 1 KiB) is refused by name; each refusal is an
    ``environment_restore_refused`` event and every step record counts them."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter, read_events

    cfg = _turn_config(tmp_path, max_steps=3)
    trace_path = tmp_path / "trace.jsonl"
    async with harness() as h:
        cfg = await h.start_gyms(cfg)
        await _stop_after_a_snapshot_with_episodes(h, cfg)
        trace = TraceWriter(trace_path)
        second = await h.controller(_with_request_limit(cfg, 1024), trace=trace)
        restored = await second.restore()
        assert restored is not None and restored.environment_snapshot is not None
        assert not second.resumption.restored_episodes
        await run_to_end(second)
        trace.close()
    events = [e for e in read_events(trace_path) if e["event"] == "environment_restore_refused"]
    assert events and {e["snapshot_id"] for e in events} == {restored.snapshot_id}
    for event in events:
        assert event["rollout_id"] and event["instance_id"] in {"gym-0", "gym-1"}
        assert "gym.requestMaxBytes = 1024 bytes" in event["reason"], event
    assert second.history
    for record in second.history:
        assert record["env_restore_refused_episodes"] == len(events)
        assert record["env_restore_failed"] == 0


async def test_a_refused_whole_environment_restore_is_a_trace_event_and_a_metric(
    tmp_path,
) -> None:
    """Issue 12: when no Gym can take the restore (every one gone, here) the whole restore
    fails; that is a trace event naming no episode and ``env_restore_failed`` in every step
    record, not only a warning in the log. (One Gym gone is left out alone: its episodes
    take a lost replica's path, ``test_gym_lost_at_turn_restore``.)"""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter, read_events

    cfg = _turn_config(tmp_path, max_steps=3)
    trace_path = tmp_path / "trace.jsonl"
    async with harness() as h:
        cfg = await h.start_gyms(cfg)
        await _stop_after_a_snapshot_with_episodes(h, cfg)
        trace = TraceWriter(trace_path)
        second = await h.controller(cfg, trace=trace)
        for instance in ("gym-0", "gym-1"):
            second.environment.endpoints[instance] = "http://127.0.0.1:9"  # nothing listens
        restored = await second.restore()
        assert restored is not None and not second.resumption.restored_episodes
        second.environment.endpoints.update({"gym-0": cfg.gym.endpoints[0]})
        second.environment.endpoints.update({"gym-1": cfg.gym.endpoints[1]})
        await run_to_end(second)
        trace.close()
    events = [e for e in read_events(trace_path) if e["event"] == "environment_restore_refused"]
    assert [(e["snapshot_id"], e["rollout_id"], e["instance_id"]) for e in events] == [
        (restored.snapshot_id, None, None)
    ]
    assert "gym-0" in events[0]["reason"] and "gym-1" in events[0]["reason"]
    assert second.history
    for record in second.history:
        assert record["env_restore_failed"] == 1 and record["env_restore_refused_episodes"] == 0


# ---------------------------------------------------------------------------- the environment
# phase of a turn-level snapshot, driven from an idle controller whose ledger the test sets up


def _turn_config(tmp_path: Path, max_steps: int = 1):
    return tiny_config(
        tmp_path,
        policy={"maxSeqLen": 64},
        task={
            "name": "reach_target",
            "datasetSize": 96,
            "maxOperand": 9,
            "maxTurns": 4,
            "maxNewTokens": 3,
            "turnDelayMs": 30,
        },
        grpo={"maxSteps": max_steps},
        checkpointing={"targetLevel": "turn"},
    )


async def _out_on(controller, instances: list[str]) -> list[RolloutAttempt]:
    """A turn-level group whose first siblings are out on ``instances`` (one each)."""
    ledger = controller.ledger
    async with controller.barrier.checkpoint() as cut:
        group = ledger.reserve_group(
            cut,
            group_id="g-env-phase",
            admission_id="adm-env-phase",
            prompt=PromptRef(prompt_id=95, epoch=9, index=0),
            target_step=None,
            start_weight_version=controller.trainer_version,
            group_size=controller.cfg.grpo.group_size,
            granularity=Granularity.SIBLING,
            restore_level=RestoreLevel.TURN,
        )
        attempts = []
        for sibling, instance in zip(group.siblings, instances, strict=False):
            ledger.dispatch(cut, sibling.sibling_id, sibling.current.attempt_uuid, instance)
            attempts.append(sibling.current)
    return attempts


def _published_ledger(cfg) -> RecoveryLedger:
    store = ManifestStore(open_storage(cfg.resolved_storage_uri()), cfg.name)
    entry = snapshot_dir(store.committed_ids()[-1])
    raw = snapshot_file(store.storage, entry, LEDGER_FILE)
    return read_recovery_sidecar(raw, chunks=snapshot_ledger_chunks(store.storage, raw)).ledger


class _LiveCut:
    def require_live(self) -> None:
        return None


async def test_a_lost_gym_costs_the_snapshot_only_its_own_episodes(tmp_path) -> None:
    """Issue 10, finding 2: a Gym replica that is gone in the environment phase (its pod was
    deleted at the preemption) no longer discards the snapshot. It publishes the rollout state
    (outcome published_partial_env, naming the replica), and the ledger it saves marks the
    lost replica's episodes abandoned, so a restore relaunches their siblings as new attempts
    from turn 0 instead of expecting a record; the live ledger is untouched."""
    async with harness() as h:
        cfg = await h.start_gyms(_turn_config(tmp_path))
        controller = await h.controller(cfg)
        await run_to_end(controller)
        on_0, on_1 = await _out_on(controller, ["gym-0", "gym-1"])
        controller.environment.endpoints["gym-1"] = "http://127.0.0.1:9"  # nothing listens
        outcome = await controller.rollout_snapshots.attempt(force=True, reason="preemption")
        assert outcome is SnapshotOutcome.PUBLISHED_PARTIAL_ENV
        record = h.records[-1]
        assert record["rollout/checkpoint_outcome"] == "published_partial_env"
        assert list(record["env_unavailable"]) == ["gym-1"] and record["env_restart_from_turn_0"]
        assert "timing/rollout_checkpoint" in record
        assert controller.ledger.sibling(on_1.rollout_id.rsplit("_a", 1)[0]).current is on_1
        assert on_1.status is AttemptStatus.DISPATCHED  # the live ledger is untouched

        saved = _published_ledger(cfg)
        lost = saved.sibling(on_1.rollout_id.rsplit("_a", 1)[0]).current
        kept = saved.sibling(on_0.rollout_id.rsplit("_a", 1)[0]).current
        assert lost.status is AttemptStatus.ABANDONED and "Gym gym-1 unavailable" in lost.failure
        assert kept.status is AttemptStatus.DISPATCHED
        report = saved.prepare_for_restart(_LiveCut(), {})
        relaunched = saved.sibling(on_1.rollout_id.rsplit("_a", 1)[0]).current
        assert relaunched.status is AttemptStatus.RESERVED
        assert relaunched.rollout_id in report.minted
        assert relaunched.rollout_id != on_1.rollout_id  # a new attempt, from turn 0

        # every replica gone: still published, every turn-level episode out restarts
        controller.environment.endpoints["gym-0"] = "http://127.0.0.1:9"
        outcome = await controller.rollout_snapshots.attempt(force=True, reason="preemption")
        assert outcome is SnapshotOutcome.PUBLISHED_PARTIAL_ENV
        assert sorted(h.records[-1]["env_unavailable"]) == ["gym-0", "gym-1"]
        saved = _published_ledger(cfg)
        for attempt in (on_0, on_1):
            current = saved.sibling(attempt.rollout_id.rsplit("_a", 1)[0]).current
            assert current.status is AttemptStatus.ABANDONED


async def test_abandoned_attempts_are_retired_before_prepare_once(tmp_path) -> None:
    """Issue 10, finding 11 (b): the environment phase retires the attempts the ledger gave up
    before it prepares (the seed's order), each once; the Gym then refuses that attempt."""
    async with harness() as h:
        cfg = await h.start_gyms(_turn_config(tmp_path))
        controller = await h.controller(cfg)
        await run_to_end(controller)
        (gone,) = await _out_on(controller, ["gym-0"])
        async with controller.barrier.checkpoint() as cut:
            controller.ledger.abandon(
                cut, gone.rollout_id.rsplit("_a", 1)[0], gone.attempt_uuid, "test: given up"
            )
        environment = controller.environment
        original = environment.prepare
        retired: list[list[EnvironmentEpisode]] = []

        async def prepare(checkpoint_id, deadline_ts, retire=()):
            retired.append(list(retire))
            return await original(checkpoint_id, deadline_ts, retire)

        environment.prepare = prepare
        assert await controller.rollout_snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        assert await controller.rollout_snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        episode = EnvironmentEpisode(gone.rollout_id, 0, "gym-0")
        assert episode in retired[0] and episode not in retired[1]
        body = {
            "episode_id": {"rollout_id": gone.rollout_id, "attempt": 0},
            "prompt_id": 1,
            "policy_url": "http://127.0.0.1:9",
        }
        async with aiohttp.ClientSession(headers=HEADERS) as session:
            await announce(session, cfg.gym.endpoints[0], body["policy_url"])
            async with session.post(cfg.gym.endpoints[0] + "/run", json=body) as response:
                assert response.status == 409 and "retired" in (await response.text())


@pytest.mark.parametrize("tamper", ["unknown_record", "missing_record", "step_commits"])
async def test_an_export_that_disagrees_with_the_cut_is_discarded(tmp_path, tamper) -> None:
    """Issue 10, finding 11 (c) and the untested discarded_env path: the export is checked
    against the cut, not trimmed to it. A record of an episode the cut does not know, or an
    expected episode the export neither holds nor reports as not copied, discards the attempt
    (discarded_env, nothing published); so does a train step that starts committing during
    the environment phase. The Gym is resumed either way: the next attempt publishes."""
    async with harness() as h:
        cfg = await h.start_gyms(_turn_config(tmp_path))
        controller = await h.controller(cfg)
        await run_to_end(controller)
        await _out_on(controller, ["gym-0", "gym-1"])
        environment = controller.environment
        original = environment.commit

        async def commit(checkpoint_id, deadline_ts, episodes, *unavailable):
            snapshot = await original(checkpoint_id, deadline_ts, episodes, *unavailable)
            if tamper == "unknown_record":
                stranger = {"episode_id": {"rollout_id": "stranger", "attempt": 0}}
                records = {**snapshot.records, "gym-0": [*snapshot.records["gym-0"], stranger]}
                return dataclasses.replace(snapshot, records=records)
            if tamper == "missing_record":
                return dataclasses.replace(snapshot, copy_missing=snapshot.copy_missing[1:])
            controller.state.optimizer_commit_in_progress = True
            return snapshot

        environment.commit = commit
        store = ManifestStore(open_storage(cfg.resolved_storage_uri()), cfg.name)
        before = store.committed_ids()
        assert await controller.rollout_snapshots.attempt(force=True) is (
            SnapshotOutcome.DISCARDED_ENV
        )
        error = h.records[-1]["error"]
        expected = {
            "unknown_record": "holds 1 episodes the cut does not know, e.g. stranger on gym-0",
            "missing_record": "missing 1 episodes the cut expects",
            "step_commits": "a train step began committing",
        }[tamper]
        assert expected in error and store.committed_ids() == before
        environment.commit = original
        controller.state.optimizer_commit_in_progress = False
        assert await controller.rollout_snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED


async def _stop_after_a_snapshot_with_episodes(h, cfg) -> None:
    """Run until a snapshot exports live episodes (after step 1), then stop (a crash)."""
    store = ManifestStore(open_storage(cfg.resolved_storage_uri()), cfg.name)
    ref: list = []
    exported: list[int] = []
    stop = asyncio.Event()

    async def snapshot_with_episodes() -> None:
        for _ in range(20):
            outcome = await ref[0].rollout_snapshots.attempt(force=True, reason="test")
            if outcome is not SnapshotOutcome.PUBLISHED:
                continue
            entry = snapshot_dir(store.committed_ids()[-1])
            data = snapshot_file(store.storage, entry, "environment/episodes.json")
            exported.append(sum(len(r) for r in json.loads(data)["records"].values()))
            if exported[-1] > 0:
                break
        stop.set()

    snapshotting: list[asyncio.Future] = []

    def on_step(record):
        if record["step"] == 1:
            snapshotting.append(asyncio.ensure_future(snapshot_with_episodes()))

    first = await h.controller(cfg, on_step=on_step)
    ref.append(first)
    await run_until_stopped(first, stop)
    await asyncio.gather(*snapshotting)
    assert exported and exported[-1] > 0, "no live episode was exported"


async def test_a_restore_the_ledger_refuses_leaves_the_gym_as_before(tmp_path, caplog) -> None:
    """Issue 10, finding 11 (a) through the controller: the Gym's episodes are restored inside
    its restore scope, which ends only once the ledger accepted them. When the ledger refuses
    (here: an injected LedgerRestartError), the scope drops what the Gym installed: no
    attempt 1 is left installed (nor its predecessor retired) for a restore that never
    happened, and the next incarnation restores the same episodes and finishes. (The killed
    trainer's /runs go on in this harness, so an episode that applied a side effect past the
    snapshot meanwhile is refused for that reason, never as "already ran here".)"""
    async with harness() as h:
        cfg = await h.start_gyms(_turn_config(tmp_path, max_steps=6))
        await _stop_after_a_snapshot_with_episodes(h, cfg)

        second = await h.controller(cfg)
        assert await second.restore() is not None
        handed_back = dict(second.resumption.restored_episodes)
        assert handed_back, "no episode was handed back to its Gym instance"

        def refuse(cut, restored=None):
            raise LedgerRestartError("test: a later restore step failed")

        second.ledger.prepare_for_restart = refuse
        with pytest.raises(LedgerRestartError, match="a later restore step failed"):
            await asyncio.wait_for(second.run(), 60)
        urls = {f"gym-{i}": url for i, url in enumerate(cfg.gym.endpoints)}
        async with aiohttp.ClientSession(headers=HEADERS) as session:
            for rollout_id, instance in handed_back.items():
                async with session.get(f"{urls[instance]}/episodes/{rollout_id}") as response:
                    held = (await response.json()).get("episodes", [])
                attempts = [e["episode_id"]["attempt"] for e in held]
                assert attempts == [0], f"{rollout_id} on {instance}: attempts {attempts}"

        caplog.clear()
        third = await h.controller(cfg)
        assert await third.restore() is not None
        assert set(third.resumption.restored_episodes.items()) <= set(handed_back.items())
        # refusals name the rollout: "episode <rollout_id> restarts from turn 0: <why>"
        refusals = {
            message.split()[1]: message
            for message in (r.getMessage() for r in caplog.records)
            if "restarts from turn 0" in message
        }
        assert all("already ran here" not in message for message in refusals.values())
        lost = set(handed_back) - set(third.resumption.restored_episodes)
        assert lost <= set(refusals)
        assert all("continuing would repeat one" in refusals[r] for r in lost), refusals
        await run_to_end(third)
    assert_each_step_once_no_prompt_twice(final_journal(cfg), cfg.grpo.max_steps)


async def test_a_preemption_snapshot_with_a_gym_failing_publishes_and_the_run_resumes(
    tmp_path, monkeypatch
) -> None:
    """Issue 10, finding 2 end to end (SIGTERM's path): at the preemption notice one Gym
    replica no longer answers its control plane. The forced snapshot still publishes
    (published_partial_env, not discarded_env); the next incarnation resumes from it: the other
    replica's episodes continue at turn level, the failed replica's restart as new attempts,
    the run finishes with every step once, and no side effect is applied twice."""
    from rolloutrun_runtime.environments.gym import GymServer
    from rolloutrun_runtime.environments.gym.control import GymCheckpointControl
    from rolloutrun_runtime.policy.http import serve_app
    from rolloutrun_runtime.trainer import SNAPSHOTS_LOG, run_trainer

    monkeypatch.setenv("ROLLOUTRUN_GYM_CONTROL_TOKEN", GYM_TOKEN)
    cfg = _turn_config(tmp_path, max_steps=6)
    async with harness() as h:
        controls = {}
        urls = []
        for index in range(cfg.gym.replicas):
            instance = f"gym-{index}"
            server = GymServer(instance, cfg, tmp_path / f"{instance}.audit.jsonl")
            controls[instance] = GymCheckpointControl(server, GYM_TOKEN)
            server.continue_restored = controls[instance].claim_restored
            runner, url = await serve_app(server.app)
            h.runners.append(runner)
            urls.append(url)
        cfg = cfg.model_copy(update={"gym": cfg.gym.model_copy(update={"endpoints": urls})})
        notice = asyncio.Event()

        def on_step(record):
            if record["step"] == 2:
                controls["gym-1"].token = None  # its control plane answers 403 from now on
                notice.set()

        run = asyncio.ensure_future(run_trainer(cfg, hooks=OnStep(on_step), preemption=notice))
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, 120)
        lines = (Path(cfg.log_dir) / SNAPSHOTS_LOG).read_text().splitlines()
        preemption = [json.loads(line) for line in lines if '"preemption"' in line]
        outcomes = [r["rollout/checkpoint_outcome"] for r in preemption]  # one or two, as above
        assert outcomes in (["published_partial_env"], ["published_partial_env"] * 2)
        for record in preemption:
            assert "checkpoint control is disabled" in record["env_unavailable"]["gym-1"]

        controls["gym-1"].token = GYM_TOKEN  # the replacement replica answers again
        resumed = await h.controller(cfg)
        restored = await resumed.restore()
        assert restored is not None
        assert set(resumed.resumption.restored_episodes.values()) <= {"gym-0"}
        await run_to_end(resumed)
    assert_each_step_once_no_prompt_twice(final_journal(cfg), cfg.grpo.max_steps)
    applied: Counter[tuple[str, int]] = Counter()
    for path in tmp_path.glob("*.audit.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            applied[(entry["rollout_id"], entry["revision"])] += 1
    assert applied and max(applied.values()) == 1, "a side effect was applied twice"
