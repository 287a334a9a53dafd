"""Taking a Gym checkpoint over real HTTP: prepare / commit / resume / retire / forget, the
control plane's guards (ids, token, lease, a newer trainer), the snapshot that comes back and
its check against the cut, and the builder that picks the backend.

A real generation engine serves a scripted policy (each turn answers ``+1``), a real Gym
server runs ``reach_target`` episodes with a tool delay, and the trainer-side client drives
the control plane exactly as a snapshot attempt does (the rig is
``tests/support/gym_checkpoint_rig.py``). Restoring a snapshot, the other half of the control
plane, is ``test_gym_environment_restore.py``: its tests start where these end, from a
snapshot whose trainer was killed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from rolloutrun_runtime.contract.run_config import parse_run_config
from rolloutrun_runtime.contract.wire import CONTROL_ROUTE_PREFIX as ROUTE_PREFIX
from rolloutrun_runtime.environments.checkpointing import (
    EnvironmentCheckpointError,
    EnvironmentEpisode,
    NoEnvironmentCheckpoint,
    build_environment_checkpoint,
)
from rolloutrun_runtime.environments.checkpointing.interfaces import (
    ExportMismatchError,
    check_export,
)
from rolloutrun_runtime.environments.checkpointing.nemo_gym import (
    GymEnvironmentCheckpoint,
    GymSnapshot,
)
from rolloutrun_runtime.environments.gym.control import ControlPhase
from rolloutrun_runtime.environments.gym.episode import EpisodeId
from tests.support.gym_checkpoint_rig import CFG, LONG, TOKEN, Rig, _record, deadline


async def test_prepare_copies_at_boundaries_without_holding_episodes(rig: Rig) -> None:
    await rig.start_gym()
    client = rig.client()
    runs = [rig.run("gym-0", f"r{i}", prompt_id=LONG[i]) for i in range(3)]
    await rig.wait_live("gym-0", 3)
    await client.prepare("ck1", deadline())
    server, control, _ = rig.gyms["gym-0"]
    assert control.phase is ControlPhase.PREPARED
    assert sorted(e.rollout_id for e in control.copies) == ["r0", "r1", "r2"]
    turns_at_copy = {e: record["turn"] for e, record in control.copies.items()}
    for _ in range(400):  # nothing is held: the episodes go on taking turns
        if all(server.episodes[e].turn > turn for e, turn in turns_at_copy.items()):
            break
        await asyncio.sleep(0.01)
    assert all(server.episodes[e].turn > turn for e, turn in turns_at_copy.items())
    wanted = [EnvironmentEpisode(f"r{i}", 0, "gym-0") for i in range(3)]
    snapshot = await client.commit("ck1", deadline(), wanted)
    assert snapshot.episodes() == sorted(wanted)
    assert isinstance(snapshot, GymSnapshot)
    for record in snapshot.records["gym-0"]:
        episode = server.episodes[EpisodeId(record["episode_id"]["rollout_id"])]
        # the newest copy before commit: at a boundary, behind the live episode, its own data
        assert record["phase"] == "await_model" and record["turn"] <= episode.turn
        assert record["state"] is not episode.state
    assert GymSnapshot.from_bytes(snapshot.to_bytes()) == GymSnapshot(
        "ck1", json.loads(snapshot.to_bytes())["records"]
    )
    await asyncio.sleep(0.1)  # episodes move on after commit; the commit answer does not
    assert (await client.commit("ck1", deadline(), wanted)).to_bytes() == snapshot.to_bytes()
    await client.resume("ck1")
    results = [await run for run in runs]
    assert [status for status, _ in results] == [200, 200, 200]
    assert all(body["reward"] is not None for _, body in results)
    assert max(rig.audit_revisions().values()) == 1


async def test_a_prepare_wakes_once_when_the_last_run_left_its_copy(rig: Rig) -> None:
    """The prepare waiting for three runs is woken when the last one copied, not at each
    (one wake-up of its loop per snapshot, not one per run in flight)."""
    await rig.start_gym()
    client = rig.client()
    runs = [rig.run("gym-0", f"r{i}", prompt_id=LONG[i]) for i in range(3)]
    await rig.wait_live("gym-0", 3)
    _, control, _ = rig.gyms["gym-0"]
    wakes: list[int] = []
    event_set = control._changed.set
    control._changed.set = lambda: (wakes.append(len(control._awaiting)), event_set())[1]  # type: ignore[method-assign]
    await client.prepare("ck1", deadline())
    assert control.phase is ControlPhase.PREPARED and len(control.copies) == 3
    assert wakes == [0]
    await client.resume("ck1")
    assert [status for status, _ in [await run for run in runs]] == [200, 200, 200]


async def test_a_new_run_is_admitted_and_copied_while_prepared(rig: Rig) -> None:
    await rig.start_gym()
    client = rig.client()
    await client.prepare("ck1", deadline())
    late = rig.run("gym-0", "late", prompt_id=LONG[0])
    await rig.wait_live("gym-0", 1)
    control = rig.gyms["gym-0"][1]
    assert EpisodeId("late") in control.copies  # copied at its first boundary
    snapshot = await client.commit("ck1", deadline(), [EnvironmentEpisode("late", 0, "gym-0")])
    assert [e.row_key for e in snapshot.episodes()] == ["late"]
    status, _ = await late  # never waited for resume
    assert status == 200 and control.phase is ControlPhase.COMMITTED
    await client.resume("ck1")


async def test_commit_lists_requested_episodes_without_a_copy(rig: Rig) -> None:
    url = await rig.start_gym()
    client = rig.client()
    run = rig.run("gym-0", "r0", prompt_id=LONG[0])
    await rig.wait_live("gym-0", 1)
    await client.prepare("ck1", deadline())
    ghost = EnvironmentEpisode("ghost", 0, "gym-0")
    snapshot = await client.commit("ck1", deadline(), [EnvironmentEpisode("r0", 0, "gym-0"), ghost])
    assert [e.rollout_id for e in snapshot.episodes()] == ["r0"]
    headers = {"Authorization": f"Bearer {TOKEN}"}
    body = {"checkpoint_id": "ck1", "deadline_s": 5.0, "episodes": ["r0", "ghost"]}
    async with rig.session.post(url + ROUTE_PREFIX + "/commit", json=body, headers=headers) as r:
        answer = await r.json()
    assert r.status == 200 and [x["episode_id"]["rollout_id"] for x in answer["records"]] == ["r0"]
    assert answer["not_copied"] == [
        {"episode": "ghost", "state": "unknown here (its /run has not arrived)"}
    ]
    await client.resume("ck1")
    status, _ = await run
    assert status == 200


def test_a_snapshot_restricted_to_the_episodes_still_out() -> None:
    def record(rollout_id: str, attempt: int) -> dict[str, Any]:
        return {"episode_id": {"rollout_id": rollout_id, "attempt": attempt}}

    snapshot = GymSnapshot(
        "ck", {"gym-0": [record("a", 0), record("b", 1)], "gym-1": [record("c", 0)]}
    )
    out = [
        EnvironmentEpisode("a", 0, "gym-0"),
        EnvironmentEpisode("b", 2, "gym-0"),  # a later attempt: the copy of attempt 1 is stale
        EnvironmentEpisode("c", 0, "gym-0"),  # another instance's episode of the same id
    ]
    kept = snapshot.restricted_to(out)
    assert kept.episodes() == [EnvironmentEpisode("a", 0, "gym-0")]
    assert kept.checkpoint_id == "ck" and snapshot.episodes() != kept.episodes()


async def test_ids_are_idempotent_and_a_resumed_id_stays_closed(rig: Rig) -> None:
    url = await rig.start_gym()
    client = rig.client()
    await client.prepare("ck1", deadline())
    assert await client.prepare("ck1", deadline()) == {}  # repeated: same answer
    refused = await client.prepare("ck2", deadline())
    assert "busy with checkpoint ck1" in refused["gym-0"]
    first = await client.commit("ck1", deadline(), [])
    assert (await client.commit("ck1", deadline(), [])).to_bytes() == first.to_bytes()
    await client.resume("ck1")
    await client.resume("ck1")
    assert "already resumed" in (await client.prepare("ck1", deadline()))["gym-0"]
    async with rig.session.get(url + ROUTE_PREFIX + "/status") as response:
        assert response.status == 401


async def test_wrong_token_and_disabled_control_plane(rig: Rig) -> None:
    url = await rig.start_gym("gym-0")
    off = await rig.start_gym("gym-off", token="")
    headers = {"Authorization": "Bearer nope"}
    async with rig.session.get(url + ROUTE_PREFIX + "/status", headers=headers) as response:
        assert response.status == 401
    async with rig.session.get(off + ROUTE_PREFIX + "/status", headers=headers) as response:
        assert response.status == 403
        assert "ROLLOUTRUN_GYM_CONTROL_TOKEN" in (await response.json())["error"]["message"]


async def test_malformed_control_request_names_the_field(rig: Rig) -> None:
    url = await rig.start_gym()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with rig.session.post(
        url + ROUTE_PREFIX + "/prepare", json={"checkpoint_id": "x"}, headers=headers
    ) as response:
        assert response.status == 400
        assert "deadline_s" in (await response.json())["error"]["message"]


async def test_lease_expiry_resumes_the_gym_on_its_own(rig: Rig) -> None:
    await rig.start_gym()
    client = rig.client()
    run = rig.run("gym-0", "r0", prompt_id=LONG[0])
    await rig.wait_live("gym-0", 1)
    await client.prepare("ck1", deadline(2.0))
    control = rig.gyms["gym-0"][1]
    assert control.phase is ControlPhase.PREPARED
    rig.clock.offset = 10.0  # the trainer vanished: no renew, deadline + grace passes
    for _ in range(200):
        if control.phase is ControlPhase.IDLE:
            break
        await asyncio.sleep(0.01)
    assert control.phase is ControlPhase.IDLE and "ck1" in control.resumed
    status, _ = await run
    assert status == 200


@pytest.mark.parametrize("first_call", ["prepare", "restore"])
async def test_a_newer_trainer_ends_the_checkpoint_a_killed_one_left_open(
    rig: Rig, first_call: str
) -> None:
    """A trainer killed between prepare and resume left the Gym prepared: its successor's
    first call (a snapshot's prepare, or the restore at start-up) ends that checkpoint at
    once instead of being refused until the lease runs out; the old trainer is refused."""
    await rig.start_gym()
    control = rig.gyms["gym-0"][1]
    old = rig.client()
    run = rig.run("gym-0", "r0", prompt_id=LONG[0])
    await rig.wait_live("gym-0", 1)
    await old.prepare("ck-old", deadline(30.0))  # ... and the trainer is SIGKILLed here
    assert control.phase is ControlPhase.PREPARED
    new = rig.client()
    assert new.trainer["started_ns"] > old.trainer["started_ns"]
    if first_call == "prepare":
        await new.prepare("ck-new", deadline())
        assert control.phase is ControlPhase.PREPARED and control.checkpoint_id == "ck-new"
        await new.commit("ck-new", deadline(), [EnvironmentEpisode("r0", 0, "gym-0")])
        await new.resume("ck-new")
    else:
        await new.restore("ck-new", deadline(), GymSnapshot("ck-new", {}).to_bytes())
        await new.end_restore("ck-new", keep=True)
    assert "ck-old" in control.resumed and control.phase is ControlPhase.IDLE
    assert control.trainer is not None and control.trainer.id == new.trainer["id"]
    stale = await old.commit("ck-old", deadline(), [])
    assert "superseded by trainer" in stale.unavailable["gym-0"] and not stale.episodes()
    assert "superseded by trainer" in (await old.prepare("ck-old-2", deadline()))["gym-0"]
    status, _ = await run
    assert status == 200


async def test_a_prepare_ended_while_it_waits_marks_nothing_prepared(rig: Rig) -> None:
    """An old trainer's prepare still waiting for a /run to reach a boundary when a newer
    trainer takes over answers 409 and leaves the newer trainer's state alone."""
    await rig.start_gym()
    control = rig.gyms["gym-0"][1]
    stuck = asyncio.get_running_loop().create_future()  # a /run that never reaches a boundary
    control._runs[stuck] = None  # type: ignore[index]
    try:
        old = rig.client()
        waiting = asyncio.create_task(old.prepare("ck-old", deadline(10.0)))
        for _ in range(400):
            if control.phase is ControlPhase.PREPARING:
                break
            await asyncio.sleep(0.005)
        assert control.phase is ControlPhase.PREPARING
        new = rig.client()
        await new.restore("ck-new", deadline(), GymSnapshot("ck-new", {}).to_bytes())
        await new.end_restore("ck-new", keep=True)
        failed = await asyncio.wait_for(waiting, 5.0)
        assert "ck-old ended while preparing" in failed["gym-0"]
        assert control.phase is ControlPhase.IDLE and control.checkpoint_id is None
    finally:
        del control._runs[stuck]  # type: ignore[arg-type]
        stuck.cancel()


async def test_retire_stops_an_attempt_and_refuses_it_until_forget(rig: Rig) -> None:
    await rig.start_gym()
    client = rig.client()
    run = rig.run("gym-0", "r0", prompt_id=LONG[0])
    await rig.wait_live("gym-0", 1)
    await client.retire([EnvironmentEpisode("r0", 0, "gym-0")])
    status, body = await run
    assert status == 409 and "retired" in body["error"]["message"]
    again_status, _ = await rig.run("gym-0", "r0", prompt_id=LONG[0])
    assert again_status == 409
    server, control, _ = rig.gyms["gym-0"]
    await client.forget(["r0"])
    assert "r0" not in control.retired
    assert not [key for key in server.episodes if key.rollout_id == "r0"]
    # Side effects are keyed by rollout id: a forgotten id is never reused (the trainer mints
    # a new attempt id), and reusing it would be refused rather than repeat revision 1.
    reused_status, reused = await rig.run("gym-0", "r0", prompt_id=LONG[0])
    assert reused_status == 409 and "already applied" in reused["error"]["message"]
    fresh_status, _ = await rig.run("gym-0", "r0b", prompt_id=LONG[0])
    assert fresh_status == 200


async def test_builder_and_the_backend_that_keeps_nothing() -> None:
    sibling = parse_run_config({"checkpointing": {"targetLevel": "sibling"}})
    backend = build_environment_checkpoint(sibling, {}, None)
    assert isinstance(backend, NoEnvironmentCheckpoint) and not backend.holds_rollout_state
    snapshot = await backend.commit("x", deadline(), [])
    assert snapshot.episodes() == []
    with pytest.raises(EnvironmentCheckpointError, match="keeps none"):
        await backend.commit("x", deadline(), [EnvironmentEpisode("r", 0, "g")])
    gym = build_environment_checkpoint(CFG, {"gym-0": "http://127.0.0.1:9"}, TOKEN)
    assert isinstance(gym, GymEnvironmentCheckpoint) and gym.holds_rollout_state
    with pytest.raises(EnvironmentCheckpointError, match="control token"):
        build_environment_checkpoint(CFG, {"gym-0": "http://127.0.0.1:9"}, None)


def test_snapshot_bytes_of_a_foreign_format_are_refused() -> None:
    with pytest.raises(EnvironmentCheckpointError, match="format"):
        GymSnapshot.from_bytes(b'{"format": "other/9"}')
    with pytest.raises(EnvironmentCheckpointError, match="not valid JSON"):
        GymSnapshot.from_bytes(b"{")


# ---------------------------------------------------------------------------- issue 10
async def test_a_lost_replica_is_reported_unavailable_not_fatal(rig: Rig) -> None:
    """Issue 10, finding 2: prepare and commit report a replica that is gone (connection
    refused) as unavailable and go on with the others; the snapshot names it."""
    await rig.start_gym("gym-0")
    await rig.start_gym("gym-1")
    run = rig.run("gym-0", "r0", prompt_id=LONG[0])
    await rig.wait_live("gym-0", 1)
    client = rig.client()
    client.endpoints["gym-1"] = "http://127.0.0.1:9"  # its pod was deleted
    wanted = [EnvironmentEpisode("r0", 0, "gym-0"), EnvironmentEpisode("lost", 0, "gym-1")]
    failed = await client.prepare("ck1", deadline(), retire=[wanted[1]])
    assert list(failed) == ["gym-1"] and "gym-1 retire failed" in failed["gym-1"]
    snapshot = await client.commit("ck1", deadline(), wanted, failed)
    assert isinstance(snapshot, GymSnapshot)
    assert snapshot.episodes() == [wanted[0]] and list(snapshot.unavailable) == ["gym-1"]
    assert GymSnapshot.from_bytes(snapshot.to_bytes()).unavailable == snapshot.unavailable
    check = check_export(snapshot, wanted, wanted)
    assert check.kept.episodes() == [wanted[0]] and check.without_record == (wanted[1],)
    with pytest.raises(EnvironmentCheckpointError, match="gym-1 resume failed"):
        await client.resume("ck1")
    status, _ = await run
    assert status == 200


def test_check_export_keeps_what_ran_on_and_refuses_what_the_cut_does_not_know() -> None:
    """Issue 10, finding 11 (c), the rule table: the export is checked against the cut."""
    a, b, c = (EnvironmentEpisode(r, 0, "gym-0") for r in "abc")
    late = EnvironmentEpisode("late", 0, "gym-0")
    lost = EnvironmentEpisode("lost", 0, "gym-1")
    snapshot = GymSnapshot(
        "ck",
        {"gym-0": [_record("a"), _record("b")]},
        unavailable={"gym-1": "connection refused"},
        copy_missing=(c,),
    )
    # b finished since its copy (dropped); c was not copied and late was dispatched after
    # the commit (no record, turn 0); lost is on an unavailable replica (no record, turn 0)
    check = check_export(snapshot, [a, b, c, lost], [a, c, late, lost])
    assert check.kept.episodes() == [a] and check.finished_since_copy == 1
    assert check.without_record == tuple(sorted([c, late, lost]))
    with pytest.raises(ExportMismatchError, match=r"does not know, e\.g\. b on gym-0"):
        check_export(snapshot, [a, c], [a])  # a record nobody asked for
    stale = GymSnapshot("ck", {"gym-0": [_record("a", 1)]})
    with pytest.raises(ExportMismatchError, match=r"does not know, e\.g\. a-a1"):
        check_export(stale, [a], [a])  # another attempt than the ledger's
    elsewhere = GymSnapshot("ck", {"gym-1": [_record("a")]})
    with pytest.raises(ExportMismatchError, match="does not know"):
        check_export(elsewhere, [a], [a])  # another instance than the ledger's
    twice = GymSnapshot("ck", {"gym-0": [_record("a"), _record("a")]})
    with pytest.raises(ExportMismatchError, match="2 times"):
        check_export(twice, [a], [a])
    silent = GymSnapshot("ck", {"gym-0": [_record("a")]})
    with pytest.raises(ExportMismatchError, match=r"missing 1 episodes the cut expects, e\.g\. b"):
        check_export(silent, [a, b], [a, b])
    assert check_export(silent, [a, b], [a]).kept.episodes() == [a]  # b is not out any more
