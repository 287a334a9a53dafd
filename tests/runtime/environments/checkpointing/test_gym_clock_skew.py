"""Checkpoint deadlines under clock skew between the trainer and a Gym replica, over real HTTP.

The trainer names a deadline on its own wall clock; the Gym used to compare that absolute
time with its own clock, so a Gym 60 s ahead saw every deadline already past (every
turn-level snapshot failed) and one 60 s behind held a vanished trainer's lease a minute too
long. Calls now carry seconds from receipt. Here a real Gym server, whose control plane runs
on a clock 60 s off the trainer's, is driven by the real trainer-side client.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import BaseModel

from rolloutrun_runtime.contract import wire
from rolloutrun_runtime.contract.run_config import parse_run_config
from rolloutrun_runtime.contract.wire import control_route
from rolloutrun_runtime.environments.checkpointing import EnvironmentEpisode
from rolloutrun_runtime.environments.checkpointing.nemo_gym import (
    GymEnvironmentCheckpoint,
    as_duration,
)
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.environments.gym.control import ControlPhase, GymCheckpointControl
from rolloutrun_runtime.policy.generation import GenerationEngine, build_generation_app, serve_app
from rolloutrun_runtime.policy.scripted import PLUS_ONE_SCRIPT, scripted_state_dict
from rolloutrun_runtime.policy.tokenizer import TOKENIZER
from rolloutrun_runtime.tasks import ReachTargetProblem, make_problem
from tests.support.data_plane import HEADERS, announce
from tests.support.run_configs import TURN_LEVEL_GYM

TOKEN = "sk3w"
CFG = TURN_LEVEL_GYM
#: Prompts whose episodes take at least six turns: still running when the snapshot starts.
LONG = [
    p
    for p in range(CFG.task.dataset_size)
    if isinstance(problem := make_problem(CFG.task, CFG.seed, p), ReachTargetProblem)
    and problem.target - problem.start >= 6
][:2]


class SkewedClock:
    """The Gym's wall clock: the trainer's (``time.time``) plus ``skew`` plus ``passed``."""

    def __init__(self, skew: float) -> None:
        self.skew = skew
        self.passed = 0.0

    def __call__(self) -> float:
        return time.time() + self.skew + self.passed


class Rig:
    def __init__(self, tmp: Path, clock: SkewedClock) -> None:
        self.tmp, self.clock = tmp, clock
        self.runners: list[Any] = []
        self.session = aiohttp.ClientSession()
        self.policy_url = self.gym_url = ""
        self.server: GymServer | None = None
        self.control: GymCheckpointControl | None = None

    async def start(self) -> None:
        state = scripted_state_dict(CFG.policy, PLUS_ONE_SCRIPT)
        engine = GenerationEngine(CFG.policy, TOKENIZER.vocab_size, TOKENIZER.eos_id, state, 0)
        runner, self.policy_url = await serve_app(build_generation_app(engine))
        self.runners.append(runner)
        self.server = GymServer("gym-0", CFG, self.tmp / "gym-0.audit.jsonl")
        self.control = GymCheckpointControl(
            self.server, TOKEN, grace_s=1.0, clock=self.clock, watchdog_interval_s=0.05
        )
        self.server.continue_restored = self.control.claim_restored
        runner, self.gym_url = await serve_app(self.server.app, cancel_on_disconnect=True)
        self.runners.append(runner)
        await announce(self.session, self.gym_url, self.policy_url)  # as the trainer does

    def client(self) -> GymEnvironmentCheckpoint:
        return GymEnvironmentCheckpoint({"gym-0": self.gym_url}, TOKEN, session=self.session)

    def run(self, rollout_id: str, prompt_id: int) -> asyncio.Task[tuple[int, Any]]:
        body = {
            "episode_id": {"rollout_id": rollout_id, "attempt": 0},
            "prompt_id": prompt_id,
            "policy_url": self.policy_url,
        }

        async def call() -> tuple[int, Any]:
            async with self.session.post(self.gym_url + "/run", json=body, headers=HEADERS) as r:
                return r.status, await r.json()

        return asyncio.create_task(call())

    async def wait_live(self, count: int) -> None:
        assert self.server is not None
        for _ in range(400):
            if len(self.server.live_episodes()) >= count:
                return
            await asyncio.sleep(0.005)
        raise AssertionError(f"{count} live episodes never appeared")

    async def call(self, route: str, raw: str | None = None) -> tuple[int, Any]:
        """Control route ``route`` with the body ``raw`` as sent (a GET without one)."""
        headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        url = self.gym_url + control_route(route)
        method = "GET" if raw is None else "POST"
        async with self.session.request(method, url, data=raw, headers=headers) as response:
            return response.status, await response.json()

    async def close(self) -> None:
        await self.session.close()
        for runner in self.runners:
            await runner.cleanup()


@pytest.fixture(params=[60.0, -60.0], ids=["gym-60s-ahead", "gym-60s-behind"])
async def rig(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Rig]:
    rig = Rig(tmp_path, SkewedClock(request.param))
    await rig.start()
    yield rig
    await rig.close()


async def test_a_skewed_gym_completes_the_turn_level_snapshot(rig: Rig) -> None:
    client = rig.client()
    runs = [rig.run(f"r{i}", prompt_id=prompt) for i, prompt in enumerate(LONG)]
    await rig.wait_live(len(LONG))
    assert await client.prepare("ck1", time.time() + 5.0) == {}
    assert rig.control is not None and rig.control.phase is ControlPhase.PREPARED
    wanted = [EnvironmentEpisode(f"r{i}", 0, "gym-0") for i in range(len(LONG))]
    snapshot = await client.commit("ck1", time.time() + 5.0, wanted)
    assert snapshot.episodes() == sorted(wanted) and not snapshot.unavailable
    await client.resume("ck1")
    assert [status for status, _ in [await run for run in runs]] == [200] * len(LONG)


async def test_a_vanished_trainers_lease_runs_out_on_the_gyms_own_clock(rig: Rig) -> None:
    client = rig.client()
    run = rig.run("r0", prompt_id=LONG[0])
    await rig.wait_live(1)
    assert await client.prepare("ck1", time.time() + 2.0) == {}
    control = rig.control
    assert control is not None and control.phase is ControlPhase.PREPARED
    status, answer = await rig.call("status")
    assert status == 200 and 0.0 < answer["lease_remaining_s"] <= 3.0  # deadline + grace
    rig.clock.passed = 10.0  # the trainer vanished: the Gym's 2 s + 1 s of grace pass
    for _ in range(200):
        if control.phase is ControlPhase.IDLE:
            break
        await asyncio.sleep(0.01)
    assert control.phase is ControlPhase.IDLE and "ck1" in control.resumed
    assert (await run)[0] == 200


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN"])
async def test_a_non_finite_deadline_is_refused_naming_the_field(rig: Rig, value: str) -> None:
    status, answer = await rig.call("prepare", f'{{"checkpoint_id": "ck1", "deadline_s": {value}}}')
    assert status == 400
    message = answer["error"]["message"]
    assert "deadline_s" in message and "finite number" in message
    assert rig.control is not None and rig.control.phase is ControlPhase.IDLE


def test_the_client_sends_what_is_left_of_its_deadline_not_its_clock() -> None:
    body = {"checkpoint_id": "ck1", "deadline_ts": 1_000_030.5, "episodes": []}
    assert as_duration(body, now=1_000_000.0) == {
        "checkpoint_id": "ck1",
        "episodes": [],
        "deadline_s": 30.5,
    }
    assert as_duration(body, now=2_000_000.0)["deadline_s"] == 0.0  # already past: none left


def test_no_wire_model_takes_a_non_finite_number() -> None:
    models = [
        value
        for value in vars(wire).values()
        if isinstance(value, type) and issubclass(value, BaseModel) and value is not BaseModel
    ]
    assert len(models) > 20
    assert [m.__name__ for m in models if m.model_config.get("allow_inf_nan") is not False] == []
    for model in (wire.CheckpointCall, wire.EndCall):
        with pytest.raises(ValueError, match="finite number"):
            model.model_validate({"checkpoint_id": "ck1", "deadline_s": math.inf})


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_run_config_float_refuses_a_non_finite_value(value: float) -> None:
    with pytest.raises(ValueError, match=r"grpo\.learningRate: Input should be a finite number"):
        parse_run_config({"grpo": {"learningRate": value}})
