"""A ``/run`` that carries a lost replica's episode record (elastic members), over real HTTP.

Two replicas of one run share its side-effect log (audit files of one directory). On the
first, an episode's record is copied at a turn boundary after its first side effect (as a
snapshot's copy is); then either that replica is lost there (its episode stops), and the
second continues the record under attempt 1 at its turn, each side effect once; or the
episode ran on and applied more effects, and the second refuses the stale record (409
``resume_refused``), applying nothing. A record of another rollout, or one whose attempt is
not older than the request's, is refused too.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from rolloutrun_runtime.algorithms.gym_client import GymClient, GymResumeRefusedError
from rolloutrun_runtime.contract.wire import RESUME_REFUSED
from rolloutrun_runtime.environments.gym import Episode, GymServer, LocalPolicyClient, Phase
from rolloutrun_runtime.environments.gym.agent import AFTER_TOOL
from rolloutrun_runtime.environments.gym.restore import member_resume_source
from rolloutrun_runtime.experience.rollout_recovery import EnvironmentEpisode
from rolloutrun_runtime.metrics import OverheadClock
from rolloutrun_runtime.policy.generation import GenerationEngine
from rolloutrun_runtime.policy.http import serve_app
from tests.support.data_plane import HEADERS, announce
from tests.support.scripted_gym import CFG, NOWHERE, THREE


class _Replica:
    """A Gym replica whose boundary hook copies a record after the first side effect and,
    when ``lose`` is set, holds the episode there (its pod is about to be lost)."""

    def __init__(self, engine: GenerationEngine, audit: Path, instance_id: str, lose: bool):
        self.record: dict[str, Any] | None = None
        self.copied = asyncio.Event()
        self.lose = lose
        self.server = GymServer(
            instance_id,
            CFG,
            audit,
            policy=LocalPolicyClient(engine.generate),
            hooks=[self._hook],
        )

    async def _hook(self, episode: Episode, where: str) -> None:
        if where == AFTER_TOOL and self.record is None and episode.revision == 1:
            self.record = episode.to_record()
            self.copied.set()
            if self.lose:
                await asyncio.Event().wait()  # never again: the replica is lost here


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers=HEADERS) as client:
        yield client


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    await announce(session, url, NOWHERE)
    async with session.post(url + "/run", json=body) as response:
        return response.status, await response.json()


def _body(attempt: int, record: dict[str, Any] | None = None, rollout: str = "r") -> dict:
    body: dict[str, Any] = {
        "episode_id": {"rollout_id": rollout, "attempt": attempt},
        "prompt_id": THREE,
        "policy_url": NOWHERE,
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": 7},
    }
    if record is not None:
        body["resume"] = record
    return body


def _lines(audit_dir: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(audit_dir.glob("*.audit.jsonl"))
        for line in path.read_text().splitlines()
    ]


async def _first_replica(
    session: aiohttp.ClientSession, engine: GenerationEngine, audit_dir: Path, *, lose: bool
) -> tuple[_Replica, Any, asyncio.Task[Any]]:
    first = _Replica(engine, audit_dir / "gym-0.audit.jsonl", "gym-0", lose)
    runner, url = await serve_app(first.server.app, cancel_on_disconnect=True)
    call = asyncio.ensure_future(_post(session, url, _body(0)))
    await asyncio.wait_for(first.copied.wait(), 60)
    return first, runner, call


async def test_the_record_goes_on_at_its_turn_on_another_replica(engine, session, tmp_path):
    first, runner, call = await _first_replica(session, engine, tmp_path, lose=True)
    call.cancel()  # the trainer's connection to the lost replica is gone
    await runner.cleanup()
    assert first.record is not None and first.record["turn"] == 1

    second = _Replica(engine, tmp_path / "gym-1.audit.jsonl", "gym-1", lose=False)
    runner, url = await serve_app(second.server.app)
    try:
        status, result = await _post(session, url, _body(1, first.record))
    finally:
        await runner.cleanup()
    assert status == 200, result
    assert result["episode_id"] == {"rollout_id": "r", "attempt": 1}
    assert (result["turns"], result["side_effects"], result["reward"]) == (3, 3, 1.0)
    effects = _lines(tmp_path)
    assert [(e["revision"], e["attempt"], e["turn"]) for e in effects] == [
        (1, 0, 0),  # on the lost replica
        (2, 1, 1),  # the continuation starts at the recorded turn, on the second
        (3, 1, 2),
    ]


async def test_a_record_the_episode_ran_past_is_refused(engine, session, tmp_path):
    first, runner, call = await _first_replica(session, engine, tmp_path, lose=False)
    status, result = await asyncio.wait_for(call, 60)  # it ran on past the copy, to the end
    await runner.cleanup()
    assert status == 200 and result["side_effects"] == 3
    assert first.record is not None

    second = _Replica(engine, tmp_path / "gym-1.audit.jsonl", "gym-1", lose=False)
    runner, url = await serve_app(second.server.app)
    try:
        status, refused = await _post(session, url, _body(1, first.record))
        assert status == 409 and refused["error"]["type"] == RESUME_REFUSED, refused
        assert "applied side effects up to revision 3" in refused["error"]["message"]
        # The trainer's client tells this refusal apart (it restarts the sibling from turn 0).
        client = GymClient(
            [url], timeout_s=60, max_seq_len=CFG.policy.max_seq_len, overhead=OverheadClock()
        )
        await client.open()
        try:
            with pytest.raises(GymResumeRefusedError):
                await client.run_episode(
                    client.pick(None),
                    EnvironmentEpisode("r", 2),
                    THREE,
                    NOWHERE,
                    {"temperature": 1.0, "max_new_tokens": 8, "seed": 7},
                    resume=first.record,
                )
        finally:
            await client.close()
        # Not a record of this rollout, or not of an older attempt: refused too.
        status, other = await _post(session, url, _body(1, first.record, rollout="other"))
        assert status == 400 and "another rollout" in other["error"]["message"]
    finally:
        await runner.cleanup()
    assert len(_lines(tmp_path)) == 3  # nothing applied again


def test_only_a_later_attempt_continues_a_record():
    record = Episode.from_record(
        {
            "version": 1,
            "episode_id": {"rollout_id": "r", "attempt": 2},
            "prompt_id": 0,
            "policy_url": NOWHERE,
            "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": 7},
            "state": {},
            "segments": [],
            "phase": Phase.AWAIT_MODEL.value,
            "turn": 1,
            "revision": 1,
            "audit": [],
            "pending": None,
            "reward": None,
            "finish_reason": None,
            "error": None,
            "started_at": 0.0,
        }
    )
    assert member_resume_source(record, 2, None, 1)[0] is None  # the same attempt number
    assert member_resume_source(record, 3, None, 1)[0] is not None
    assert member_resume_source(record, 3, None, 2)[0] is None  # an effect past the record


async def test_a_server_that_does_not_name_member_resume_never_gets_a_record():
    """A user's server that ignored ``resume`` would start the episode again under the same
    rollout id; the client refuses to send it one (the sibling restarts from turn 0)."""
    from aiohttp import web

    runs: list[Any] = []

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"instance_id": "gym-0", "capabilities": ["checkpoint_control"]})

    async def run(request: web.Request) -> web.Response:
        runs.append(await request.json())
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/healthz", health)
    app.router.add_post("/run", run)
    runner, url = await serve_app(app)
    client = GymClient([url], timeout_s=60, max_seq_len=32, overhead=OverheadClock())
    await client.open()
    try:
        assert not client.resumes()
        with pytest.raises(GymResumeRefusedError, match="does not take a resume record"):
            await client.run_episode(
                client.pick(None), EnvironmentEpisode("r", 1), 0, NOWHERE, {}, resume={"x": 1}
            )
    finally:
        await client.close()
        await runner.cleanup()
    assert runs == []
