"""An episode's record copies its task state: nothing the episode changes later reaches a
copy a checkpoint holds (``copy_state``, the cheap JSON-shaped copy ``to_record`` uses)."""

from __future__ import annotations

import json
from fractions import Fraction

from rolloutrun_runtime.environments.gym.episode import (
    Episode,
    EpisodeId,
    Sampling,
    copy_state,
)


def test_a_copy_shares_nothing_mutable_and_equals_the_state() -> None:
    state = {"counter": 3, "moves": [1, [2, 3]], "seen": {"a": [True, None, 1.5]}, "t": (1, [2])}
    copied = copy_state(state)
    assert copied == state and json.dumps(copied) == json.dumps(state)
    state["moves"][1].append(4)
    state["seen"]["a"].clear()
    state["t"][1].append(9)
    state["counter"] = 4
    assert copied == {
        "counter": 3,
        "moves": [1, [2, 3]],
        "seen": {"a": [True, None, 1.5]},
        "t": (1, [2]),
    }


def test_a_value_that_is_not_json_shaped_is_still_deep_copied() -> None:
    inner = [Fraction(1, 3)]
    odd = {"s": {1, 2}, "f": inner}
    copied = copy_state(odd)
    odd["s"].add(3)
    inner.append(Fraction(1, 2))
    assert copied == {"s": {1, 2}, "f": [Fraction(1, 3)]}


def test_a_record_keeps_the_state_of_its_boundary() -> None:
    episode = Episode(
        episode_id=EpisodeId("r1", 0),
        prompt_id=1,
        policy_url="http://127.0.0.1:1",
        sampling=Sampling(temperature=1.0, max_new_tokens=3),
        state={"counter": 0, "moves": []},
        segments=[],
    )
    record = episode.to_record()
    episode.state["moves"].append(5)
    episode.state["counter"] = 1
    assert record["state"] == {"counter": 0, "moves": []}
    assert Episode.from_record(record).state == {"counter": 0, "moves": []}
