"""A Gym keeps at most ``MAX_FINISHED_EPISODES`` episodes: the oldest finished go first, and
live ones (a turn boundary, a tool round pending) are never dropped, however old."""

from __future__ import annotations

import pytest

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.environments.gym import GymServer, server
from rolloutrun_runtime.environments.gym.episode import Phase
from tests.support.scripted_gym import bare_episode

CFG = RunConfig.model_validate({"policy": {"device": "cpu"}, "seed": 3})


def test_the_oldest_finished_episodes_go_first_and_live_ones_stay(monkeypatch):
    monkeypatch.setattr(server, "MAX_FINISHED_EPISODES", 3)
    gym = GymServer("gym-0", CFG, None)
    gym.install(bare_episode("live-old", Phase.AWAIT_TOOL))
    for n in range(4):
        gym.install(bare_episode(f"done-{n}", Phase.FINISHED))
    gym.install(bare_episode("live-new", Phase.AWAIT_MODEL))
    gym.install(bare_episode("failed", Phase.FAILED))
    assert [key.rollout_id for key in gym.episodes] == ["live-old", "live-new", "failed"]


@pytest.mark.parametrize("held", [0, 3])
def test_nothing_goes_below_the_bound(monkeypatch, held):
    monkeypatch.setattr(server, "MAX_FINISHED_EPISODES", 3)
    gym = GymServer("gym-0", CFG, None)
    for n in range(held):
        gym.install(bare_episode(f"done-{n}", Phase.FINISHED))
    assert len(gym.episodes) == held
