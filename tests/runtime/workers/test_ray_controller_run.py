"""One Ray-backed run: the single controller trains through Ray generation workers."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import pytest

from rolloutrun_runtime.contract.run_config import RunConfig


@pytest.mark.ray
async def test_controller_run_with_ray_workers(ray_session: None, tmp_path: Path) -> None:
    from rolloutrun_runtime.environments.gym import GymServer
    from rolloutrun_runtime.policy.http import serve_app
    from rolloutrun_runtime.trainer import run_trainer

    cfg = RunConfig.model_validate(
        {
            "name": "ray-run",
            "seed": 3,
            "logDir": str(tmp_path / "run"),
            "policy": {"dModel": 32, "nLayers": 1, "nHeads": 2, "maxSeqLen": 32},
            "task": {"name": "arithmetic", "datasetSize": 64, "maxNewTokens": 4},
            "grpo": {"groupSize": 4, "promptsPerStep": 2, "maxSteps": 3, "maxStaleness": 1},
            "checkpointing": {"savePeriod": 3},
            "gym": {"replicas": 1},
            "workers": {"backend": "ray"},
        }
    )
    server = GymServer("gym-0", cfg, None)
    runner, url = await serve_app(server.app)
    try:
        cfg = cfg.model_copy(update={"gym": cfg.gym.model_copy(update={"endpoints": [url]})})
        result = await asyncio.wait_for(run_trainer(cfg), 240)
    finally:
        await runner.cleanup()
    assert result.steps == 3
    assert [r["step"] for r in result.history] == [1, 2, 3]
    assert all(r["max_token_age"] <= 1 for r in result.history)
    assert max(Counter(result.trained_prompt_ids).values(), default=1) == 1
    assert (tmp_path / "run" / "checkpoints" / "step_3" / "COMMITTED").exists()
