"""A turn-level run on two Gym replicas whose start the tests watch: its config, and the
wait for a start-up phase (``STARTUP``) marked by the run under test.

Why shared: the start's overlap with the Gyms (``test_trainer_start_overlap.py``) and a
stop during the start (``test_stop_during_start.py``) hold the trainer's start at the same
point, a Gym that does not answer yet, and watch the same marks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rolloutrun_runtime.metrics import STARTUP
from tests.support.run_configs import tiny_config


def two_gym_turn_config(tmp_path: Path, max_steps: int, unreachable_s: float) -> Any:
    """Turn level (the trainer needs every Gym's instance id), two Gym replicas."""
    return tiny_config(
        tmp_path,
        seed=5,
        task={"name": "reach_target", "datasetSize": 32, "maxTurns": 3, "maxNewTokens": 3},
        grpo={"maxSteps": max_steps},
        rollout={"gymUnreachableSeconds": unreachable_s},
        gym={"replicas": 2},
        checkpointing={"targetLevel": "turn", "snapshotIntervalSeconds": 0},
    )


async def marked_since(phase: str, since: float) -> None:
    """Until ``phase`` is marked after ``since`` (the clock is the process's: an earlier run
    in this process marked it too)."""
    while STARTUP.phases().get(phase, [0.0])[0] < since:
        await asyncio.sleep(0.02)
