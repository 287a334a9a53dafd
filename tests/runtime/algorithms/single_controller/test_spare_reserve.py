"""Deterministic mode's spare reserve, as pure functions: the slot-bound drop decision, which
leftovers a step may take (only those of steps certainly trained at its admission), the
reserve's bookkeeping, and its saved form (including a state saved before it existed)."""

from __future__ import annotations

import itertools

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    Leftover,
    RolloutRuntimeState,
    StepReserve,
    take_leftovers,
)
from rolloutrun_runtime.algorithms.samplers import InOrderSampler, newest_trained_at_admission
from rolloutrun_runtime.algorithms.single_controller import (
    DropAction,
    decide_slot_drop,
    shortfall_slots,
)
from rolloutrun_runtime.experience.rollout_recovery import PromptRef


def _decide(slot: int, *, failed: bool = False, reserve_left: bool = False) -> DropAction:
    return decide_slot_drop(
        failed=failed,
        slot=slot,
        reserve_left=reserve_left,
        prompts_per_step=4,
        min_step_batch_fraction=0.5,
    )


# --------------------------------------------------------------------------- slot decisions
def test_a_zero_variance_group_takes_its_slots_reserve_whatever_the_slot() -> None:
    assert [_decide(slot, reserve_left=True) for slot in range(4)] == [DropAction.REPLACE] * 4


def test_without_a_reserve_only_the_first_slots_may_close_short() -> None:
    # P = 4, minStepBatchFraction 0.5: slots 0 and 1 may be given up, 2 and 3 train anyway
    assert shortfall_slots(4, 0.5) == 2
    assert [_decide(slot) for slot in range(4)] == [
        DropAction.SHORTFALL,
        DropAction.SHORTFALL,
        DropAction.KEEP,
        DropAction.KEEP,
    ]


def test_a_failed_group_is_given_up_even_with_a_reserve_left() -> None:
    for slot, left in itertools.product(range(4), (False, True)):
        assert _decide(slot, failed=True, reserve_left=left) is DropAction.SHORTFALL


@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.75, 1.0])
@pytest.mark.parametrize("prompts", [1, 2, 3, 4, 7, 16])
def test_the_batch_fraction_holds_when_every_group_has_zero_variance(
    prompts: int, fraction: float
) -> None:
    kept = sum(
        decide_slot_drop(
            failed=False,
            slot=slot,
            reserve_left=False,
            prompts_per_step=prompts,
            min_step_batch_fraction=fraction,
        )
        is DropAction.KEEP
        for slot in range(prompts)
    )
    assert kept >= prompts * fraction - 1e-9
    assert prompts - kept == shortfall_slots(prompts, fraction)


def test_a_slot_outside_the_step_is_refused() -> None:
    with pytest.raises(ValueError, match="slot 4 is outside a step of 4 prompts"):
        _decide(4)


# --------------------------------------------------------------------------- eligibility
@pytest.mark.parametrize("staleness", [0, 1, 2, 5])
def test_newest_trained_at_admission_is_the_samplers_own_bound(staleness: int) -> None:
    """Every version at which the sampler admits step s has trained at least the bound,
    and the sampler does admit at exactly the bound: the bound is tight, not a guess."""
    for step in range(1, 12):
        bound = newest_trained_at_admission(step, staleness)
        admitting = [
            version
            for version in range(0, step)
            if InOrderSampler(1, staleness, 100, next_target_step=step).admissible(version)
        ]
        assert admitting and min(admitting) == bound


def _left(step: int, position: int, prompt_id: int) -> Leftover:
    return Leftover(step, position, PromptRef(prompt_id, 0, prompt_id))


def test_leftovers_are_taken_from_trained_steps_only_in_step_and_slot_order() -> None:
    pool = [_left(3, 0, 30), _left(1, 2, 12), _left(2, 0, 20), _left(1, 0, 10)]
    taken, kept = take_leftovers(pool, newest_trained=2, count=3)
    assert [(t.step, t.position) for t in taken] == [(1, 0), (1, 2), (2, 0)]
    assert kept == [_left(3, 0, 30)]
    taken, kept = take_leftovers(pool, newest_trained=1, count=5)
    assert [t.prompt.prompt_id for t in taken] == [10, 12]
    assert sorted(k.step for k in kept) == [2, 3]
    assert take_leftovers(pool, newest_trained=0, count=4) == ([], pool)


# --------------------------------------------------------------------------- bookkeeping
def _refs(*ids: int, epoch: int = 0) -> list[PromptRef]:
    return [PromptRef(i, epoch, i) for i in ids]


class _Loader:
    """Counts what the reserve draws (as the dataloader would hand it out)."""

    def __init__(self, start: int = 100) -> None:
        self.next_id = start
        self.drawn: list[int] = []

    def draw(self, count: int) -> list[PromptRef]:
        ids = list(range(self.next_id, self.next_id + count))
        self.next_id += count
        self.drawn += ids
        return _refs(*ids)


def test_a_step_reserve_binds_one_prompt_per_slot_and_hands_unused_ones_on() -> None:
    state = RolloutRuntimeState()
    loader = _Loader()
    record = state.reserve_step(1, _refs(1, 2, 3), 3, newest_trained=0, draw=loader.draw)
    assert loader.drawn == [100, 101, 102]
    assert record.place_of(2, 0) == (1, 0) and record.place_of(101, 0) == (1, 1)
    assert record.place_of(2, 1) is None  # the same prompt of another epoch is not this step's
    assert record.next_unused(1) == 1
    record.used[1] = True
    assert record.next_unused(1) is None and record.next_unused(2) == 2
    assert state.reserved_prompts() == _refs(100, 102)
    # step 2 is admitted before step 1 commits: nothing to take over, it draws its own
    state.reserve_step(2, _refs(4, 5, 6), 3, newest_trained=0, draw=loader.draw)
    assert state.commit_reserve(1) == [
        Leftover(1, 0, _refs(100)[0]),
        Leftover(1, 2, _refs(102)[0]),
    ]
    assert 1 not in state.step_reserves and state.commit_reserve(1) == []
    # step 3 (staleness 1) may take step 1's leftovers, then draws one more
    loader.drawn.clear()
    record = state.reserve_step(3, _refs(7, 8, 9), 3, newest_trained=1, draw=loader.draw)
    assert [p.prompt_id for p in record.reserve] == [100, 102, 106]
    assert loader.drawn == [106] and state.leftovers == []
    with pytest.raises(ValueError, match="step 3 already has a spare reserve"):
        state.reserve_step(3, _refs(7), 1, newest_trained=1, draw=loader.draw)


def test_a_spare_pool_left_by_an_older_runtime_feeds_the_next_reserve_first() -> None:
    state = RolloutRuntimeState(spare_prompts=_refs(50, 51))
    state.leftovers = [_left(1, 0, 60)]
    loader = _Loader()
    record = state.reserve_step(3, _refs(1, 2, 3, 4), 4, newest_trained=1, draw=loader.draw)
    assert [p.prompt_id for p in record.reserve] == [50, 51, 60, 100]
    assert state.spare_prompts == []


def test_a_reserve_that_does_not_fit_its_slots_is_refused() -> None:
    with pytest.raises(ValueError, match="3 prompts but 2 used flags"):
        StepReserve(tuple(_refs(1, 2, 3)), tuple(_refs(4, 5, 6)), [False, False])
    with pytest.raises(ValueError, match="does not split over 2 slots"):
        StepReserve(tuple(_refs(1, 2)), tuple(_refs(4, 5, 6)), [False] * 3)


def test_two_reserve_prompts_per_slot_are_used_in_order() -> None:
    record = StepReserve(tuple(_refs(1, 2)), tuple(_refs(10, 11, 20, 21)), [False] * 4)
    assert record.per_slot == 2
    assert record.place_of(21, 0) == (1, 2)
    record.used[2] = True
    assert record.next_unused(1) == 3 and record.next_unused(0) == 0


def test_without_drops_a_step_records_its_slots_and_draws_no_reserve() -> None:
    state = RolloutRuntimeState()
    loader = _Loader()
    record = state.reserve_step(1, _refs(1, 2), 0, newest_trained=0, draw=loader.draw)
    assert loader.drawn == [] and record.per_slot == 0
    assert record.next_unused(0) is None and record.place_of(2, 0) == (1, 0)
    assert state.commit_reserve(1) == [] and state.reserved_prompts() == []


# --------------------------------------------------------------------------- saved form
def test_reserves_and_leftovers_survive_a_round_trip() -> None:
    state = RolloutRuntimeState()
    loader = _Loader()
    state.reserve_step(1, _refs(1, 2), 2, newest_trained=0, draw=loader.draw)
    state.step_reserves[1].used[0] = True
    state.reserve_step(2, _refs(3, 4), 2, newest_trained=0, draw=loader.draw)
    state.commit_reserve(1)
    data = state.to_json()
    assert data["schema"] == 3
    again = RolloutRuntimeState.from_json(data)
    assert again.step_reserves == state.step_reserves and again.leftovers == state.leftovers
    assert again.reserved_prompts() == state.reserved_prompts() == _refs(102, 103, 101)
    assert RolloutRuntimeState.keeps_reserves(data)


#: ``runtime_state.json`` as the schema-2 runtime (commit c0f7141, before the reserves) wrote
#: it: a deterministic run resumed from it must go on.
SCHEMA_2_STATE = {
    "batch_shortfall": {"3": 1},
    "finalizer_results": [
        {
            "group_id": "pgold0000001",
            "model_tokens": 8,
            "rewards": [0.1, 0.6],
            "target_step": 3,
            "tokens_by_version": {"1": 8},
        }
    ],
    "journal": [
        {
            "dropped": [{"epoch": 0, "prompt_id": 2}],
            "groups": [{"epoch": 0, "group_id": "pgold0000000", "prompt_id": 5, "target_step": 1}],
            "row_groups": [],
            "step": 1,
            "weight_version_before": 0,
        }
    ],
    "pending_drops": [{"epoch": 0, "index": 7, "prompt_id": 11}],
    "replacements": {"3": 2},
    "replay_after": 1,
    "sampler_stamps_target_steps": True,
    "schema": 2,
    "spare_prompts": [
        {"epoch": 0, "index": 9, "prompt_id": 17},
        {"epoch": 0, "index": 10, "prompt_id": 4},
    ],
}


def test_a_schema_2_state_reads_and_its_spare_pool_feeds_the_first_reserve() -> None:
    state = RolloutRuntimeState.from_json(SCHEMA_2_STATE)
    assert not RolloutRuntimeState.keeps_reserves(SCHEMA_2_STATE)
    assert state.step_reserves == {} and state.leftovers == []
    assert state.replacements == {3: 2} and state.pending_drops == [PromptRef(11, 0, 7)]
    loader = _Loader()
    record = state.reserve_step(4, _refs(1, 2, 3), 3, newest_trained=2, draw=loader.draw)
    assert record.reserve == (PromptRef(17, 0, 9), PromptRef(4, 0, 10), PromptRef(100, 0, 100))
    assert state.spare_prompts == [] and loader.drawn == [100]
    assert RolloutRuntimeState.from_json(state.to_json()).step_reserves == state.step_reserves


def test_a_state_saved_before_reserves_existed_reads_with_none() -> None:
    old = RolloutRuntimeState(spare_prompts=_refs(7)).to_json()
    del old["step_reserves"], old["leftovers"]
    old["schema"] = 2
    state = RolloutRuntimeState.from_json(old)
    assert not RolloutRuntimeState.keeps_reserves(old)
    assert state.step_reserves == {} and state.leftovers == []
    assert state.spare_prompts == _refs(7) and state.place_of(1, 7, 0) is None


def test_a_saved_reserve_with_a_missing_used_flag_is_refused() -> None:
    state = RolloutRuntimeState()
    state.reserve_step(1, _refs(1, 2), 2, newest_trained=0, draw=_Loader().draw)
    data = state.to_json()
    data["step_reserves"]["1"]["used"].pop()
    with pytest.raises(ValueError, match="2 prompts but 1 used flags"):
        RolloutRuntimeState.from_json(data)
