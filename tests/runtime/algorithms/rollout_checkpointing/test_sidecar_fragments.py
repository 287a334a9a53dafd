"""A snapshot writer encodes each replay group's and finalizer result's JSON once: the next
snapshot encodes only the new ones, and the files are byte for byte the whole encoding."""

from __future__ import annotations

import json

from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.algorithms.rollout_checkpointing.sidecars import (
    JsonFragments,
    SidecarFragments,
    _dumps_with,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    CapturedRolloutState,
    CaptureKind,
    FinalizerResult,
    JournalGroup,
    RolloutRuntimeState,
    TrainedStep,
    journal_entries_json,
    training_journal_json,
)
from rolloutrun_runtime.data_plane import DataPlane
from rolloutrun_runtime.experience.rollout_recovery import PromptRef


def _group(i: int) -> ReplayGroup:
    return ReplayGroup(f"g{i}", i, i % 3 or None, (f"r{i}a", f"r{i}b"), (0.5, -1.0), 10 + i)


def _whole(document: dict, key: str, items: list) -> bytes:
    return json.dumps({**document, key: [x.to_json() for x in items]}, sort_keys=True).encode()


def test_the_next_snapshot_encodes_only_new_groups_byte_for_byte() -> None:
    fragments = JsonFragments()
    document = {"schema": 1, "trainer_version": 3, "z": {"b": 1, "a": [1, 2]}}
    groups = [_group(i) for i in range(50)]
    first = _dumps_with(document, {"replay": fragments.array(groups)})
    assert first == _whole(document, "replay", groups)
    assert fragments.encoded_last == 50
    groups = groups[10:] + [_group(i) for i in range(50, 53)]  # trained away, added
    second = _dumps_with(document, {"replay": fragments.array(groups)})
    assert second == _whole(document, "replay", groups)
    assert fragments.encoded_last == 3
    assert _dumps_with(document, {"replay": fragments.array([])}) == _whole(document, "replay", [])


def test_an_equal_but_new_object_is_encoded_again() -> None:
    fragments = JsonFragments()
    result = FinalizerResult("g1", 2, [1.0], 7, {1: 3, 0: 4})
    fragments.array([result])
    again = FinalizerResult("g1", 2, [0.0], 7, {1: 3})  # the same group, another result
    text = fragments.array([again])
    assert fragments.encoded_last == 1
    assert json.loads(text) == [again.to_json()]


def _step(step: int) -> TrainedStep:
    groups = tuple(JournalGroup(f"g{step}-{i}", step * 4 + i, 0, step) for i in range(4))
    rows = tuple(_group(step * 4 + i) for i in range(4))
    return TrainedStep(step, groups, rows, (PromptRef(step, 0),))


def _captured(state: RolloutRuntimeState) -> CapturedRolloutState:
    return CapturedRolloutState(
        kind=CaptureKind.ROLLOUT_SNAPSHOT,
        train_step=len(state.journal),
        mutation_version=0,
        cut_time=0.0,
        controller_state={},
        data_plane=DataPlane(),
        data_plane_metadata={},
        runtime_state_rest=state.to_json(results=False, journal=False),
        journal_entries=tuple(state.journal),
        pending_drops=tuple(state.pending_drops),
    )


def test_the_next_snapshot_encodes_only_the_journal_entries_new_since() -> None:
    """The journal holds every step since step 1: a snapshot encodes the entries new (or
    stripped of their rows) since the last one, and both files are byte for byte."""
    fragments = SidecarFragments()
    state = RolloutRuntimeState(journal=[_step(s) for s in range(1, 31)])
    for pending in ([], [PromptRef(99, 1)]):
        state.pending_drops = pending
        captured = _captured(state)
        text = fragments.journal.array(captured.journal_entries)
        assert json.loads(text) == journal_entries_json(state.journal)
        whole = training_journal_json(state.journal, state.pending_drops)
        assert fragments.training_journal(captured) == json.dumps(whole, sort_keys=True).encode()
    assert fragments.journal.encoded_last == 0  # the second pass: all known
    state.journal.append(_step(31))
    state.advance_replay_anchor(10)  # steps 1-10 lose their rows: new entries
    state.pending_drops = []
    captured = _captured(state)
    fragments.journal.array(captured.journal_entries)
    assert fragments.journal.encoded_last == 11
    state.advance_replay_anchor(12)  # entries already without rows stay the same objects
    fragments.journal.array(tuple(state.journal))
    assert fragments.journal.encoded_last == 2
    whole = training_journal_json(state.journal, [])
    written = fragments.training_journal(_captured(state))
    assert written == json.dumps(whole, sort_keys=True).encode()
    drops = [PromptRef(1, 0)]
    empty = _captured(RolloutRuntimeState(pending_drops=drops))
    assert json.loads(fragments.training_journal(empty)) == training_journal_json([], drops)
