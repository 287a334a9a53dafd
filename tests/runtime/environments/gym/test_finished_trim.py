"""A Gym keeps at most ``MAX_FINISHED_EPISODES`` episodes: the oldest finished go first, and
live ones (a turn boundary, a tool round pending) are never dropped, however old."""

from __future__ import annotations

import pytest

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.environments.gym import GymServer, server
from rolloutrun_runtime.environments.gym.episode import Episode, EpisodeId, Phase, Sampling

CFG = RunConfig.model_validate({"policy": {"device": "cpu"}, "seed": 3})


def _episode(name: str, phase: Phase) -> Episode:
    return Episode(
        episode_id=EpisodeId(name),
        prompt_id=0,
        policy_url="http://127.0.0.1:1",
        sampling=Sampling(temperature=1.0, max_new_tokens=4),
        state={},
        segments=[],
        phase=phase,
    )


def test_the_oldest_finished_episodes_go_first_and_live_ones_stay(monkeypatch):
    monkeypatch.setattr(server, "MAX_FINISHED_EPISODES", 3)
    gym = GymServer("gym-0", CFG, None)
    gym.install(_episode("live-old", Phase.AWAIT_TOOL))
    for n in range(4):
        gym.install(_episode(f"done-{n}", Phase.FINISHED))
    gym.install(_episode("live-new", Phase.AWAIT_MODEL))
    gym.install(_episode("failed", Phase.FAILED))
    assert [key.rollout_id for key in gym.episodes] == ["live-old", "live-new", "failed"]


@pytest.mark.parametrize("held", [0, 3])
def test_nothing_goes_below_the_bound(monkeypatch, held):
    monkeypatch.setattr(server, "MAX_FINISHED_EPISODES", 3)
    gym = GymServer("gym-0", CFG, None)
    for n in range(held):
        gym.install(_episode(f"done-{n}", Phase.FINISHED))
    assert len(gym.episodes) == held
