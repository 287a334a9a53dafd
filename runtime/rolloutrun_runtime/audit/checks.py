"""The audit's checks: pure functions over a loaded :class:`DurableState`, one report each.

Why pure: each check (prompts, side effects, gym attempts, rows; see the package doc for
what each proves) is table-tested against doctored states, and none may touch storage, so a
verdict depends on the loaded state alone. :func:`audit` runs them all.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rolloutrun_runtime.audit.state import (
    EXAMPLES,
    DurableState,
    LedgerGroup,
    Prompt,
    SideEffect,
    TornRecords,
)

AUDIT_SCHEMA = 1


@dataclass
class PromptReport:
    drawn: int
    trained: int
    pending: int
    dropped: int
    lost: int
    duplicated: int
    undrawn: int
    lost_examples: list[dict[str, int]]
    duplicated_examples: list[dict[str, int]]
    undrawn_examples: list[dict[str, int]]
    drawn_from: str

    @property
    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.undrawn == 0


def _pending_prompts(state: DurableState) -> list[Prompt]:
    pending = [g.prompt for g in state.ledger]
    pending += state.spare
    pending += state.reserved
    in_ledger = {g.group_id for g in state.ledger}
    # With ledger dispatch the replay view is a subset of the ledger; without it the replay
    # groups are the only record (their epoch is the cursor's or the one before: the ledger
    # is what makes that exact, so these count in the current epoch).
    for group in state.replay:
        if group["group_id"] not in in_ledger:
            pending.append(Prompt(int(group["prompt_id"]), state.cursor_epoch))
    return pending


def _as_dicts(prompts: Iterable[Prompt]) -> list[dict[str, int]]:
    return [asdict(p) for p in sorted(prompts, key=lambda p: (p.epoch, p.prompt_id))][:EXAMPLES]


def check_prompts(state: DurableState) -> PromptReport:
    """Drawn up to the cursor = trained exactly once + pending + dropped, per epoch."""
    trained_counts = Counter(prompt for _, prompt in state.trained)
    duplicated = [p for p, n in trained_counts.items() if n > 1]
    pending = set(_pending_prompts(state))
    dropped = set(state.dropped)
    accounted = set(trained_counts) | pending | dropped

    if state.permutations is not None:
        drawn: set[Prompt] = set()
        for epoch in range(state.cursor_epoch + 1):
            order = state.permutations[epoch]
            upto = state.cursor_position if epoch == state.cursor_epoch else len(order)
            drawn.update(Prompt(int(pid), epoch) for pid in order[:upto])
        lost = drawn - accounted
        undrawn = accounted - drawn
        drawn_count = len(drawn)
        drawn_from = "permutation"
    else:
        # Without the seed the drawn set is known only by size per epoch.
        drawn_count = state.cursor_epoch * state.dataset_size + state.cursor_position
        lost = set()
        undrawn = {
            p
            for p in accounted
            if p.epoch > state.cursor_epoch or not 0 <= p.prompt_id < state.dataset_size
        }
        per_epoch = Counter(p.epoch for p in accounted - undrawn)
        missing = 0
        for epoch in range(state.cursor_epoch + 1):
            size = state.cursor_position if epoch == state.cursor_epoch else state.dataset_size
            missing += max(0, size - per_epoch.get(epoch, 0))
            if per_epoch.get(epoch, 0) > size:
                undrawn.update(p for p in accounted if p.epoch == epoch)
        drawn_from = "cursor"
        return PromptReport(
            drawn=drawn_count,
            trained=sum(trained_counts.values()),
            pending=len(pending),
            dropped=len(dropped),
            lost=missing,
            duplicated=len(duplicated),
            undrawn=len(undrawn),
            lost_examples=[],
            duplicated_examples=_as_dicts(duplicated),
            undrawn_examples=_as_dicts(undrawn),
            drawn_from=drawn_from,
        )
    return PromptReport(
        drawn=drawn_count,
        trained=sum(trained_counts.values()),
        pending=len(pending),
        dropped=len(dropped),
        lost=len(lost),
        duplicated=len(duplicated),
        undrawn=len(undrawn),
        lost_examples=_as_dicts(lost),
        duplicated_examples=_as_dicts(duplicated),
        undrawn_examples=_as_dicts(undrawn),
        drawn_from=drawn_from,
    )


@dataclass
class SideEffectReport:
    applied: int
    rollouts: int
    duplicated: int
    duplicated_examples: list[dict[str, Any]]
    torn_lines: int
    torn_examples: list[str] = field(default_factory=list)
    torn_tails: int = 0
    torn_tail_examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.duplicated == 0 and self.torn_lines == 0


def check_side_effects(
    effects: Sequence[SideEffect], torn: TornRecords | None = None
) -> SideEffectReport:
    """No ``(rollout_id, revision)`` applied twice, across every replica's audit file, and
    no unreadable record but a torn tail."""
    torn = torn if torn is not None else TornRecords()
    seen: dict[tuple[str, int], list[str]] = defaultdict(list)
    for effect in effects:
        seen[(effect.rollout_id, effect.revision)].append(effect.source)
    duplicates = [
        {"rollout_id": rid, "revision": rev, "applied": len(sources), "files": sorted(set(sources))}
        for (rid, rev), sources in sorted(seen.items())
        if len(sources) > 1
    ]
    return SideEffectReport(
        applied=len(effects),
        rollouts=len({e.rollout_id for e in effects}),
        duplicated=len(duplicates),
        duplicated_examples=duplicates[:EXAMPLES],
        torn_lines=len(torn.places),
        torn_examples=torn.places[:EXAMPLES],
        torn_tails=len(torn.tails),
        torn_tail_examples=torn.tails[:EXAMPLES],
    )


@dataclass
class GymAttemptReport:
    turn_restores: int
    violations: int
    examples: list[str]

    @property
    def ok(self) -> bool:
        return self.violations == 0


def check_gym_attempts(
    effects: Sequence[SideEffect], ledger: Sequence[LedgerGroup]
) -> GymAttemptReport:
    """``gym_attempt`` only grows along a rollout's effects, and the ledger is never behind.

    Each turn-level restore adds exactly one; a restore whose own snapshot was lost to a
    later kill leaves no effect behind, so two restores can show as a step of two.
    """
    problems: list[str] = []
    restores = 0
    by_rollout: dict[str, list[SideEffect]] = defaultdict(list)
    for effect in effects:
        by_rollout[effect.rollout_id].append(effect)
    applied_attempt: dict[str, int] = {}
    for rollout_id, lines in sorted(by_rollout.items()):
        lines.sort(key=lambda e: (e.revision, e.attempt))
        previous = lines[0].attempt
        for line in lines[1:]:
            if line.attempt < previous:
                problems.append(
                    f"{rollout_id}: gym_attempt went back from {previous} to {line.attempt} "
                    f"at revision {line.revision} (an abandoned attempt applied an effect)"
                )
            restores += max(0, line.attempt - previous)
            previous = max(previous, line.attempt)
        applied_attempt[rollout_id] = max(e.attempt for e in lines)
    for group in ledger:
        for attempt in group.attempts:
            if attempt.gym_attempt > 0 and group.restore_level != "turn":
                problems.append(
                    f"{attempt.rollout_id}: gym_attempt {attempt.gym_attempt} in a "
                    f"{group.restore_level}-level group (only turn-level restores continue one)"
                )
            applied = applied_attempt.get(attempt.rollout_id)
            if applied is not None and attempt.gym_attempt < applied:
                problems.append(
                    f"{attempt.rollout_id}: the ledger says gym_attempt {attempt.gym_attempt} "
                    f"but the environment applied effects at gym_attempt {applied}"
                )
    return GymAttemptReport(turn_restores=restores, violations=len(problems), examples=problems)


@dataclass
class RowReport:
    staging_rows: int
    train_rows: int
    orphaned_staging: int
    orphaned_train: int
    replay_groups: int
    replay_not_finalized: int
    finalized_not_in_replay: int
    examples: list[str]

    @property
    def ok(self) -> bool:
        return not (
            self.orphaned_staging
            or self.orphaned_train
            or self.replay_not_finalized
            or self.finalized_not_in_replay
        )


def check_rows(state: DurableState) -> RowReport:
    """No orphaned data-plane row; the replay view is exactly the ledger's finalized groups."""
    referenced = {
        a.row_key
        for g in state.ledger
        if g.status not in ("finalized", "claimed")
        for a in g.attempts
        if a.row_key and a.status == "sealed"
    }
    orphan_staging = sorted(set(state.staging_keys) - referenced)
    owned_train = {k for g in state.replay for k in g["row_keys"]} | set(state.retained_train_keys)
    orphan_train = sorted(set(state.train_keys) - owned_train)
    replay_ids = {g["group_id"] for g in state.replay}
    examples = [f"orphaned staging row {k}" for k in orphan_staging[:EXAMPLES]]
    examples += [f"orphaned train row {k}" for k in orphan_train[:EXAMPLES]]
    not_finalized: list[str] = []
    missing: list[str] = []
    if state.ledger:
        finalized = {g.group_id for g in state.ledger if g.status in ("finalized", "claimed")}
        not_finalized = sorted(replay_ids - finalized)
        missing = sorted(finalized - replay_ids)
        examples += [f"replay group {g} is not finalized in the ledger" for g in not_finalized]
        examples += [f"finalized group {g} is missing from the replay view" for g in missing]
    return RowReport(
        staging_rows=len(state.staging_keys),
        train_rows=len(state.train_keys),
        orphaned_staging=len(orphan_staging),
        orphaned_train=len(orphan_train),
        replay_groups=len(replay_ids),
        replay_not_finalized=len(not_finalized),
        finalized_not_in_replay=len(missing),
        examples=examples[:EXAMPLES],
    )


@dataclass
class AuditReport:
    source: str
    step: int
    max_steps: int | None
    prompts: PromptReport
    side_effects: SideEffectReport
    gym_attempts: GymAttemptReport
    rows: RowReport

    @property
    def ok(self) -> bool:
        return self.prompts.ok and self.side_effects.ok and self.gym_attempts.ok and self.rows.ok

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": AUDIT_SCHEMA,
            "ok": self.ok,
            "source": self.source,
            "step": self.step,
            "max_steps": self.max_steps,
            "lost": self.prompts.lost,
            "duplicated": self.prompts.duplicated,
            "side_effects_duplicated": self.side_effects.duplicated,
            "gym_attempt_violations": self.gym_attempts.violations,
            "orphaned_staging_rows": self.rows.orphaned_staging,
            "prompts": {**asdict(self.prompts), "ok": self.prompts.ok},
            "side_effects": {**asdict(self.side_effects), "ok": self.side_effects.ok},
            "gym_attempts": {**asdict(self.gym_attempts), "ok": self.gym_attempts.ok},
            "rows": {**asdict(self.rows), "ok": self.rows.ok},
        }


def audit(state: DurableState) -> AuditReport:
    """Every check over one loaded state."""
    return AuditReport(
        source=state.source,
        step=state.step,
        max_steps=state.max_steps,
        prompts=check_prompts(state),
        side_effects=check_side_effects(state.side_effects, state.torn_audit),
        gym_attempts=check_gym_attempts(state.side_effects, state.ledger),
        rows=check_rows(state),
    )
