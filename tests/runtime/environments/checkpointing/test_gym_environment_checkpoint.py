"""The Gym checkpoint control plane and GymEnvironmentCheckpoint, over real HTTP.

A real generation engine serves a scripted policy (each turn answers ``+1``), a real Gym
server runs ``reach_target`` episodes with a tool delay, and the trainer-side client drives
prepare / commit / resume / restore / retire / forget exactly as a snapshot attempt does.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rolloutrun_runtime.contract.run_config import RunConfig, parse_run_config
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
    restore_scope,
)
from rolloutrun_runtime.environments.checkpointing.nemo_gym import (
    GymEnvironmentCheckpoint,
    GymSnapshot,
)
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.environments.gym.control import (
    ControlPhase,
    GymCheckpointControl,
)
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
from rolloutrun_runtime.policy.generation import (
    GenerationEngine,
    build_generation_app,
    serve_app,
)
from rolloutrun_runtime.policy.scripted import PLUS_ONE_SCRIPT, scripted_state_dict
from rolloutrun_runtime.policy.tokenizer import TOKENIZER
from rolloutrun_runtime.tasks import ReachTargetProblem, make_problem
from tests.support.data_plane import HEADERS, announce
from tests.support.run_configs import TURN_LEVEL_GYM

TOKEN = "s3cret"
CFG = TURN_LEVEL_GYM


def long_prompts(count: int, min_target: int = 6) -> list[int]:
    """Prompt ids whose target takes at least ``min_target`` +1 turns (still running later)."""
    found = []
    for prompt_id in range(CFG.task.dataset_size):
        problem = make_problem(CFG.task, CFG.seed, prompt_id)
        assert isinstance(problem, ReachTargetProblem)
        if problem.target - problem.start >= min_target:
            found.append(prompt_id)
    assert len(found) >= count
    return found[:count]


LONG = long_prompts(4)


class Clock:
    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


class Rig:
    """A policy server, Gym replicas with control planes, and the trainer-side client."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.runners: list[Any] = []
        self.session = aiohttp.ClientSession(headers=HEADERS)
        self.clock = Clock()
        self.gyms: dict[str, tuple[GymServer, GymCheckpointControl, str]] = {}
        self.policy_url = ""

    async def start_policy(self, cfg: RunConfig = CFG) -> None:
        state = scripted_state_dict(cfg.policy, PLUS_ONE_SCRIPT)
        engine = GenerationEngine(cfg.policy, TOKENIZER.vocab_size, TOKENIZER.eos_id, state, 0)
        runner, self.policy_url = await serve_app(build_generation_app(engine))
        self.runners.append(runner)

    async def start_gym(self, instance: str = "gym-0", token: str | None = TOKEN) -> str:
        server = GymServer(instance, CFG, self.tmp / f"{instance}.audit.jsonl")
        control = GymCheckpointControl(
            server, token, grace_s=1.0, clock=self.clock, watchdog_interval_s=0.05
        )
        server.continue_restored = control.claim_restored
        runner, url = await serve_app(server.app, cancel_on_disconnect=True)
        self.runners.append(runner)
        self.gyms[instance] = (server, control, url)
        return url

    def client(self) -> GymEnvironmentCheckpoint:
        return GymEnvironmentCheckpoint(
            {name: url for name, (_, _, url) in self.gyms.items()}, TOKEN, session=self.session
        )

    def run(self, instance: str, rollout_id: str, prompt_id: int, attempt: int = 0) -> Any:
        url = self.gyms[instance][2] + "/run"
        body = {
            "episode_id": {"rollout_id": rollout_id, "attempt": attempt},
            "prompt_id": prompt_id,
            "policy_url": self.policy_url,
        }

        async def call() -> tuple[int, dict[str, Any]]:
            await announce(self.session, url.removesuffix("/run"), self.policy_url)
            async with self.session.post(url, json=body) as response:
                return response.status, await response.json()

        return asyncio.create_task(call())

    async def wait_live(self, instance: str, count: int) -> None:
        server = self.gyms[instance][0]
        for _ in range(400):
            if len(server.live_episodes()) >= count:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"{count} live episodes never appeared")

    def audit_revisions(self) -> Counter[tuple[str, int]]:
        seen: Counter[tuple[str, int]] = Counter()
        for path in self.tmp.glob("*.audit.jsonl"):
            for line in path.read_text().splitlines():
                entry = json.loads(line)
                seen[(entry["rollout_id"], entry["revision"])] += 1
        return seen

    async def close(self) -> None:
        await self.session.close()
        for runner in self.runners:
            await runner.cleanup()


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    rig = Rig(tmp_path)
    await rig.start_policy()
    yield rig
    await rig.close()


def deadline(seconds: float = 5.0) -> float:
    return time.time() + seconds


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


def _record(rollout_id: str, attempt: int = 0) -> dict[str, Any]:
    return {"episode_id": {"rollout_id": rollout_id, "attempt": attempt}}


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
