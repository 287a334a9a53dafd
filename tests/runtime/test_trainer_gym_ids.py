"""The trainer keys turn-level checkpoints by the ids the Gym replicas report, not by order."""

from __future__ import annotations

import pytest
from aiohttp import web

from rolloutrun_runtime.contract.run_config import parse_run_config
from rolloutrun_runtime.environments.gym import GymServer
from rolloutrun_runtime.policy.http import serve_app
from rolloutrun_runtime.trainer_inputs import gym_instance_ids as _gym_instance_ids

CFG = parse_run_config({"task": {"name": "reach_target"}, "checkpointing": {"targetLevel": "turn"}})


async def _serve(instance_id: str) -> tuple[web.AppRunner, str]:
    runner, url = await serve_app(GymServer(instance_id, CFG).app)
    return runner, url


async def test_pod_named_replicas_map_to_their_own_urls() -> None:
    started = [await _serve(name) for name in ("demo-gym-1", "demo-gym-0")]
    try:
        urls = [url for _, url in started]
        assert await _gym_instance_ids(urls) == {"demo-gym-1": urls[0], "demo-gym-0": urls[1]}
    finally:
        for runner, _ in started:
            await runner.cleanup()


async def test_two_replicas_claiming_one_id_are_refused() -> None:
    started = [await _serve("demo-gym-0") for _ in range(2)]
    try:
        with pytest.raises(RuntimeError, match="both call themselves 'demo-gym-0'"):
            await _gym_instance_ids([url for _, url in started])
    finally:
        for runner, _ in started:
            await runner.cleanup()


async def test_an_unreachable_replica_is_named() -> None:
    with pytest.raises(RuntimeError, match=r"http://127\.0\.0\.1:9 did not answer /healthz"):
        await _gym_instance_ids(["http://127.0.0.1:9"])
