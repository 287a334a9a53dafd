"""The rig of the Gym checkpoint tests over real HTTP: a policy server, Gym replicas with
checkpoint control planes, and the trainer-side client.

A real generation engine serves a scripted policy (each turn answers ``+1``), a real Gym
server runs ``reach_target`` episodes with a tool delay, and
:class:`GymEnvironmentCheckpoint` calls each replica's control plane exactly as a snapshot
attempt does. The snapshot tests, the restore tests and the idle-copy test of
``tests/runtime/environments/checkpointing/`` share it (their ``rig`` fixture is that folder's
``conftest.py``), so it lives here: no test module imports another.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.environments.checkpointing.nemo_gym import GymEnvironmentCheckpoint
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.environments.gym.control import GymCheckpointControl
from rolloutrun_runtime.policy.generation import GenerationEngine, build_generation_app, serve_app
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


def deadline(seconds: float = 5.0) -> float:
    return time.time() + seconds


def _record(rollout_id: str, attempt: int = 0) -> dict[str, Any]:
    return {"episode_id": {"rollout_id": rollout_id, "attempt": attempt}}
