"""Run the real controller against real in-process Gym servers and policy workers."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.contract.run_config import RunConfig

RunTrainer = Callable[..., Awaitable[Any]]


def tiny_config(tmp_path: Path, **sections: dict[str, Any]) -> RunConfig:
    """A small arithmetic run (in-process workers) with per-section overrides."""
    data: dict[str, Any] = {
        "name": "test",
        "seed": 5,
        "logDir": str(tmp_path / "run"),
        "policy": {"dModel": 32, "nLayers": 1, "nHeads": 2, "maxSeqLen": 32},
        "task": {"name": "arithmetic", "datasetSize": 96, "maxNewTokens": 4},
        "grpo": {"groupSize": 4, "promptsPerStep": 3, "maxSteps": 4, "maxStaleness": 1},
        "rollout": {"maxInFlightGroups": 8, "replayCapacity": 16},
        "checkpointing": {"savePeriod": 100, "targetLevel": "sibling"},
        "gym": {"replicas": 2},
        "workers": {"backend": "inprocess"},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            data[section] = {**data.get(section, {}), **values}
        else:
            data[section] = values
    return RunConfig.model_validate(data)


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
