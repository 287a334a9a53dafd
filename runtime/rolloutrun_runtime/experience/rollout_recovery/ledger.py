"""The recovery ledger: every admitted prompt group, its siblings and their attempts.

Why: a preempted run must neither lose a prompt nor train one twice. The dataloader cursor
alone cannot say which drawn prompts were finished, so every group the rollout pump admits
is recorded here before its prompts leave the dataloader (in the same mutation slot), and
each state change of a rollout is a checked transition:

    group    generating -> ready_to_finalize -> finalizing -> finalized -> claimed -> (removed)
                                               \\-> finalization_unknown
    attempt  reserved -> dispatched -> sealed | failed | abandoned

An illegal transition raises ``LedgerTransitionError`` and changes nothing. Every mutator
takes the caller's barrier cut and checks ``require_live()``, so ledger bytes written under
the exclusive checkpoint cut always describe the same rows as the data plane.

The records themselves are in :mod:`.records`; their saved form (the sidecar) in
:mod:`.sidecar`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from rolloutrun_runtime.experience.rollout_recovery.ids import (
    sibling_id_for,
)
from rolloutrun_runtime.experience.rollout_recovery.records import (
    AttemptStatus,
    Granularity,
    GroupPhase,
    GroupStatus,
    GroupTexts,
    LedgerRestartError,
    LedgerSidecarError,
    LedgerTransitionError,
    LiveCut,
    PromptGroupRecord,
    PromptRef,
    RestartReport,
    RestoreLevel,
    RolloutAttempt,
    SiblingRecord,
    new_attempt,
    relaunch_reason,
    resume_attempt_elsewhere,
    sidecar_rest,
)

if TYPE_CHECKING:
    from rolloutrun_runtime.experience.rollout_recovery.sidecar import (
        LedgerSidecar,
        SidecarCapture,
    )

logger = logging.getLogger(__name__)


_ATTEMPT_MOVES: dict[AttemptStatus, frozenset[AttemptStatus]] = {
    AttemptStatus.RESERVED: frozenset(
        {AttemptStatus.DISPATCHED, AttemptStatus.FAILED, AttemptStatus.ABANDONED}
    ),
    AttemptStatus.DISPATCHED: frozenset(
        {AttemptStatus.SEALED, AttemptStatus.FAILED, AttemptStatus.ABANDONED}
    ),
    AttemptStatus.SEALED: frozenset(),
    AttemptStatus.FAILED: frozenset(),
    AttemptStatus.ABANDONED: frozenset(),
}

_UNFINISHED = frozenset({GroupStatus.GENERATING, GroupStatus.READY_TO_FINALIZE})

_GROUP_MOVES: dict[GroupStatus, frozenset[GroupStatus]] = {
    GroupStatus.GENERATING: frozenset({GroupStatus.READY_TO_FINALIZE}),
    GroupStatus.READY_TO_FINALIZE: frozenset({GroupStatus.FINALIZING}),
    GroupStatus.FINALIZING: frozenset(
        {GroupStatus.FINALIZED, GroupStatus.FINALIZATION_UNKNOWN, GroupStatus.READY_TO_FINALIZE}
    ),
    GroupStatus.FINALIZATION_UNKNOWN: frozenset(),
    GroupStatus.FINALIZED: frozenset({GroupStatus.CLAIMED}),
    GroupStatus.CLAIMED: frozenset({GroupStatus.FINALIZED}),
}


# ---------------------------------------------------------------------- the ledger
class RecoveryLedger:
    """Prompt groups -> siblings -> attempts, with checked transitions."""

    def __init__(self) -> None:
        self._groups: dict[str, PromptGroupRecord] = {}
        self._siblings: dict[str, tuple[str, int]] = {}
        self._texts = GroupTexts()  # each group's sidecar JSON (see ``sidecar_capture``)
        #: Groups still generating or ready to finalize (the ones whose sealed attempts
        #: reference staged rows), kept so a capture need not scan every group.
        self._unfinished: set[str] = set()

    def _changed(self, group_id: str) -> None:
        self._texts.changed(group_id)
        if self._groups[group_id].status in _UNFINISHED:
            self._unfinished.add(group_id)
        else:
            self._unfinished.discard(group_id)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    def groups(self) -> list[PromptGroupRecord]:
        return list(self._groups.values())

    def group(self, group_id: str) -> PromptGroupRecord:
        try:
            return self._groups[group_id]
        except KeyError:
            raise LedgerTransitionError(f"no prompt group {group_id!r} in the ledger") from None

    def sibling(self, sibling_id: str) -> SiblingRecord:
        try:
            group_id, index = self._siblings[sibling_id]
        except KeyError:
            raise LedgerTransitionError(f"no sibling {sibling_id!r} in the ledger") from None
        return self._groups[group_id].siblings[index]

    def group_of(self, sibling_id: str) -> PromptGroupRecord:
        self.sibling(sibling_id)
        return self._groups[self._siblings[sibling_id][0]]

    def with_status(self, *statuses: GroupStatus) -> list[PromptGroupRecord]:
        return [g for g in self._groups.values() if g.status in statuses]

    def unfinished(self) -> list[PromptGroupRecord]:
        """``with_status(GENERATING, READY_TO_FINALIZE)`` from an index, in no fixed order."""
        return [self._groups[group_id] for group_id in self._unfinished]

    def referenced_row_keys(self) -> set[str]:
        """Staging keys that sealed attempts of unfinalized groups still reference."""
        keys: set[str] = set()
        for group in self._groups.values():
            if group.status in (GroupStatus.FINALIZED, GroupStatus.CLAIMED):
                continue
            for sibling in group.siblings:
                for attempt in sibling.attempts:
                    if attempt.status is AttemptStatus.SEALED and attempt.row_key:
                        keys.add(attempt.row_key)
        return keys

    # ------------------------------------------------------------------ admission
    def reserve_group(
        self,
        cut: LiveCut,
        *,
        group_id: str,
        admission_id: str,
        prompt: PromptRef,
        target_step: int | None,
        start_weight_version: int,
        group_size: int,
        granularity: Granularity = Granularity.SIBLING,
        restore_level: RestoreLevel = RestoreLevel.SIBLING,
    ) -> PromptGroupRecord:
        """Record a new group with one reserved attempt per sibling."""
        cut.require_live()
        if group_id in self._groups:
            raise LedgerTransitionError(f"prompt group {group_id!r} is already in the ledger")
        if group_size < 1:
            raise LedgerTransitionError(f"group {group_id!r}: group_size must be >= 1")
        siblings = []
        for index in range(group_size):
            sid = sibling_id_for(group_id, index)
            siblings.append(SiblingRecord(sid, index, [new_attempt(sid)]))
        record = PromptGroupRecord(
            group_id=group_id,
            admission_id=admission_id,
            prompt=prompt,
            target_step=target_step,
            start_weight_version=start_weight_version,
            granularity=granularity,
            restore_level=restore_level,
            siblings=siblings,
        )
        self._groups[group_id] = record
        for sibling in siblings:
            self._siblings[sibling.sibling_id] = (group_id, sibling.index)
        self._changed(group_id)
        return record

    def admit(self, cut: LiveCut, group_id: str) -> None:
        """Mark a reserved group admitted (its admission was committed)."""
        cut.require_live()
        group = self.group(group_id)
        if group.phase is not GroupPhase.RESERVED:
            raise LedgerTransitionError(f"group {group_id!r} is already admitted")
        group.phase = GroupPhase.ADMITTED
        self._changed(group_id)

    # ------------------------------------------------------------------ attempts
    def _attempt(self, sibling_id: str, attempt_uuid: str) -> tuple[SiblingRecord, RolloutAttempt]:
        sibling = self.sibling(sibling_id)
        if sibling.current.attempt_uuid != attempt_uuid:
            raise LedgerTransitionError(
                f"attempt {attempt_uuid!r} is not the current attempt of {sibling_id!r} "
                f"(current: {sibling.current.attempt_uuid!r})"
            )
        return sibling, sibling.current

    def _move(self, attempt: RolloutAttempt, to: AttemptStatus, where: str) -> None:
        if to not in _ATTEMPT_MOVES[attempt.status]:
            raise LedgerTransitionError(
                f"{where}: attempt {attempt.rollout_id!r} cannot go {attempt.status.value} -> "
                f"{to.value}"
            )
        attempt.status = to

    def _require_generating(self, group: PromptGroupRecord, what: str) -> None:
        if group.status is not GroupStatus.GENERATING:
            raise LedgerTransitionError(
                f"cannot {what} in group {group.group_id!r}: it is {group.status.value}"
            )

    def dispatch(
        self, cut: LiveCut, sibling_id: str, attempt_uuid: str, gym_instance_id: str
    ) -> RolloutAttempt:
        """A reserved attempt was sent to the Gym replica ``gym_instance_id``."""
        cut.require_live()
        group = self.group_of(sibling_id)
        self._require_generating(group, "dispatch")
        _, attempt = self._attempt(sibling_id, attempt_uuid)
        if (
            attempt.gym_attempt > 0
            and attempt.gym_instance_id is not None
            and attempt.gym_instance_id != gym_instance_id
        ):
            raise LedgerTransitionError(
                f"attempt {attempt.rollout_id!r} resumes turn state owned by "
                f"{attempt.gym_instance_id!r}; it cannot go to {gym_instance_id!r}"
            )
        self._move(attempt, AttemptStatus.DISPATCHED, "dispatch")
        attempt.gym_instance_id = gym_instance_id
        self._changed(group.group_id)
        return attempt

    def seal(
        self,
        cut: LiveCut,
        sibling_id: str,
        attempt_uuid: str,
        *,
        reward: float,
        row_key: str,
    ) -> PromptGroupRecord:
        """A dispatched attempt finished; its result is staged under ``row_key``."""
        cut.require_live()
        group = self.group_of(sibling_id)
        self._require_generating(group, "seal")
        _, attempt = self._attempt(sibling_id, attempt_uuid)
        self._move(attempt, AttemptStatus.SEALED, "seal")
        attempt.reward = float(reward)
        attempt.row_key = row_key
        self._changed(group.group_id)
        if group.sealed():
            group.status = GroupStatus.READY_TO_FINALIZE
        return group

    def fail(self, cut: LiveCut, sibling_id: str, attempt_uuid: str, reason: str) -> RolloutAttempt:
        """A reserved or dispatched attempt failed (timeout, Gym error)."""
        cut.require_live()
        group = self.group_of(sibling_id)
        self._require_generating(group, "fail an attempt")
        _, attempt = self._attempt(sibling_id, attempt_uuid)
        self._move(attempt, AttemptStatus.FAILED, "fail")
        attempt.failure = reason
        self._changed(group.group_id)
        return attempt

    def abandon(self, cut: LiveCut, sibling_id: str, attempt_uuid: str, reason: str) -> None:
        """Give up a reserved or dispatched attempt without counting it as a failure."""
        cut.require_live()
        _, attempt = self._attempt(sibling_id, attempt_uuid)
        self._move(attempt, AttemptStatus.ABANDONED, "abandon")
        attempt.failure = reason
        self._changed(self._siblings[sibling_id][0])

    def resume_elsewhere(self, cut: LiveCut, sibling_id: str, attempt_uuid: str) -> bool:
        """Its Gym was lost: a dispatched turn-level attempt goes on from its episode record
        on another replica (:func:`resume_attempt_elsewhere`); False, nothing changed, if not."""
        cut.require_live()
        group = self.group_of(sibling_id)
        _, attempt = self._attempt(sibling_id, attempt_uuid)
        if not resume_attempt_elsewhere(group, attempt):
            return False
        self._changed(group.group_id)
        return True

    def retry(self, cut: LiveCut, sibling_id: str) -> RolloutAttempt:
        """Append a fresh reserved attempt after a failed or abandoned one."""
        cut.require_live()
        group = self.group_of(sibling_id)
        self._require_generating(group, "retry a sibling")
        sibling = self.sibling(sibling_id)
        if sibling.current.status not in (AttemptStatus.FAILED, AttemptStatus.ABANDONED):
            raise LedgerTransitionError(
                f"sibling {sibling_id!r} cannot retry: its current attempt is "
                f"{sibling.current.status.value}"
            )
        attempt = new_attempt(sibling_id)
        sibling.attempts.append(attempt)
        self._changed(group.group_id)
        return attempt

    # ------------------------------------------------------------------ groups
    def _move_group(self, group: PromptGroupRecord, to: GroupStatus) -> None:
        if to not in _GROUP_MOVES[group.status]:
            raise LedgerTransitionError(
                f"group {group.group_id!r} cannot go {group.status.value} -> {to.value}"
            )
        group.status = to
        self._changed(group.group_id)

    def begin_finalize(self, cut: LiveCut, group_id: str) -> PromptGroupRecord:
        cut.require_live()
        group = self.group(group_id)
        self._move_group(group, GroupStatus.FINALIZING)
        return group

    def finish_finalize(self, cut: LiveCut, group_id: str) -> PromptGroupRecord:
        cut.require_live()
        group = self.group(group_id)
        self._move_group(group, GroupStatus.FINALIZED)
        return group

    def finalization_unknown(self, cut: LiveCut, group_id: str) -> None:
        """The finalization's outcome is unknown: checkpoints must refuse from now on."""
        cut.require_live()
        self._move_group(self.group(group_id), GroupStatus.FINALIZATION_UNKNOWN)

    def claim(self, cut: LiveCut, group_ids: Iterable[str], step: int) -> None:
        """The train pump selected finalized groups for ``step``."""
        cut.require_live()
        self._move_claim(group_ids, GroupStatus.FINALIZED, GroupStatus.CLAIMED, step, "claimed")

    def unclaim(self, cut: LiveCut, group_ids: Iterable[str]) -> None:
        """Return claimed groups to finalized (their step did not commit)."""
        cut.require_live()
        self._move_claim(group_ids, GroupStatus.CLAIMED, GroupStatus.FINALIZED, None, "unclaimed")

    def _move_claim(
        self,
        group_ids: Iterable[str],
        need: GroupStatus,
        to: GroupStatus,
        step: int | None,
        verb: str,
    ) -> None:
        """Move every group from ``need`` to ``to`` (claimed by ``step``), or none of them."""
        groups = [self.group(g) for g in group_ids]
        for group in groups:
            if group.status is not need:
                raise LedgerTransitionError(
                    f"group {group.group_id!r} cannot be {verb}: it is {group.status.value}"
                )
        for group in groups:
            group.status = to
            group.claimed_step = step
            self._changed(group.group_id)

    def remove_trained(self, cut: LiveCut, group_ids: Iterable[str], step: int) -> None:
        """Drop groups whose step committed (they were trained exactly once)."""
        cut.require_live()
        groups = [self.group(g) for g in group_ids]
        for group in groups:
            if group.status is not GroupStatus.CLAIMED or group.claimed_step != step:
                raise LedgerTransitionError(
                    f"group {group.group_id!r} was not claimed by step {step} "
                    f"(status {group.status.value}, claimed by {group.claimed_step})"
                )
        for group in groups:
            self._drop(group)

    def discard(self, cut: LiveCut, group_id: str, reason: str) -> PromptGroupRecord:
        """Give a group up (dropped, exhausted, stale); refused while finalizing or claimed."""
        cut.require_live()
        group = self.group(group_id)
        if group.status in (
            GroupStatus.FINALIZING,
            GroupStatus.FINALIZATION_UNKNOWN,
            GroupStatus.CLAIMED,
        ):
            raise LedgerTransitionError(
                f"group {group_id!r} cannot be discarded ({reason}): it is {group.status.value}"
            )
        self._drop(group)
        logger.debug("discarded group %s: %s", group_id, reason)
        return group

    def _drop(self, group: PromptGroupRecord) -> None:
        del self._groups[group.group_id]
        self._texts.dropped(group.group_id)
        self._unfinished.discard(group.group_id)
        for sibling in group.siblings:
            self._siblings.pop(sibling.sibling_id, None)

    # ------------------------------------------------------------------ restart
    def prepare_for_restart(
        self, cut: LiveCut, restored_episodes: Mapping[str, str] | None = None
    ) -> RestartReport:
        """Normalize a loaded ledger before the pumps start.

        ``restored_episodes`` maps rollout ids the environment restored (turn level) to the
        instance that holds them. Such an attempt keeps its uuid, gets ``gym_attempt + 1``
        and goes back to reserved, bound to that instance; every other dispatched or reserved
        attempt is abandoned and its sibling gets a fresh attempt (a new rollout id): a
        relaunch from turn 0 never reuses a rollout id that may have applied side effects.
        Claimed groups return to finalized.
        """
        cut.require_live()
        restored = dict(restored_episodes or {})
        blocked = self.with_status(GroupStatus.FINALIZING, GroupStatus.FINALIZATION_UNKNOWN)
        if blocked:
            raise LedgerRestartError(
                "cannot restart: groups "
                + ", ".join(f"{g.group_id} ({g.status.value})" for g in blocked)
                + " have a finalization whose outcome is unknown"
            )
        known = {
            a.rollout_id for g in self._groups.values() for s in g.siblings for a in s.attempts
        }
        unclaimed = [r for r in restored if r not in known]
        if unclaimed:
            raise LedgerRestartError(
                f"the environment restored episodes no ledger attempt claims: {sorted(unclaimed)}"
            )
        report = RestartReport()
        self._texts = GroupTexts.all_changed(self._groups)
        for group in self._groups.values():
            if group.status is GroupStatus.CLAIMED:
                group.status = GroupStatus.FINALIZED
                group.claimed_step = None
                report.unclaimed_groups.append(group.group_id)
            if group.status is not GroupStatus.GENERATING:
                continue
            for sibling in group.siblings:
                self._normalize_sibling(group, sibling, restored, report)
        return report

    def _normalize_sibling(
        self,
        group: PromptGroupRecord,
        sibling: SiblingRecord,
        restored: Mapping[str, str],
        report: RestartReport,
    ) -> None:
        attempt = sibling.current
        if attempt.status is AttemptStatus.SEALED:
            if group.granularity is Granularity.SIBLING:
                return
            if attempt.row_key:
                report.stale_row_keys.append(attempt.row_key)
            attempt.status = AttemptStatus.ABANDONED
            attempt.failure = "restart: prompt-group granularity"
            report.abandoned.append(attempt.episode)
        elif attempt.status in (AttemptStatus.DISPATCHED, AttemptStatus.RESERVED):
            # A reserved attempt may have been dispatched after the cut by the incarnation
            # that was lost, and applied side effects on some replica: relaunching it under
            # the same rollout id from turn 0 would repeat them. Only an episode the
            # environment restored from its own record continues; every other gets a new
            # rollout id (see relaunch_reason).
            owner = restored.get(attempt.rollout_id)
            if (
                owner is not None
                and group.restore_level is RestoreLevel.TURN
                and group.granularity is Granularity.SIBLING
            ):
                if attempt.gym_instance_id not in (None, owner):
                    raise LedgerRestartError(
                        f"episode {attempt.rollout_id!r} was dispatched to "
                        f"{attempt.gym_instance_id!r} but restored on {owner!r}"
                    )
                attempt.gym_attempt += 1
                attempt.gym_instance_id = owner
                attempt.status = AttemptStatus.RESERVED
                report.resumed.append(attempt.episode)
                return
            attempt.failure = relaunch_reason(attempt.status)
            attempt.status = AttemptStatus.ABANDONED
            report.abandoned.append(attempt.episode)
        fresh = new_attempt(sibling.sibling_id)
        sibling.attempts.append(fresh)
        report.minted.append(fresh.rollout_id)

    # ------------------------------------------------------------------ sidecar
    def to_sidecar(
        self,
        *,
        spare_prompts: Iterable[PromptRef],
        batch_shortfall: Mapping[int, int],
        sampler_stamps_target_steps: bool,
    ) -> LedgerSidecar:
        """Deterministic schema-5 bytes, with their sha256 and group count."""
        # Imported here: the sidecar's reader builds a RecoveryLedger, so .sidecar imports
        # this module and a top-level import back would be a cycle.
        from rolloutrun_runtime.experience.rollout_recovery.sidecar import encode_sidecar

        return encode_sidecar(
            self.sidecar_document(
                spare_prompts=spare_prompts,
                batch_shortfall=batch_shortfall,
                sampler_stamps_target_steps=sampler_stamps_target_steps,
            )
        )

    def sidecar_document(
        self,
        *,
        spare_prompts: Iterable[PromptRef],
        batch_shortfall: Mapping[int, int],
        sampler_stamps_target_steps: bool,
    ) -> dict[str, Any]:
        """The sidecar as fresh JSON-ready dicts (no container shared with the ledger).

        Cheap enough to take under the exclusive cut; :func:`encode_sidecar` (the costly
        serialization and hashing) can then run after the cut, off the event loop.
        """
        rest = sidecar_rest(spare_prompts, batch_shortfall, sampler_stamps_target_steps)
        return {**rest, "groups": [g.to_json() for g in self._groups.values()]}

    # ------------------------------------------------------------------ incremental capture
    def refresh_fragments(self, limit: int) -> int:
        """Serialize up to ``limit`` groups changed since their last serialization (a snapshot
        does it in slices before its cut, so the cut serializes only what changed since)."""
        return self._texts.refresh(self._groups, limit)

    def sidecar_capture(
        self,
        *,
        spare_prompts: Iterable[PromptRef],
        batch_shortfall: Mapping[int, int],
        sampler_stamps_target_steps: bool,
    ) -> SidecarCapture:
        """The sidecar for a capture under the exclusive cut: only the groups changed since the
        last capture are serialized now, and the groups' texts are taken as a copy-on-write
        view (the entries changed since the last capture, not one per group);
        :meth:`SidecarCapture.encode` joins them after the cut into the bytes
        ``encode_sidecar`` gives for :meth:`sidecar_document` at the same moment."""
        from rolloutrun_runtime.experience.rollout_recovery.sidecar import SidecarCapture

        serialized = self._texts.refresh(self._groups, len(self._texts.dirty))
        rest = sidecar_rest(spare_prompts, batch_shortfall, sampler_stamps_target_steps)
        return SidecarCapture(self._texts.texts.view(), rest, serialized)

    def prime_capture(self) -> None:
        """Ahead of a cut: the next capture's view costs only what changes from now on."""
        self._texts.texts.prime()

    @classmethod
    def _from_groups(cls, groups: list[PromptGroupRecord]) -> RecoveryLedger:
        ledger = cls()
        for group in groups:
            if group.group_id in ledger._groups:
                raise LedgerSidecarError(f"sidecar lists group {group.group_id!r} twice")
            ledger._groups[group.group_id] = group
            for sibling in group.siblings:
                if sibling.sibling_id in ledger._siblings:
                    raise LedgerSidecarError(f"sidecar lists sibling {sibling.sibling_id!r} twice")
                ledger._siblings[sibling.sibling_id] = (group.group_id, sibling.index)
            if [s.index for s in group.siblings] != list(range(len(group.siblings))):
                raise LedgerSidecarError(f"group {group.group_id!r} has out-of-order siblings")
        for group_id in ledger._groups:
            ledger._changed(group_id)
        return ledger
