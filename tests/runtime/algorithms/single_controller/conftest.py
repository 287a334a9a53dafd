"""Run the real controller against real in-process Gym servers and policy workers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from rolloutrun_runtime.contract.run_config import RunConfig

RunTrainer = Callable[..., Awaitable[Any]]


@pytest.fixture
async def gym_endpoints() -> Any:
    """Start Gym replicas for a config on this event loop; returns a starter function."""
    from rolloutrun_runtime.environments.gym import GymServer
    from rolloutrun_runtime.policy.http import serve_app

    runners = []

    async def start(cfg: RunConfig, configs: list[RunConfig] | None = None) -> RunConfig:
        urls = []
        for index in range(cfg.gym.replicas):
            server_cfg = configs[index] if configs else cfg
            server = GymServer(f"gym-{index}", server_cfg, None)
            runner, url = await serve_app(server.app)
            runners.append(runner)
            urls.append(url)
        return cfg.model_copy(update={"gym": cfg.gym.model_copy(update={"endpoints": urls})})

    yield start
    for runner in runners:
        await runner.cleanup()
