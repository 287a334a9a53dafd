"""The ledger's incremental capture: the cut serializes only the groups changed since the last
capture, and the bytes it yields are the full encoding's, through every transition."""

from __future__ import annotations

from typing import Any

from rolloutrun_runtime.experience.rollout_recovery import (
    GroupStatus,
    PromptGroupRecord,
    PromptRef,
    RecoveryLedger,
    RestoreLevel,
)


class _Cut:
    def require_live(self) -> None:
        pass


CUT = _Cut()
SIDECAR: dict[str, Any] = {
    "spare_prompts": [PromptRef(7, 1, 7)],
    "batch_shortfall": {3: 1},
    "sampler_stamps_target_steps": True,
}


def _reserve(ledger: RecoveryLedger, index: int, **extra: Any) -> str:
    group_id = f"pg{index:04d}"
    ledger.reserve_group(
        CUT,
        group_id=group_id,
        admission_id="step1",
        prompt=PromptRef(index, 0, index),
        target_step=1,
        start_weight_version=0,
        group_size=2,
        **extra,
    )
    ledger.admit(CUT, group_id)
    return group_id


def _finish(ledger: RecoveryLedger, group_id: str) -> None:
    for sibling in ledger.group(group_id).siblings:
        attempt = sibling.current
        ledger.dispatch(CUT, sibling.sibling_id, attempt.attempt_uuid, "gym-0")
        ledger.seal(CUT, sibling.sibling_id, attempt.attempt_uuid, reward=1.0, row_key="k")
    ledger.begin_finalize(CUT, group_id)
    ledger.finish_finalize(CUT, group_id)


def _assert_capture_is_the_full_encoding(ledger: RecoveryLedger) -> None:
    captured = ledger.sidecar_capture(**SIDECAR).encode()
    full = ledger.to_sidecar(**SIDECAR)
    assert captured == full
    unfinished = ledger.with_status(GroupStatus.GENERATING, GroupStatus.READY_TO_FINALIZE)
    assert {g.group_id for g in ledger.unfinished()} == {g.group_id for g in unfinished}


def test_capture_equals_the_full_encoding_after_every_transition() -> None:
    ledger = RecoveryLedger()
    check = _assert_capture_is_the_full_encoding
    check(ledger)
    groups = [_reserve(ledger, i, restore_level=RestoreLevel.TURN) for i in range(4)]
    check(ledger)
    first = ledger.group(groups[0]).siblings[0]
    ledger.dispatch(CUT, first.sibling_id, first.current.attempt_uuid, "gym-0")
    check(ledger)
    ledger.fail(CUT, first.sibling_id, first.current.attempt_uuid, "timeout")
    check(ledger)
    ledger.retry(CUT, first.sibling_id)
    check(ledger)
    ledger.abandon(CUT, first.sibling_id, first.current.attempt_uuid, "given up")
    check(ledger)
    ledger.retry(CUT, first.sibling_id)
    _finish(ledger, groups[1])
    check(ledger)
    ledger.claim(CUT, [groups[1]], 1)
    check(ledger)
    ledger.unclaim(CUT, [groups[1]])
    check(ledger)
    ledger.claim(CUT, [groups[1]], 1)
    ledger.remove_trained(CUT, [groups[1]], 1)
    check(ledger)
    ledger.discard(CUT, groups[2], "dropped")
    check(ledger)
    _reserve(ledger, 2)  # the same id again, after it left
    check(ledger)
    third = ledger.group(groups[3]).siblings[1]
    ledger.dispatch(CUT, third.sibling_id, third.current.attempt_uuid, "gym-0")
    _finish(ledger, _reserve(ledger, 9))
    ledger.claim(CUT, ["pg0009"], 2)
    check(ledger)
    ledger.prepare_for_restart(CUT, {third.current.rollout_id: "gym-0"})
    check(ledger)


def test_a_capture_serializes_only_the_groups_changed_since_the_last(monkeypatch) -> None:
    ledger = RecoveryLedger()
    groups = [_reserve(ledger, i) for i in range(50)]
    ledger.sidecar_capture(**SIDECAR)
    serialized: list[str] = []
    to_json = PromptGroupRecord.to_json

    def counting(record: PromptGroupRecord) -> dict[str, Any]:
        serialized.append(record.group_id)
        return to_json(record)

    monkeypatch.setattr(PromptGroupRecord, "to_json", counting)
    ledger.sidecar_capture(**SIDECAR)
    assert serialized == []
    sibling = ledger.group(groups[17]).siblings[0]
    ledger.dispatch(CUT, sibling.sibling_id, sibling.current.attempt_uuid, "gym-0")
    capture = ledger.sidecar_capture(**SIDECAR)
    assert serialized == [groups[17]]
    assert '"status":"dispatched"' in capture.fragments[groups[17]]


def test_serializing_ahead_leaves_the_cut_only_what_changed_after(monkeypatch) -> None:
    ledger = RecoveryLedger()
    groups = [_reserve(ledger, i) for i in range(10)]
    assert ledger.refresh_fragments(4) == 4
    assert ledger.refresh_fragments(100) == 6
    ledger.discard(CUT, groups[3], "dropped")
    serialized: list[str] = []
    to_json = PromptGroupRecord.to_json
    monkeypatch.setattr(
        PromptGroupRecord, "to_json", lambda r: serialized.append(r.group_id) or to_json(r)
    )
    capture = ledger.sidecar_capture(**SIDECAR)
    assert serialized == []
    assert capture.encode().group_count == 9


def test_a_capture_copies_only_the_groups_changed_since_the_last() -> None:
    """Taking the capture under the cut costs the changed groups, not the ledger's size:
    the groups' texts are a copy-on-write view holding only what changed, and it still
    joins into the full encoding, in the ledger's order, after later changes."""
    ledger = RecoveryLedger()
    groups = [_reserve(ledger, i) for i in range(500)]
    first = ledger.sidecar_capture(**SIDECAR)
    assert first.texts.changed == 0  # the first capture copies the texts whole
    sibling = ledger.group(groups[17]).siblings[0]
    ledger.dispatch(CUT, sibling.sibling_id, sibling.current.attempt_uuid, "gym-0")
    capture = ledger.sidecar_capture(**SIDECAR)
    expected = ledger.to_sidecar(**SIDECAR)
    assert (capture.serialized, capture.texts.changed) == (1, 1)
    ledger.discard(CUT, groups[3], "dropped")  # after the cut: not in this capture
    _reserve(ledger, 3)
    assert capture.encode() == expected
    assert first.encode().group_count == 500
    assert ledger.sidecar_capture(**SIDECAR).texts.changed == 1  # the one group (id reused)
    _assert_capture_is_the_full_encoding(ledger)
