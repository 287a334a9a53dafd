"""A snapshot writer encodes each replay group's and finalizer result's JSON once: the next
snapshot encodes only the new ones, and the files are byte for byte the whole encoding."""

from __future__ import annotations

import json

from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.algorithms.rollout_checkpointing.sidecars import (
    JsonFragments,
    _dumps_with,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import FinalizerResult


def _group(i: int) -> ReplayGroup:
    return ReplayGroup(f"g{i}", i, i % 3 or None, (f"r{i}a", f"r{i}b"), (0.5, -1.0), 10 + i)


def _whole(document: dict, key: str, items: list) -> bytes:
    return json.dumps({**document, key: [x.to_json() for x in items]}, sort_keys=True).encode()


def test_the_next_snapshot_encodes_only_new_groups_byte_for_byte() -> None:
    fragments = JsonFragments()
    document = {"schema": 1, "trainer_version": 3, "z": {"b": 1, "a": [1, 2]}}
    groups = [_group(i) for i in range(50)]
    first = _dumps_with(document, "replay", fragments.array(groups))
    assert first == _whole(document, "replay", groups)
    assert fragments.encoded_last == 50
    groups = groups[10:] + [_group(i) for i in range(50, 53)]  # trained away, added
    second = _dumps_with(document, "replay", fragments.array(groups))
    assert second == _whole(document, "replay", groups)
    assert fragments.encoded_last == 3
    assert _dumps_with(document, "replay", fragments.array([])) == _whole(document, "replay", [])


def test_an_equal_but_new_object_is_encoded_again() -> None:
    fragments = JsonFragments()
    result = FinalizerResult("g1", 2, [1.0], 7, {1: 3, 0: 4})
    fragments.array([result])
    again = FinalizerResult("g1", 2, [0.0], 7, {1: 3})  # the same group, another result
    text = fragments.array([again])
    assert fragments.encoded_last == 1
    assert json.loads(text) == [again.to_json()]
