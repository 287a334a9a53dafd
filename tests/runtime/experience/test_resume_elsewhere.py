"""Elastic members, the ledger's rule: a lost Gym's dispatched turn-level attempt goes on
from its episode record on another replica (same rollout id, environment attempt + 1,
reserved, owned by no replica yet); any other attempt is left for a restart from turn 0
under a new rollout id."""

from __future__ import annotations

import pytest

from rolloutrun_runtime.experience.rollout_recovery import (
    AttemptStatus,
    Granularity,
    GroupStatus,
    PromptGroupRecord,
    PromptRef,
    RestoreLevel,
    RolloutAttempt,
)
from rolloutrun_runtime.experience.rollout_recovery.records import resume_attempt_elsewhere


def _case(
    level: RestoreLevel,
    status: AttemptStatus,
    granularity: Granularity = Granularity.SIBLING,
    group_status: GroupStatus = GroupStatus.GENERATING,
) -> tuple[bool, RolloutAttempt]:
    group = PromptGroupRecord(
        group_id="pg",
        admission_id="ad",
        prompt=PromptRef(prompt_id=0, epoch=0, index=0),
        target_step=1,
        start_weight_version=0,
        granularity=granularity,
        restore_level=level,
        status=group_status,
    )
    attempt = RolloutAttempt("u", "pg_g0_au", status, "gym-1", gym_attempt=2)
    return resume_attempt_elsewhere(group, attempt), attempt


def test_a_dispatched_turn_level_attempt_goes_on_under_the_next_environment_attempt():
    moved, attempt = _case(RestoreLevel.TURN, AttemptStatus.DISPATCHED)
    assert moved
    assert (attempt.rollout_id, attempt.status, attempt.gym_attempt, attempt.gym_instance_id) == (
        "pg_g0_au",
        AttemptStatus.RESERVED,
        3,
        None,
    )


@pytest.mark.parametrize(
    ("level", "status", "granularity", "group_status"),
    [
        (
            RestoreLevel.SIBLING,
            AttemptStatus.DISPATCHED,
            Granularity.SIBLING,
            GroupStatus.GENERATING,
        ),
        (RestoreLevel.TURN, AttemptStatus.RESERVED, Granularity.SIBLING, GroupStatus.GENERATING),
        (RestoreLevel.TURN, AttemptStatus.SEALED, Granularity.SIBLING, GroupStatus.GENERATING),
        (
            RestoreLevel.TURN,
            AttemptStatus.DISPATCHED,
            Granularity.PROMPT_GROUP,
            GroupStatus.GENERATING,
        ),
        (RestoreLevel.TURN, AttemptStatus.DISPATCHED, Granularity.SIBLING, GroupStatus.FINALIZED),
    ],
)
def test_any_other_attempt_is_left_unchanged(level, status, granularity, group_status):
    moved, attempt = _case(level, status, granularity, group_status)
    assert not moved
    assert (attempt.status, attempt.gym_attempt, attempt.gym_instance_id) == (status, 2, "gym-1")
