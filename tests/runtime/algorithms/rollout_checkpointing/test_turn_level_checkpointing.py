"""Saving and restoring rollout state at turn level, through the Gyms' control planes: the
snapshot's environment phase (a lost Gym costs only its own episodes, abandoned attempts are
retired before prepare, an export that disagrees with the cut is discarded) and the restore
that hands live episodes back to their Gym instances under attempt + 1, with its refusals as
trace events and metrics. Its own file beside test_checkpointing.py: every run here has
multi-turn episodes at ``targetLevel: turn``, the only level where a snapshot exports live
episodes and a restore calls the Gyms; sibling level never reaches that code."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import SnapshotOutcome
from rolloutrun_runtime.algorithms.single_controller import OnStep
from rolloutrun_runtime.contract.layout import LEDGER_FILE, snapshot_dir
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
    final_journal,
    harness,
    run_to_end,
    run_until_stopped,
    snapshot_file,
    snapshot_ledger_chunks,
    tiny_config,
)


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
