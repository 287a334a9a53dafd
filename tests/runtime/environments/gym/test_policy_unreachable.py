"""A Gym whose generation endpoint is gone answers ``policy_unreachable``, quickly.

A lost generation worker is infrastructure, not a sample: before this, the Gym answered its
generic 502 ``policy_error`` (the trainer counted a failed sample), and an endpoint that
stopped answering (a deleted pod's address: no RST) held the model call for the whole
``rollout.rolloutTimeoutSeconds``. Here a listening socket that accepts and never answers
stands for that address, and a closed generation server for a refused one; the Gym's
rollout timeout is far longer than the test's bound, so only the liveness probe can end it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.contract.wire import POLICY_UNREACHABLE
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.environments.gym.episode import POLICY_FAILED_PREFIX
from rolloutrun_runtime.environments.gym.restore import resumable_phase
from rolloutrun_runtime.policy.generation import GenerationEngine, build_generation_app, serve_app
from tests.support.data_plane import HEADERS, announce

CFG = RunConfig.model_validate(
    {"policy": {"device": "cpu"}, "seed": 3, "rollout": {"rolloutTimeoutSeconds": 600}}
)
#: Bound of one /run here: a Gym waiting for the rollout timeout (600 s) fails the test.
ANSWER_LIMIT_S = 60


@pytest.fixture
async def silent_endpoint() -> AsyncIterator[str]:
    """A generation address that accepts connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()  # until the client gives up

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    for writer in held:
        writer.close()
    server.close()


@pytest.fixture
async def gym() -> AsyncIterator[tuple[GymServer, str]]:
    server = GymServer("gym-0", CFG, None)
    runner, url = await serve_app(server.app)
    yield server, url
    await runner.cleanup()


async def _run(gym_url: str, policy_url: str, rollout_id: str) -> tuple[int, dict[str, Any]]:
    body = {
        "episode_id": {"rollout_id": rollout_id, "attempt": 0},
        "prompt_id": 1,
        "policy_url": policy_url,
        "sampling": {"temperature": 1.0, "max_new_tokens": 8, "seed": 5},
    }
    async with aiohttp.ClientSession(headers=HEADERS) as session:
        await announce(session, gym_url, policy_url)
        async with session.post(gym_url + "/run", json=body) as response:
            return response.status, await response.json()


async def test_a_silent_endpoint_is_policy_unreachable_long_before_the_rollout_timeout(
    gym: tuple[GymServer, str], silent_endpoint: str
) -> None:
    server, gym_url = gym
    status, answer = await asyncio.wait_for(_run(gym_url, silent_endpoint, "r1"), ANSWER_LIMIT_S)
    assert status == 502, answer
    assert answer["error"]["type"] == POLICY_UNREACHABLE, answer
    assert silent_endpoint in answer["error"]["message"]
    # The episode rests before the call that failed: a member resume can continue it.
    (episode,) = server.episodes.values()
    assert episode.error is not None and episode.error.startswith(POLICY_FAILED_PREFIX)
    assert resumable_phase(episode) is not None and episode.turn == 0


async def test_a_closed_generation_server_is_policy_unreachable(
    gym: tuple[GymServer, str], engine: GenerationEngine
) -> None:
    _, gym_url = gym
    runner, policy_url = await serve_app(build_generation_app(engine))
    status, answer = await _run(gym_url, policy_url, "r1")
    assert status == 200, answer  # alive: the episode runs
    await runner.cleanup()
    status, answer = await asyncio.wait_for(_run(gym_url, policy_url, "r2"), ANSWER_LIMIT_S)
    assert status == 502, answer
    assert answer["error"]["type"] == POLICY_UNREACHABLE, answer
