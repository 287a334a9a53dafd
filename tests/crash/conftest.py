"""Tiny run configs for the crash tests: seconds per run, several epochs, every step journaled.

Zero-variance drops are on (the default): deterministic mode binds replacements to step
slots, so a killed and resumed run still ends bit-identical, and the audit accounts for
dropped prompts (journal), spare reserves and leftovers (runtime state). Snapshots are taken
every second so named snapshot sites are reached within a short run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

SINGLE_TURN = {
    "seed": 3,
    "policy": {"dModel": 32, "nLayers": 1, "nHeads": 2, "maxSeqLen": 32},
    "task": {"name": "arithmetic", "datasetSize": 24, "maxOperand": 9, "maxNewTokens": 4},
    "grpo": {
        "groupSize": 4,
        "promptsPerStep": 4,
        "maxSteps": 8,
        "learningRate": 0.003,
        "maxStaleness": 1,
    },
    "rollout": {"maxInFlightGroups": 8},
    "checkpointing": {
        "savePeriod": 2,
        "snapshotIntervalSeconds": 1,
        "targetLevel": "sibling",
        "deterministic": True,
    },
    "gym": {"replicas": 1},
    "workers": {"backend": "inprocess"},
}

MULTI_TURN = {
    **SINGLE_TURN,
    "seed": 4,
    "policy": {"dModel": 32, "nLayers": 1, "nHeads": 2, "maxSeqLen": 64},
    "task": {
        "name": "reach_target",
        "datasetSize": 24,
        "maxOperand": 9,
        "maxTurns": 4,
        "maxNewTokens": 3,
        "turnDelayMs": 20,
    },
    "checkpointing": {**SINGLE_TURN["checkpointing"], "targetLevel": "turn"},
}

#: Asynchronous turn level over two Gym replicas (an episode may land on either after a
#: restart): what users run; weights are not compared (asynchronous mode is not replayable),
#: the audit is.
ASYNC_MULTI_TURN = {
    **MULTI_TURN,
    "seed": 6,
    "grpo": {**MULTI_TURN["grpo"], "maxSteps": 6},
    "checkpointing": {**MULTI_TURN["checkpointing"], "deterministic": False},
    "gym": {"replicas": 2},
}

#: Per incarnation; a healthy tiny run takes well under a minute.
INCARNATION_TIMEOUT_S = 150.0


def write_config(path: Path, base: dict, **overrides: dict) -> Path:
    data = {key: (dict(value) if isinstance(value, dict) else value) for key, value in base.items()}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value}
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def single_turn(tmp_path: Path) -> Path:
    return write_config(tmp_path / "single-turn.yaml", SINGLE_TURN)


@pytest.fixture
def multi_turn(tmp_path: Path) -> Path:
    return write_config(tmp_path / "multi-turn.yaml", MULTI_TURN)


@pytest.fixture
def async_multi_turn(tmp_path: Path) -> Path:
    return write_config(tmp_path / "async-multi-turn.yaml", ASYNC_MULTI_TURN)
