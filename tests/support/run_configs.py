"""A tiny run config for the tests that run the real controller or trainer end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rolloutrun_runtime.contract.run_config import RunConfig


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
