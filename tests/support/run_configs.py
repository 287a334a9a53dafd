"""Small run configs: the tests that run the real controller or trainer end to end, and the
turn-level Gym the environment-checkpoint tests drive directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rolloutrun_runtime.contract.run_config import RunConfig, parse_run_config


def tiny_config(tmp_path: Path, **sections: Any) -> RunConfig:
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


#: A turn-level reach-target Gym (12 turns, 40 ms a turn): long enough episodes to park.
TURN_LEVEL_GYM = parse_run_config(
    {
        "policy": {"device": "cpu"},
        "seed": 5,
        "task": {
            "name": "reach_target",
            "maxOperand": 9,
            "maxTurns": 12,
            "turnDelayMs": 40,
            "datasetSize": 64,
        },
        "checkpointing": {"targetLevel": "turn"},
    }
)
