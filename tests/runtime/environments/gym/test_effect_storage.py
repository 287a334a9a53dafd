"""The Gym's side effects kept as create-only storage objects, on file:// and on a real
fake-gcs-server: what a replaced pod refuses, racing writers, storage errors, cancellation.

The policy is the real generation engine with scripted weights (each turn answers ``+1``),
called in process; every ``reach_target`` turn applies one known side effect.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rolloutrun_runtime import gym_main
from rolloutrun_runtime.contract.wire import CONTROL_ROUTE_PREFIX as ROUTE_PREFIX
from rolloutrun_runtime.environments.gym import (
    Episode,
    EpisodeId,
    GymServer,
    LocalPolicyClient,
    Phase,
    SideEffectLog,
    SideEffectReplayError,
)
from rolloutrun_runtime.environments.gym.control import (
    GymCheckpointControl,
)
from rolloutrun_runtime.environments.gym.effects import (
    StorageEffectStore,
    effect_key,
    highest_revisions,
    legacy_effect_key,
    open_effect_store,
    parse_effect_key,
)
from rolloutrun_runtime.environments.gym.episode import CANCELLED_REASON
from rolloutrun_runtime.environments.gym.restore import choose_restore_source
from rolloutrun_runtime.policy.generation import GenerationEngine, serve_app
from rolloutrun_runtime.storage import CheckpointStorage, open_storage
from tests.support.cli import ROLLOUTRUN, reaped
from tests.support.data_plane import HEADERS, announce
from tests.support.gcs_emulator import FakeGcs, FaultProxy
from tests.support.scripted_gym import CFG, NOWHERE, THREE, agent, fresh_episode
from tests.support.storage_params import BUCKET, FAST_RETRY

INSTANCE = "demo-gym-0"


@pytest.fixture
def reopen(storage: CheckpointStorage, request: pytest.FixtureRequest) -> Any:
    """Open the test's storage afresh, as a replacement pod would (a new client on gs://)."""

    def opened() -> CheckpointStorage:
        if storage.base_uri.startswith("gs://"):
            fake: FakeGcs = request.getfixturevalue("fake_gcs")
            return open_storage(storage.base_uri, client=fake.client())
        return open_storage(storage.base_uri)

    return opened


def new_log(storage: CheckpointStorage, instance: str = INSTANCE) -> SideEffectLog:
    return SideEffectLog(instance, store=StorageEffectStore(storage, instance))


def stored(storage: CheckpointStorage, rollout_id: str) -> list[dict[str, Any]]:
    keys = storage.list(f"{rollout_id}/")
    return [json.loads(storage.read_bytes(key)) for key in keys]


# --------------------------------------------------------------------------- pure parts
@pytest.mark.parametrize("rollout_id", ["pg1_g0_aX", ".", "..", ".rr-tmp-x", "a:b~c.d"])
def test_effect_keys_round_trip_and_are_valid_keys(rollout_id: str, tmp_path: Path) -> None:
    key = effect_key(rollout_id, 42)
    assert key.endswith("/000000042.json") and key.count("/") == 1
    assert parse_effect_key(key) == (None, rollout_id, 42)
    legacy = legacy_effect_key(INSTANCE, rollout_id, 42)
    assert parse_effect_key(legacy) == (INSTANCE, rollout_id, 42)
    for valid in (key, legacy):
        open_storage(f"file://{tmp_path}").write_bytes_if_absent(valid, b"{}")


def test_highest_revisions_use_names_only_of_both_layouts_and_every_replica() -> None:
    keys = [
        effect_key("r", 1),
        effect_key("r", 3),
        legacy_effect_key(INSTANCE, "s", 2),
        f"{INSTANCE}/r/notes.txt",
        "stray",
        legacy_effect_key("other-gym", "t", 9),
        "gym-0.audit.jsonl",
    ]
    assert highest_revisions(keys, "test") == {"r": 3, "s": 2, "t": 9}


def test_an_instance_id_that_cannot_name_a_prefix_is_refused(tmp_path: Path) -> None:
    for bad in ("a/b", "..", ""):
        with pytest.raises(ValueError, match="cannot name an audit prefix"):
            open_effect_store(bad, audit_uri=f"file://{tmp_path}")
    with pytest.raises(ValueError, match="not both"):
        open_effect_store(INSTANCE, audit_file=tmp_path / "a.jsonl", audit_uri="file:///x")


# --------------------------------------------------------------------------- replacement
async def test_a_replaced_pod_refuses_what_its_predecessor_applied(
    storage: CheckpointStorage, reopen: Any, engine: GenerationEngine
) -> None:
    old = new_log(storage)
    done = await agent(engine, old).run(fresh_episode(agent(engine, old), "r1"))
    assert done.phase is Phase.FINISHED and done.revision == 3
    records = stored(storage, "r1")
    assert [r["revision"] for r in records] == [1, 2, 3]
    assert records[0]["instance_id"] == INSTANCE and records[0]["effect"]["op"] == "add"
    assert records == done.audit  # the same JSON as the episode's (and an audit file's) entry

    # The replacement pod: same instance id, same URI, nothing in memory.
    replacement = new_log(reopen())
    assert replacement.applied_revision("r1") == 3
    # Any replica of the run: the key is run-wide, not the replica's own.
    assert new_log(reopen(), "demo-gym-1").applied_revision("r1") == 3
    # A snapshot record older than what was applied is refused by the restore, with why.
    snapshot = Episode.from_record({**done.to_record(), "phase": "await_model", "revision": 1})
    source, reason = choose_restore_source(snapshot, None, 3, successor_exists=False)
    assert source is None and "applied side effects up to revision 3, past the snapshot's 1" in (
        reason
    )
    # And running it anyway is refused by the log before anything is written.
    stale = fresh_episode(agent(engine, replacement), "r1", attempt=1)
    with pytest.raises(SideEffectReplayError, match="revision 1 was already applied"):
        await agent(engine, replacement).run(stale)
    assert stale.phase is Phase.FAILED and len(stored(storage, "r1")) == 3


async def test_a_replacement_pods_control_plane_refuses_to_restore_an_older_record(
    storage: CheckpointStorage, reopen: Any, engine: GenerationEngine
) -> None:
    """The trainer restores a snapshot record (revision 1) on the replaced Gym pod, whose
    predecessor applied revision 3 after the snapshot: refused, with the reason."""
    old = new_log(storage)
    episode = fresh_episode(agent(engine, old), "r3")
    loop = agent(engine, old)
    await loop.step(episode)  # model
    await loop.step(episode)  # tool: revision 1
    snapshot = episode.to_record()
    assert (snapshot["phase"], snapshot["revision"]) == ("await_model", 1)
    await loop.run(episode)  # revisions 2 and 3, then the old pod is gone
    assert episode.revision == 3

    server = GymServer(INSTANCE, CFG, effects=new_log(reopen()))
    control = GymCheckpointControl(server, "t0ken")
    server.continue_restored = control.claim_restored
    runner, url = await serve(server)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"checkpoint_id": "ck1", "deadline_s": 30.0, "records": [snapshot]}
            headers = {"Authorization": "Bearer t0ken"}
            route = f"{url}{ROUTE_PREFIX}/restore"
            async with session.post(route, json=body, headers=headers) as response:
                assert response.status == 200
                answer = await response.json()
        assert answer["restored"] == []
        (refusal,) = answer["refused"]
        assert refusal["episode"] == "r3"
        assert "applied side effects up to revision 3, past the snapshot's 1" in refusal["reason"]
    finally:
        await runner.cleanup()


async def test_the_storage_refuses_a_revision_a_stale_replica_still_believes_free(
    storage: CheckpointStorage, reopen: Any, engine: GenerationEngine
) -> None:
    """Two pods of one replica alive at once: the old one's memory does not know what the new
    one applied, the create-only object does."""
    old = new_log(storage)
    replacement = new_log(reopen())
    await agent(engine, replacement).run(fresh_episode(agent(engine, replacement), "r2"))
    zombie = fresh_episode(agent(engine, old), "r2")
    with pytest.raises(SideEffectReplayError, match=r"recorded at .*/r2/000000001\.json"):
        await agent(engine, old).run(zombie)
    assert zombie.phase is Phase.FAILED and zombie.revision == 0
    assert zombie.state["counter"] == 0, "the refused effect was not applied"
    assert [r["instance_id"] for r in stored(storage, "r2")] == [INSTANCE] * 3


async def test_concurrent_writers_of_one_revision_exactly_one_wins(
    storage: CheckpointStorage, reopen: Any, engine: GenerationEngine
) -> None:
    logs = [new_log(reopen()) for _ in range(8)]
    loops = [agent(engine, log) for log in logs]
    episodes = [fresh_episode(loop, "race") for loop in loops]
    for loop, episode in zip(loops, episodes, strict=True):
        await loop.step(episode)  # the model answers: every episode waits to apply "+1"
    outcomes = await asyncio.gather(
        *[loop.step(episode) for loop, episode in zip(loops, episodes, strict=True)],
        return_exceptions=True,
    )
    winners = [e for e, out in zip(episodes, outcomes, strict=True) if out is None]
    refused = [out for out in outcomes if isinstance(out, SideEffectReplayError)]
    assert (len(winners), len(refused)) == (1, 7), outcomes
    assert winners[0].revision == 1 and winners[0].state["counter"] == 1
    assert [r["revision"] for r in stored(storage, "race")] == [1]


# --------------------------------------------------------------------------- errors
@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers=HEADERS) as s:
        yield s


async def post_run(
    session: aiohttp.ClientSession, url: str, rollout_id: str
) -> tuple[int, dict[str, Any]]:
    body = {
        "episode_id": {"rollout_id": rollout_id, "attempt": 0},
        "prompt_id": THREE,
        "policy_url": NOWHERE,
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": 7},
    }
    await announce(session, url, NOWHERE)
    async with session.post(url + "/run", json=body, headers=HEADERS) as response:
        return response.status, await response.json()


async def serve(server: GymServer) -> tuple[Any, str]:
    return await serve_app(server.app, cancel_on_disconnect=True)


async def test_a_storage_error_fails_that_episode_only_and_names_the_object(
    tmp_path: Path, engine: GenerationEngine, session: aiohttp.ClientSession
) -> None:
    root = tmp_path / "store"
    root.mkdir(parents=True)
    (root / "broken").write_text("a file where a directory must go")
    server = GymServer(
        INSTANCE, CFG, audit_uri=f"file://{root}", policy=LocalPolicyClient(engine.generate)
    )
    runner, url = await serve(server)
    try:
        (bad_status, bad), (ok_status, ok) = await asyncio.gather(
            post_run(session, url, "broken"), post_run(session, url, "fine")
        )
        assert bad_status == 503, bad
        message = bad["error"]["message"]
        assert f"file://{root}/broken/000000001.json" in message
        assert "not a directory" in message and "the effect was not applied" in message
        assert (ok_status, ok["reward"], ok["side_effects"]) == (200, 1.0, 3)
        episode = server.episodes[EpisodeId("broken")]
        assert episode.phase is Phase.FAILED and episode.state["counter"] == 0
        assert "000000001.json" in (episode.error or "")
        async with session.get(url + "/healthz") as health:
            assert health.status == 200
        # The server goes on: the next episode runs.
        assert (await post_run(session, url, "after"))[0] == 200
    finally:
        await runner.cleanup()


@pytest.fixture
def proxy(fake_gcs: FakeGcs) -> Iterator[FaultProxy]:
    with FaultProxy(fake_gcs.url) as p:
        yield p


async def test_a_gcs_error_fails_the_episode_and_the_server_goes_on(
    fake_gcs: FakeGcs,
    proxy: FaultProxy,
    engine: GenerationEngine,
    session: aiohttp.ClientSession,
) -> None:
    base = f"gs://{BUCKET}/e-{uuid.uuid4().hex[:12]}/gym-audit"
    storage = open_storage(base, client=fake_gcs.client(proxy.url), retry=FAST_RETRY)
    effects = new_log(storage)  # loads through the proxy: nothing yet
    server = GymServer(INSTANCE, CFG, effects=effects, policy=LocalPolicyClient(engine.generate))
    runner, url = await serve(server)
    try:
        proxy.deny(403)
        status, body = await post_run(session, url, "denied")
        assert status == 503, body
        assert f"{base}/denied/000000001.json" in body["error"]["message"]
        assert "permission denied" in body["error"]["message"]
        proxy.deny(None)
        status, body = await post_run(session, url, "allowed")
        assert (status, body["side_effects"]) == (200, 3)
    finally:
        await runner.cleanup()


# --------------------------------------------------------------------------- cancellation
class HeldAfterWrite:
    """A real storage store whose write returns only when released (a slow response)."""

    blocking = True

    def __init__(self, inner: StorageEffectStore) -> None:
        self.inner = inner
        self.written = threading.Event()
        self.release = threading.Event()

    def load(self) -> dict[str, int]:
        return self.inner.load()

    def where(self, entry: dict[str, Any]) -> str:
        return self.inner.where(entry)

    def write(self, entry: dict[str, Any]) -> None:
        self.inner.write(entry)
        self.written.set()
        assert self.release.wait(10), "never released"

    def close(self) -> None:
        self.inner.close()


async def test_a_run_cancelled_while_its_record_is_written_finishes_the_round_and_stops(
    storage: CheckpointStorage, reopen: Any, engine: GenerationEngine
) -> None:
    """The trainer goes away while a side effect's record is being written: the write
    finishes, the effect is applied once, and the episode stops at the boundary after it, so
    a restore continues it from the replica's copy; a replaced replica (no copy) refuses."""
    held = HeldAfterWrite(StorageEffectStore(storage, INSTANCE))
    server = GymServer(
        INSTANCE,
        CFG,
        effects=SideEffectLog(INSTANCE, store=held),
        policy=LocalPolicyClient(engine.generate),
    )
    runner, url = await serve(server)
    try:
        async with aiohttp.ClientSession() as session:
            call = asyncio.create_task(post_run(session, url, "cut"))
            assert await asyncio.to_thread(held.written.wait, 10)
            episode = server.episodes[EpisodeId("cut")]
            before = episode.to_record()  # what a copy taken before the effect holds
            call.cancel()  # the trainer goes away: the server cancels the /run
            with pytest.raises(asyncio.CancelledError):
                await call
            await until(
                lambda: handler_cancelled() or episode.phase is Phase.ABANDONED,
                "the server never cancelled the /run",
            )
        assert episode.phase is Phase.AWAIT_TOOL and episode.revision == 0, "stopped mid-write"
        held.release.set()
        await until(lambda: episode.phase is Phase.ABANDONED, "the /run never stopped")
        assert [r["revision"] for r in stored(storage, "cut")] == [1]
        assert (episode.phase, episode.error) == (Phase.ABANDONED, CANCELLED_REASON)
        assert episode.revision == 1 and episode.pending is None
        assert episode.state["counter"] == 1 and episode.turn == 1
        assert server.effects.applied_revision("cut") == 1
        snapshot = Episode.from_record(before)
        source, reason = choose_restore_source(snapshot, episode, 1, successor_exists=False)
        assert source is not None, reason
        assert (source["revision"], source["phase"]) == (1, Phase.AWAIT_MODEL.value)
        # On a replacement replica only the copy before the effect is left: refused.
        applied = new_log(reopen()).applied_revision("cut")
        source, reason = choose_restore_source(snapshot, None, applied, successor_exists=False)
        assert source is None, "continuing would apply revision 1 a second time"
        assert "up to revision 1, past the snapshot's 0" in reason
    finally:
        held.release.set()
        await runner.cleanup()


def handler_cancelled() -> bool:
    """Whether a request handler still running was asked to cancel (and has not yet)."""
    return any(task.cancelling() and not task.done() for task in asyncio.all_tasks())


async def until(condition: Any, failure: str) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(failure)


# --------------------------------------------------------------------------- entry point
def test_the_gym_entry_point_reloads_what_its_audit_uri_holds(
    fake_gcs: FakeGcs, tmp_path: Path
) -> None:
    uri = f"gs://{BUCKET}/cli-{uuid.uuid4().hex[:12]}/gym-audit"
    storage = open_storage(uri, client=fake_gcs.client())
    # Revision 1 in the older per-replica layout (another replica's), 2 in the run-wide one.
    storage.write_bytes_if_absent(legacy_effect_key("demo-gym-1", "r", 1), b"{}")
    storage.write_bytes_if_absent(effect_key("r", 2), b"{}")
    config = tmp_path / "run.yaml"
    config.write_text("task: {name: reach_target}\n")
    env = {
        **os.environ,
        **fake_gcs.env(),
        "PYTHONPATH": os.pathsep.join(["runtime", "operator"]),
    }
    base = [*ROLLOUTRUN, "gym", "--config", str(config)]
    command = [*base, "--port", "0", "--instance-id", INSTANCE, "--audit-uri", uri]
    log = tmp_path / "gym.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env
        )
    with reaped(process):
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        assert line.startswith("READY http://127.0.0.1:"), (line, log.read_text())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    assert f"loaded 2 applied side effects of 1 rollouts from {uri}/ " in log.read_text()


def test_the_gym_entry_point_refuses_to_start_without_its_side_effect_store(
    fake_gcs: FakeGcs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("task: {name: reach_target}\n")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.url)
    parser = argparse.ArgumentParser()
    gym_main.register(parser)
    base = ["--config", str(config), "--port", "0", "--instance-id", INSTANCE]
    args = parser.parse_args([*base, "--audit-uri", "gs://no-such-bucket-rr/gym-audit"])
    assert gym_main.run(args) == 1
    for bad_uri in ("s3://b/x", "file://somehost/x"):
        assert gym_main.run(parser.parse_args([*base, "--audit-uri", bad_uri])) == 1
    with pytest.raises(SystemExit) as both:
        parser.parse_args([*base, "--audit-uri", "gs://b/x", "--audit-file", "a.jsonl"])
    assert both.value.code == 2


# --------------------------------------------------------------------------- run-wide keys
async def test_an_effect_applied_on_one_replica_is_refused_on_another(
    storage: CheckpointStorage, reopen: Any, engine: GenerationEngine
) -> None:
    """Issue 10, finding 1: an episode relaunched from turn 0 under the same attempt on
    another replica (both replicas up, the second started before the first applied)."""
    gym0, gym1 = new_log(storage, "demo-gym-0"), new_log(reopen(), "demo-gym-1")
    done = await agent(engine, gym0).run(fresh_episode(agent(engine, gym0), "r"))
    assert done.revision == 3
    relaunched = fresh_episode(agent(engine, gym1), "r")
    with pytest.raises(SideEffectReplayError, match="revision 1 was already applied in this run"):
        await agent(engine, gym1).run(relaunched)
    assert relaunched.phase is Phase.FAILED and relaunched.state["counter"] == 0
    assert [r["instance_id"] for r in stored(storage, "r")] == ["demo-gym-0"] * 3
    # A replica started later sees every replica's effects from its startup listing.
    assert new_log(reopen(), "demo-gym-2").applied_revision("r") == 3


async def test_effects_of_the_older_per_replica_layout_are_refused_too(
    storage: CheckpointStorage, engine: GenerationEngine
) -> None:
    """A run started by an older version: its objects name the replica; any replica reads
    them at startup and refuses those revisions."""
    entry = {"rollout_id": "old", "revision": 1, "attempt": 0, "turn": 0}
    storage.write_bytes_if_absent(
        legacy_effect_key("demo-gym-0", "old", 1), json.dumps(entry).encode()
    )
    gym1 = new_log(storage, "demo-gym-1")
    assert gym1.applied_revision("old") == 1
    with pytest.raises(SideEffectReplayError, match="revision 1 was already applied"):
        await agent(engine, gym1).run(fresh_episode(agent(engine, gym1), "old"))


async def test_a_restore_is_refused_when_another_replica_applied_past_the_record(
    storage: CheckpointStorage, reopen: Any, engine: GenerationEngine
) -> None:
    """The record's owner was started before another replica applied the rollout's later
    revisions: the restore consults the whole run, and refuses with the reason."""
    writer = new_log(storage, "demo-gym-0")
    episode = fresh_episode(agent(engine, writer), "r4")
    loop = agent(engine, writer)
    await loop.step(episode)  # model
    await loop.step(episode)  # tool: revision 1
    snapshot = episode.to_record()
    owner = GymServer("demo-gym-1", CFG, effects=new_log(reopen(), "demo-gym-1"))
    await loop.run(episode)  # revisions 2 and 3, on demo-gym-0, after the owner started
    control = GymCheckpointControl(owner, "t0ken")
    owner.continue_restored = control.claim_restored
    runner, url = await serve(owner)
    try:
        async with aiohttp.ClientSession() as session:
            body = {"checkpoint_id": "ck1", "deadline_s": 30.0, "records": [snapshot]}
            headers = {"Authorization": "Bearer t0ken"}
            async with session.post(
                f"{url}{ROUTE_PREFIX}/restore", json=body, headers=headers
            ) as response:
                assert response.status == 200
                answer = await response.json()
        assert answer["restored"] == []
        (refusal,) = answer["refused"]
        assert refusal["episode"] == "r4"
        assert "applied side effects up to revision 3, past the snapshot's 1" in refusal["reason"]
    finally:
        await runner.cleanup()
