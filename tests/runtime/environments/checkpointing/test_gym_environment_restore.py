"""Restoring a Gym checkpoint over real HTTP: the episodes a restore continues under
attempt + 1, hands back finished or refuses, the restore scope that drops what it installed
when the restore fails later, and the rule that picks the copy a restored episode continues
from.

The rig is the snapshot tests' (``tests/support/gym_checkpoint_rig.py``). Most tests here
start from a snapshot of running episodes whose trainer was killed right after the commit
(``_snapshot_two_running``) and restore it as the next incarnation does; the audit log then
shows whether a side effect was applied twice. That start, and the rule table of
:func:`choose_restore_source`, make this half its own file; taking the snapshot is
``test_gym_environment_checkpoint.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.environments.checkpointing import (
    EnvironmentCheckpointError,
    EnvironmentEpisode,
)
from rolloutrun_runtime.environments.checkpointing.interfaces import restore_scope
from rolloutrun_runtime.environments.checkpointing.nemo_gym import (
    GymEnvironmentCheckpoint,
    GymSnapshot,
)
from rolloutrun_runtime.environments.gym.control import ControlPhase
from rolloutrun_runtime.environments.gym.episode import (
    CANCELLED_REASON,
    POLICY_FAILED_PREFIX,
    Episode,
    EpisodeId,
    Phase,
    Sampling,
    Segment,
)
from rolloutrun_runtime.environments.gym.restore import choose_restore_source
from tests.support.gym_checkpoint_rig import LONG, Rig, _record, deadline


async def _snapshot_two_running(rig: Rig, client: GymEnvironmentCheckpoint) -> GymSnapshot:
    runs = [rig.run("gym-0", f"r{i}", prompt_id=LONG[i]) for i in range(2)]
    await rig.wait_live("gym-0", 2)
    await asyncio.sleep(0.1)  # let them apply a side effect or two
    await client.prepare("ck1", deadline())
    episodes = [EnvironmentEpisode(f"r{i}", 0, "gym-0") for i in range(2)]
    snapshot = await client.commit("ck1", deadline(), episodes)
    # The trainer dies right after the commit: its connections drop and the Gym cancels the
    # handlers. An episode may run a turn further first (the copy window closed at the
    # commit); it stops consistent with its side-effect log even when the cancel lands while
    # an effect's record is written, so its restore continues from the replica's own copy.
    for run in runs:
        run.cancel()
    await asyncio.gather(*runs, return_exceptions=True)
    # The Gym sees the dropped connections a moment later (seconds on a loaded CI machine):
    # resume once it has cancelled them.
    server = rig.gyms["gym-0"][0]
    for _ in range(1000):
        if all(e.error == CANCELLED_REASON for e in server.episodes.values()):
            break
        await asyncio.sleep(0.01)
    assert all(e.error == CANCELLED_REASON for e in server.episodes.values()), (
        "the Gym did not cancel the dropped episodes within 10 s"
    )
    await client.resume("ck1")
    return GymSnapshot.from_bytes(snapshot.to_bytes())


async def test_prepare_copies_a_restored_episode_no_run_drives(rig: Rig) -> None:
    await rig.start_gym()
    client = rig.client()
    snapshot = await _snapshot_two_running(rig, client)
    async with restore_scope(client, "ck-restore", deadline(), snapshot.to_bytes()):
        pass
    assert await client.prepare("ck2", deadline(1.0)) == {}  # answers at once: nothing runs
    copies = rig.gyms["gym-0"][1].copies
    assert sorted(e.row_key for e in copies) == ["r0-a1", "r1-a1"]
    await client.resume("ck2")


async def test_restore_continues_the_same_replica_episode_under_attempt_plus_one(
    rig: Rig,
) -> None:
    await rig.start_gym()
    client = rig.client()
    snapshot = await _snapshot_two_running(rig, client)
    server = rig.gyms["gym-0"][0]
    for _ in range(100):
        if all(e.error == CANCELLED_REASON for e in server.episodes.values()):
            break
        await asyncio.sleep(0.01)
    async with restore_scope(client, "ck-restore", deadline(), snapshot.to_bytes()) as outcome:
        assert rig.gyms["gym-0"][1].phase is ControlPhase.RESTORED
    assert [e.row_key for e in outcome.restored] == ["r0-a1", "r1-a1"] and not outcome.refused
    # The kept restore leaves the replica idle: the next snapshot may prepare right away.
    assert rig.gyms["gym-0"][1].phase is ControlPhase.IDLE
    await client.prepare("ck-next", deadline())
    await client.resume("ck-next")
    results = [await rig.run("gym-0", f"r{i}", prompt_id=LONG[i], attempt=1) for i in range(2)]
    assert [status for status, _ in results] == [200, 200]
    for _status, body in results:
        assert body["episode_id"]["attempt"] == 1 and body["reward"] is not None
    revisions = rig.audit_revisions()
    assert max(revisions.values()) == 1, "a side effect was applied twice"
    for rollout in ("r0", "r1"):
        mine = sorted(rev for (rid, rev) in revisions if rid == rollout)
        assert mine == list(range(1, len(mine) + 1)), "revisions must be contiguous"


async def test_restore_hands_back_an_episode_that_finished_after_the_snapshot(rig: Rig) -> None:
    """Issue 15: an episode copied by a snapshot that finished on the replica afterwards (its
    result died with the trainer) is restored finished, and attempt 1's ``/run`` returns that
    result at once: no turn redone, no side effect applied again (it was refused, the sibling
    restarting from turn 0, before)."""
    await rig.start_gym()
    client = rig.client()
    runs = [rig.run("gym-0", f"r{i}", prompt_id=LONG[i]) for i in range(2)]
    await rig.wait_live("gym-0", 2)
    await asyncio.sleep(0.1)  # let them apply a side effect or two
    await client.prepare("ck1", deadline())
    episodes = [EnvironmentEpisode(f"r{i}", 0, "gym-0") for i in range(2)]
    snapshot = GymSnapshot.from_bytes((await client.commit("ck1", deadline(), episodes)).to_bytes())
    await client.resume("ck1")
    finished = [body for _, body in await asyncio.gather(*runs)]  # ran on to the end
    server = rig.gyms["gym-0"][0]
    copied = {r["episode_id"]["rollout_id"]: r["revision"] for r in snapshot.records["gym-0"]}
    assert all(server.effects.applied_revision(r) > rev for r, rev in copied.items())
    before = rig.audit_revisions()
    async with restore_scope(client, "ck-restore", deadline(), snapshot.to_bytes()) as outcome:
        pass
    assert [e.row_key for e in outcome.restored] == ["r0-a1", "r1-a1"] and not outcome.refused
    results = [await rig.run("gym-0", f"r{i}", prompt_id=LONG[i], attempt=1) for i in range(2)]
    for (status, body), first in zip(results, finished, strict=True):
        assert status == 200 and body["episode_id"]["attempt"] == 1
        assert body["reward"] == first["reward"] and body["segments"] == first["segments"]
    assert rig.audit_revisions() == before, "a side effect was applied again"


async def test_restore_on_a_fresh_replica_refuses_episodes_that_ran_past_the_snapshot(
    rig: Rig, tmp_path: Path
) -> None:
    await rig.start_gym()
    client = rig.client()
    snapshot = await _snapshot_two_running(rig, client)
    # A replacement replica (same instance id, same durable audit file, empty memory).
    server, _, _ = rig.gyms["gym-0"]
    applied = {r: server.effects.applied_revision(r) for r in ("r0", "r1")}
    records = {r["episode_id"]["rollout_id"]: r["revision"] for r in snapshot.records["gym-0"]}
    await rig.runners.pop().cleanup()
    await rig.start_gym("gym-0")
    outcome = await rig.client().restore("ck-restore", deadline(), snapshot.to_bytes())
    refused = {episode.rollout_id for episode, _ in outcome.refused}
    restored = {episode.rollout_id for episode in outcome.restored}
    assert refused == {r for r in records if applied[r] > records[r]}
    assert restored == {r for r in records if applied[r] == records[r]}
    assert all("continuing would repeat one" in why for _, why in outcome.refused)


async def test_restore_refuses_episodes_of_an_unknown_instance(rig: Rig) -> None:
    await rig.start_gym()
    snapshot = GymSnapshot("ck", {"gym-9": []})
    with pytest.raises(EnvironmentCheckpointError, match="must return to its owner"):
        await rig.client().restore("ck", deadline(), snapshot.to_bytes())


def _episode(revision: int, phase: Phase = Phase.AWAIT_MODEL, error: str | None = None) -> Episode:
    return Episode(
        episode_id=EpisodeId("r", 0),
        prompt_id=1,
        policy_url="http://127.0.0.1:1",
        sampling=Sampling(1.0, 3),
        state={"value": revision},
        segments=[Segment("prompt", [1])],
        phase=phase,
        revision=revision,
        error=error,
    )


@pytest.mark.parametrize(
    ("memory", "applied", "expect"),
    [
        (None, 2, ("snapshot", "")),
        (None, 3, (None, "continuing would repeat one")),
        (_episode(3, Phase.ABANDONED, CANCELLED_REASON), 3, ("memory", "")),
        (_episode(3, Phase.ABANDONED, "boom"), 3, (None, "continuing would repeat one")),
        # Finished here after the snapshot: the successor hands its result back (issue 15).
        (_episode(3, Phase.FINISHED), 3, ("memory", "")),
        # ... but not when the log has applied past it (it is not the rollout's newest state).
        (_episode(3, Phase.FINISHED), 4, (None, "continuing would repeat one")),
        # A failed model call (the trainer vanished) rests at the boundary before the call.
        (_episode(3, Phase.FAILED, POLICY_FAILED_PREFIX + "policy x failed"), 3, ("memory", "")),
        (_episode(3, Phase.FAILED, "side effect refused"), 3, (None, "continuing would repeat")),
        (_episode(2, Phase.AWAIT_TOOL), 2, ("memory", "")),
    ],
)
def test_choose_restore_source_table(memory: Episode | None, applied: int, expect: Any) -> None:
    snapshot = _episode(2)
    record, reason = choose_restore_source(snapshot, memory, applied, successor_exists=False)
    kind, why = expect
    assert why in reason
    if kind is None:
        assert record is None
    else:
        source = snapshot if kind == "snapshot" else memory
        assert record is not None and source is not None
        assert record["revision"] == source.revision
        finished = source.phase is Phase.FINISHED
        assert record["phase"] in ({"finished"} if finished else {"await_model", "await_tool"})
        assert finished or record["error"] is None


def test_choose_restore_source_refuses_a_successor_that_already_ran() -> None:
    record, reason = choose_restore_source(_episode(2), None, 2, successor_exists=True)
    assert record is None and "already ran" in reason


# ---------------------------------------------------------------------------- issue 10
async def test_a_restore_scope_that_fails_drops_what_it_installed(rig: Rig) -> None:
    """Issue 10, finding 11 (a): episodes restored inside the restore scope are dropped when
    the restore fails later (the ledger refuses them, say): the attempts they replaced are not
    retired any more and the same snapshot restores again, instead of being refused as
    "attempt 1 already ran here" and restarting from turn 0."""
    await rig.start_gym()
    client = rig.client()
    snapshot = await _snapshot_two_running(rig, client)
    server, control, _ = rig.gyms["gym-0"]
    for _ in range(100):
        if all(e.error == CANCELLED_REASON for e in server.episodes.values()):
            break
        await asyncio.sleep(0.01)
    before = {key: (e.phase, e.error) for key, e in server.episodes.items()}

    class LaterStepFailed(Exception):
        pass

    with pytest.raises(LaterStepFailed):
        async with restore_scope(client, "ck-r1", deadline(), snapshot.to_bytes()) as outcome:
            assert [e.row_key for e in outcome.restored] == ["r0-a1", "r1-a1"]
            assert control.restored_unclaimed
            raise LaterStepFailed
    assert control.phase is ControlPhase.IDLE and "ck-r1" in control.dropped
    assert not control.restored_unclaimed and not control.retired
    assert {key: (e.phase, e.error) for key, e in server.episodes.items()} == before
    async with restore_scope(client, "ck-r2", deadline(), snapshot.to_bytes()) as again:
        assert [e.row_key for e in again.restored] == ["r0-a1", "r1-a1"] and not again.refused
    assert control.phase is ControlPhase.IDLE and "ck-r2" not in control.dropped
    results = [await rig.run("gym-0", f"r{i}", prompt_id=LONG[i], attempt=1) for i in range(2)]
    assert [status for status, _ in results] == [200, 200]
    assert max(rig.audit_revisions().values()) == 1, "a side effect was applied twice"


async def test_a_restore_scope_its_trainer_abandons_is_dropped_by_the_lease(rig: Rig) -> None:
    """A trainer that dies inside its restore scope never kept it: the lease drops it."""
    await rig.start_gym()
    client = rig.client()
    snapshot = await _snapshot_two_running(rig, client)
    control = rig.gyms["gym-0"][1]
    await client.restore("ck-r1", deadline(2.0), snapshot.to_bytes())
    assert control.phase is ControlPhase.RESTORED and control.restored_unclaimed
    rig.clock.offset = 10.0  # no renew, no resume: deadline + grace passes
    assert control.expire_lease_if_due()
    assert control.phase is ControlPhase.IDLE and "ck-r1" in control.dropped
    assert not control.restored_unclaimed and not control.retired
    with pytest.raises(EnvironmentCheckpointError, match="ck-r1 was already resumed"):
        await client.restore("ck-r1", deadline(), snapshot.to_bytes())


async def test_a_kept_restore_cannot_be_dropped_afterwards(rig: Rig) -> None:
    await rig.start_gym()
    client = rig.client()
    async with restore_scope(client, "ck-r1", deadline(), GymSnapshot("ck-r1", {}).to_bytes()):
        pass
    with pytest.raises(EnvironmentCheckpointError, match="already kept"):
        await client.end_restore("ck-r1", keep=False)


async def test_retire_forgets_a_restored_episode_no_run_claimed(rig: Rig) -> None:
    """Issue 10, finding 11 (b): retiring an abandoned attempt makes the Gym forget its
    episode when no /run drives it, so the next snapshot's prepare does not copy it."""
    await rig.start_gym()
    client = rig.client()
    snapshot = await _snapshot_two_running(rig, client)
    async with restore_scope(client, "ck-r", deadline(), snapshot.to_bytes()):
        pass
    server, control, _ = rig.gyms["gym-0"]
    await client.retire([EnvironmentEpisode("r0", 1, "gym-0")])
    assert EpisodeId("r0", 1) not in server.episodes and EpisodeId("r0", 0) not in server.episodes
    assert EpisodeId("r0", 1) not in control.restored_unclaimed
    assert await client.prepare("ck-next", deadline(1.0)) == {}
    assert sorted(e.row_key for e in control.copies) == ["r1-a1"]
    await client.resume("ck-next")


async def test_a_restore_leaves_out_a_replica_that_is_down_and_restores_the_others(
    rig: Rig,
) -> None:
    """Issue 14: a replica down while the trainer starts (connection refused) is left out of
    the restore; its episodes come back ``unavailable`` with their records (to go on as a
    lost replica's do), the survivor's are restored and kept, and the scope's end calls only
    the survivor. Before, the whole restore failed and every episode restarted from turn 0."""
    await rig.start_gym("gym-0")
    client = rig.client()
    snapshot = await _snapshot_two_running(rig, client)
    server = rig.gyms["gym-0"][0]
    for _ in range(100):  # as above: the dropped runs stop before they apply another effect
        if all(e.error == CANCELLED_REASON for e in server.episodes.values()):
            break
        await asyncio.sleep(0.01)
    lost = {**_record("lost"), "turn": 2}
    records = {"gym-0": list(snapshot.records["gym-0"]), "gym-1": [lost]}
    both = GymSnapshot("ck1", records)
    client.endpoints["gym-1"] = "http://127.0.0.1:9"  # its pod was deleted
    async with restore_scope(client, "ck-restore", deadline(), both.to_bytes()) as outcome:
        assert rig.gyms["gym-0"][1].phase is ControlPhase.RESTORED
    # The survivor restores both of its episodes (from its own copy where a run went on past
    # its record before it was cancelled); only the lost replica's episode is unavailable.
    assert sorted(e.rollout_id for e in outcome.restored) == ["r0", "r1"] and not outcome.refused
    assert outcome.unavailable == ((EnvironmentEpisode("lost", 0, "gym-1"), lost),)
    assert rig.gyms["gym-0"][1].phase is ControlPhase.IDLE  # kept, and only it was resumed
    client.endpoints["gym-0"] = "http://127.0.0.1:9"  # every replica down: nothing to restore on
    with pytest.raises(EnvironmentCheckpointError, match="gym-0 restore failed"):
        await client.restore("ck-none", deadline(), both.to_bytes())
