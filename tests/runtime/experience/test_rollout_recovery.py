"""Every ledger transition, the illegal ones (they raise and change nothing), the sidecar
(schema 5, schema 4, corrupt and unknown input) and restart normalization."""

from __future__ import annotations

import json

import pytest

from rolloutrun_runtime.data_plane import BarrierError, MutationCut
from rolloutrun_runtime.experience.rollout_recovery import (
    AttemptStatus,
    EnvironmentEpisode,
    Granularity,
    GroupStatus,
    LedgerRestartError,
    LedgerSidecarError,
    LedgerTransitionError,
    PromptRef,
    RecoveryLedger,
    RestoreLevel,
    read_recovery_sidecar,
)


def _cut() -> MutationCut:
    return MutationCut("test")


def _ledger(
    size: int = 2,
    granularity: Granularity = Granularity.SIBLING,
    level: RestoreLevel = RestoreLevel.SIBLING,
    group_id: str = "grp",
) -> RecoveryLedger:
    ledger = RecoveryLedger()
    ledger.reserve_group(
        _cut(),
        group_id=group_id,
        admission_id="adm1",
        prompt=PromptRef(prompt_id=7, epoch=0, index=3),
        target_step=1,
        start_weight_version=0,
        group_size=size,
        granularity=granularity,
        restore_level=level,
    )
    ledger.admit(_cut(), group_id)
    return ledger


def _digest(ledger: RecoveryLedger) -> str:
    return ledger.to_sidecar(
        spare_prompts=[], batch_shortfall={}, sampler_stamps_target_steps=True
    ).sha256


def _run(ledger: RecoveryLedger, sibling_id: str, reward: float = 1.0, instance: str = "gym-0"):
    attempt = ledger.sibling(sibling_id).current
    ledger.dispatch(_cut(), sibling_id, attempt.attempt_uuid, instance)
    return ledger.seal(
        _cut(), sibling_id, attempt.attempt_uuid, reward=reward, row_key=attempt.episode.capture_key
    )


def test_happy_path_through_every_status() -> None:
    ledger = _ledger()
    group = ledger.group("grp")
    assert [s.sibling_id for s in group.siblings] == ["grp_g0", "grp_g1"]
    first = group.siblings[0].current
    assert first.rollout_id == f"grp_g0_a{first.attempt_uuid}"
    _run(ledger, "grp_g0")
    assert group.status is GroupStatus.GENERATING
    _run(ledger, "grp_g1", reward=0.0)
    assert group.status is GroupStatus.READY_TO_FINALIZE
    assert ledger.referenced_row_keys() == {s.current.rollout_id for s in group.siblings}
    ledger.begin_finalize(_cut(), "grp")
    ledger.finish_finalize(_cut(), "grp")
    assert ledger.referenced_row_keys() == set()
    ledger.claim(_cut(), ["grp"], step=1)
    assert group.status is GroupStatus.CLAIMED and group.claimed_step == 1
    ledger.unclaim(_cut(), ["grp"])
    ledger.claim(_cut(), ["grp"], step=1)
    ledger.remove_trained(_cut(), ["grp"], step=1)
    assert len(ledger) == 0


def test_failed_attempt_retries_and_counts() -> None:
    ledger = _ledger(size=1)
    attempt = ledger.sibling("grp_g0").current
    ledger.dispatch(_cut(), "grp_g0", attempt.attempt_uuid, "gym-1")
    ledger.fail(_cut(), "grp_g0", attempt.attempt_uuid, "timeout")
    fresh = ledger.retry(_cut(), "grp_g0")
    sibling = ledger.sibling("grp_g0")
    assert sibling.current is fresh and sibling.failed_attempts == 1
    assert fresh.status is AttemptStatus.RESERVED and fresh.rollout_id != attempt.rollout_id


@pytest.mark.parametrize(
    "action",
    [
        "seal_reserved",
        "dispatch_twice",
        "retry_live",
        "stale_attempt",
        "finalize_generating",
        "claim_unfinalized",
        "remove_unclaimed",
        "discard_finalizing",
        "duplicate_group",
        "admit_twice",
        "seal_after_finalize",
    ],
)
def test_illegal_transitions_raise_and_change_nothing(action: str) -> None:
    ledger = _ledger()
    attempt = ledger.sibling("grp_g0").current
    if action in ("discard_finalizing", "seal_after_finalize"):
        _run(ledger, "grp_g0")
        _run(ledger, "grp_g1")
        ledger.begin_finalize(_cut(), "grp")
        if action == "seal_after_finalize":
            ledger.finish_finalize(_cut(), "grp")
    before = _digest(ledger)
    with pytest.raises(LedgerTransitionError):
        if action == "seal_reserved":
            ledger.seal(_cut(), "grp_g0", attempt.attempt_uuid, reward=1.0, row_key="k")
        elif action == "dispatch_twice":
            ledger.dispatch(_cut(), "grp_g0", attempt.attempt_uuid, "gym-0")
            before = _digest(ledger)
            ledger.dispatch(_cut(), "grp_g0", attempt.attempt_uuid, "gym-0")
        elif action == "retry_live":
            ledger.retry(_cut(), "grp_g0")
        elif action == "stale_attempt":
            ledger.dispatch(_cut(), "grp_g0", "not-the-current-uuid", "gym-0")
        elif action == "finalize_generating":
            ledger.begin_finalize(_cut(), "grp")
        elif action == "claim_unfinalized":
            ledger.claim(_cut(), ["grp"], step=1)
        elif action == "remove_unclaimed":
            ledger.remove_trained(_cut(), ["grp"], step=1)
        elif action == "discard_finalizing":
            ledger.discard(_cut(), "grp", "test")
        elif action == "duplicate_group":
            ledger.reserve_group(
                _cut(),
                group_id="grp",
                admission_id="a",
                prompt=PromptRef(1),
                target_step=1,
                start_weight_version=0,
                group_size=2,
            )
        elif action == "admit_twice":
            ledger.admit(_cut(), "grp")
        elif action == "seal_after_finalize":
            ledger.seal(_cut(), "grp_g0", attempt.attempt_uuid, reward=1.0, row_key="k")
    after = _digest(ledger)
    assert after == before


def test_mutators_require_a_live_cut() -> None:
    ledger = _ledger()
    dead = _cut()
    dead.live = False
    attempt = ledger.sibling("grp_g0").current
    with pytest.raises(BarrierError, match="released"):
        ledger.dispatch(dead, "grp_g0", attempt.attempt_uuid, "gym-0")
    assert attempt.status is AttemptStatus.RESERVED


def test_turn_restore_keeps_uuid_and_bumps_gym_attempt() -> None:
    ledger = _ledger(size=3, level=RestoreLevel.TURN)
    _run(ledger, "grp_g0")
    resumed = ledger.sibling("grp_g1").current
    ledger.dispatch(_cut(), "grp_g1", resumed.attempt_uuid, "gym-1")
    lost = ledger.sibling("grp_g2").current
    ledger.dispatch(_cut(), "grp_g2", lost.attempt_uuid, "gym-0")
    report = ledger.prepare_for_restart(_cut(), {resumed.rollout_id: "gym-1"})
    assert report.resumed == [EnvironmentEpisode(resumed.rollout_id, 1)]
    assert ledger.sibling("grp_g1").current is resumed
    assert resumed.status is AttemptStatus.RESERVED and resumed.gym_attempt == 1
    assert resumed.episode.capture_key == f"{resumed.rollout_id}-a1"
    assert report.abandoned == [EnvironmentEpisode(lost.rollout_id, 0)]
    assert lost.status is AttemptStatus.ABANDONED
    assert ledger.sibling("grp_g2").current.status is AttemptStatus.RESERVED
    assert ledger.sibling("grp_g0").current.status is AttemptStatus.SEALED
    with pytest.raises(LedgerTransitionError, match="owned by"):
        ledger.dispatch(_cut(), "grp_g1", resumed.attempt_uuid, "gym-0")
    ledger.dispatch(_cut(), "grp_g1", resumed.attempt_uuid, "gym-1")


def test_prompt_group_granularity_restarts_every_sibling() -> None:
    ledger = _ledger(size=2, granularity=Granularity.PROMPT_GROUP)
    _run(ledger, "grp_g0")
    report = ledger.prepare_for_restart(_cut())
    assert len(report.stale_row_keys) == 1
    assert [s.current.status for s in ledger.group("grp").siblings] == [AttemptStatus.RESERVED] * 2
    assert len(ledger.sibling("grp_g0").attempts) == 2


def test_restart_refuses_unknown_finalization_and_unclaimed_restores() -> None:
    ledger = _ledger(size=1)
    _run(ledger, "grp_g0")
    ledger.begin_finalize(_cut(), "grp")
    ledger.finalization_unknown(_cut(), "grp")
    with pytest.raises(LedgerRestartError, match="finalization_unknown"):
        ledger.prepare_for_restart(_cut())
    with pytest.raises(LedgerRestartError, match="no ledger attempt claims"):
        _ledger().prepare_for_restart(_cut(), {"nobody_g0_aff": "gym-0"})


def test_restart_returns_claimed_groups_to_finalized() -> None:
    ledger = _ledger(size=1)
    _run(ledger, "grp_g0")
    ledger.begin_finalize(_cut(), "grp")
    ledger.finish_finalize(_cut(), "grp")
    ledger.claim(_cut(), ["grp"], step=4)
    report = ledger.prepare_for_restart(_cut())
    assert report.unclaimed_groups == ["grp"]
    assert ledger.group("grp").status is GroupStatus.FINALIZED


def test_sidecar_roundtrip_is_deterministic_and_checked() -> None:
    ledger = _ledger(size=2)
    _run(ledger, "grp_g0")
    spare = [PromptRef(11, 0, 5), PromptRef(12, 0, 6)]
    sidecar = ledger.to_sidecar(
        spare_prompts=spare, batch_shortfall={3: 1}, sampler_stamps_target_steps=True
    )
    assert sidecar.schema_version == 5 and sidecar.group_count == 1
    assert sidecar.metadata()["rollout_recovery_sha256"] == sidecar.sha256
    recovered = read_recovery_sidecar(
        sidecar.data,
        expected_sha256=sidecar.sha256,
        expected_schema=5,
        expected_group_count=1,
    )
    assert recovered.spare_prompts == spare
    assert recovered.batch_shortfall == {3: 1}
    again = recovered.ledger.to_sidecar(
        spare_prompts=spare, batch_shortfall={3: 1}, sampler_stamps_target_steps=True
    )
    assert again.data == sidecar.data
    with pytest.raises(LedgerSidecarError, match="sha256"):
        read_recovery_sidecar(sidecar.data + b" ", expected_sha256=sidecar.sha256)
    with pytest.raises(LedgerSidecarError, match="holds 1 groups"):
        read_recovery_sidecar(sidecar.data, expected_group_count=2)


def test_sidecar_schema_4_reads_without_spare_pool_and_unknowns_are_rejected() -> None:
    ledger = _ledger(size=1)
    document = json.loads(
        ledger.to_sidecar(
            spare_prompts=[], batch_shortfall={}, sampler_stamps_target_steps=True
        ).data
    )
    v4 = dict(document, schema_version=4)
    del v4["spare_prompts"]
    recovered = read_recovery_sidecar(json.dumps(v4).encode())
    assert recovered.schema_version == 4 and recovered.spare_prompts is None
    assert len(recovered.ledger) == 1
    with pytest.raises(LedgerSidecarError, match="schema 6"):
        read_recovery_sidecar(json.dumps(dict(document, schema_version=6)).encode())
    extra = json.loads(json.dumps(document))
    extra["groups"][0]["siblings"][0]["attempts"][0]["surprise"] = 1
    with pytest.raises(LedgerSidecarError, match="unknown field"):
        read_recovery_sidecar(json.dumps(extra).encode())
    bad_status = json.loads(json.dumps(document))
    bad_status["groups"][0]["status"] = "exploded"
    with pytest.raises(LedgerSidecarError, match="GroupStatus"):
        read_recovery_sidecar(json.dumps(bad_status).encode())


def test_a_reserved_attempt_is_relaunched_under_a_new_rollout_id() -> None:
    """Issue 10, finding 1: an attempt reserved at the cut may have been dispatched after it
    (and applied side effects) by the incarnation that was lost; relaunched from turn 0 under
    the same rollout id at gym attempt 0, it repeated them on whichever replica it landed."""
    ledger = _ledger(size=2, level=RestoreLevel.TURN)
    _run(ledger, "grp_g1")
    reserved = ledger.sibling("grp_g0").current
    report = ledger.prepare_for_restart(_cut())
    assert reserved.status is AttemptStatus.ABANDONED
    assert "reserved at the cut" in (reserved.failure or "")
    fresh = ledger.sibling("grp_g0").current
    assert fresh.status is AttemptStatus.RESERVED and fresh.gym_attempt == 0
    assert fresh.rollout_id != reserved.rollout_id
    assert report.abandoned == [EnvironmentEpisode(reserved.rollout_id, 0)]
    assert report.minted == [fresh.rollout_id]
    assert ledger.sibling("grp_g1").current.status is AttemptStatus.SEALED


def test_a_reserved_resumed_attempt_continues_only_from_its_own_restored_record() -> None:
    """Resumed at turn level, then cut again before its dispatch: restored once more, it
    takes the next gym attempt; not restored, its sibling gets a new rollout id."""
    for restored_again in (True, False):
        ledger = _ledger(size=1, level=RestoreLevel.TURN)
        attempt = ledger.sibling("grp_g0").current
        ledger.dispatch(_cut(), "grp_g0", attempt.attempt_uuid, "gym-1")
        ledger.prepare_for_restart(_cut(), {attempt.rollout_id: "gym-1"})
        assert (attempt.status, attempt.gym_attempt) == (AttemptStatus.RESERVED, 1)
        report = ledger.prepare_for_restart(
            _cut(), {attempt.rollout_id: "gym-1"} if restored_again else {}
        )
        current = ledger.sibling("grp_g0").current
        if restored_again:
            assert current is attempt and attempt.gym_attempt == 2
            assert report.resumed == [EnvironmentEpisode(attempt.rollout_id, 2)]
        else:
            assert attempt.status is AttemptStatus.ABANDONED
            assert current.rollout_id != attempt.rollout_id and current.gym_attempt == 0
