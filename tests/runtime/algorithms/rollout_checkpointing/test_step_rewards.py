"""The per-step rollout rewards (a step record's ``reward_mean``) survive a checkpoint.

Saved exactly (JSON floats round-trip), and a state saved before they existed reads as none.
"""

from __future__ import annotations

import json

from rolloutrun_runtime.algorithms.rollout_checkpointing.state import RolloutRuntimeState


def test_step_rewards_round_trip_exactly():
    state = RolloutRuntimeState(step_rewards={7: [0.1, 1 / 3, 0.0], 8: [2.5e-17]})
    loaded = RolloutRuntimeState.from_json(json.loads(json.dumps(state.to_json())))
    assert loaded.step_rewards == {7: [0.1, 1 / 3, 0.0], 8: [2.5e-17]}


def test_a_state_saved_without_step_rewards_reads_as_none():
    saved = RolloutRuntimeState(step_rewards={3: [1.0]}).to_json()
    del saved["step_rewards"]
    assert RolloutRuntimeState.from_json(saved).step_rewards == {}
