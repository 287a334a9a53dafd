"""The snapshot half's decisions: outcomes, the anchor, and which episodes a snapshot names.

Why apart from :mod:`.snapshots`: everything here is a pure function of the ledger, the
training progress or a captured ledger document, so each rule of an attempt (when it is
skipped, which anchor it takes, which episodes the environment must export or retire, which
attempts a restore relaunches from turn 0) can be read and tested without a barrier, storage
or an environment. :class:`.snapshots.RolloutSnapshotter` runs the steps and does the I/O.
"""

from __future__ import annotations

import dataclasses
import enum
import resource
from collections.abc import Iterable, Mapping
from typing import Any

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
    BOOTSTRAP_ANCHOR,
    Anchor,
    fingerprint_of,
    rollout_config_view,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    CapturedRolloutState,
    TrainingProgress,
)
from rolloutrun_runtime.environments.checkpointing import EnvironmentEpisode, EnvironmentSnapshot
from rolloutrun_runtime.environments.checkpointing.interfaces import check_export
from rolloutrun_runtime.experience.rollout_recovery import (
    AttemptStatus,
    LedgerSidecar,
    RecoveryLedger,
    encode_sidecar,
)


class SnapshotError(RuntimeError):
    """A capture or a snapshot cannot be taken (the message says why)."""


class SnapshotOutcome(enum.StrEnum):
    """``rollout/checkpoint_outcome`` values."""

    PUBLISHED = "published"
    PUBLISHED_PARTIAL_ENV = "published_partial_env"
    """Published without the records of the environment instances that failed the phase."""
    SKIPPED_UNCHANGED = "skipped_unchanged"
    SKIPPED_COMMIT_WINDOW = "skipped_commit_window"
    SKIPPED_ANCHOR_NOT_DURABLE = "skipped_anchor_not_durable"
    DISCARDED_ENV = "discarded_env"
    FAILED = "failed"


@dataclasses.dataclass
class SnapshotTimings:
    """``timing/rollout_checkpoint``: where a published snapshot's time went (seconds)."""

    barrier_wait_s: float = 0.0
    cut_held_s: float = 0.0
    env_phase_s: float = 0.0
    write_s: float = 0.0
    publish_s: float = 0.0
    pump_paused_s: float = 0.0
    """How long the rollout pump could not mutate: the barrier wait plus the cut held."""
    cut_held_cpu_s: float = 0.0
    """The event loop thread's CPU time in the cut (what the cut costs on an idle machine)."""
    idle_wait_s: float = 0.0
    """Waiting, between the environment's prepare and its commit, until no in-process
    generation call has decoded for a while (the commit, the cut and the write then hold back
    no decode step of the trainer's own engine); not part of ``env_phase_s``."""
    serialize_ahead_s: float = 0.0
    """Serializing the changed ledger groups before the cut, in slices between the loop's
    other work (the pumps run meanwhile)."""
    cut_preempted: int = 0
    """Involuntary context switches of the loop thread while the pump was paused: each is a
    wait for the CPU (~10 ms on an oversubscribed machine) that the cut's CPU time omits."""


#: Linux only: per-thread resource usage (the cut's involuntary context switches).
RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def involuntary_switches() -> int:
    """This thread's involuntary context switches so far (the OS took its CPU away)."""
    return resource.getrusage(RUSAGE_THREAD).ru_nivcsw if RUSAGE_THREAD is not None else 0


class FingerprintCache:
    """The rollout config's fingerprint, computed once per config object (the cut's)."""

    def __init__(self) -> None:
        self._last: tuple[Any, str] | None = None

    def __call__(self, config: Any) -> str:
        if self._last is None or self._last[0] is not config:
            self._last = (config, fingerprint_of(rollout_config_view(config)))
        return self._last[1]


def resolve_anchor(trainer_version: int, durable_step: int | None) -> Anchor:
    """The newest durable trainer checkpoint, else the bootstrap anchor (initial weights).

    Steps trained after the anchor are replayed from the snapshot, so any durable step at or
    below the trainer version will do; the newest keeps the replay short.
    """
    if durable_step is None or durable_step <= 0:
        return BOOTSTRAP_ANCHOR
    if durable_step > trainer_version:
        raise SnapshotError(
            f"durable step {durable_step} is ahead of the trainer version {trainer_version}"
        )
    return Anchor("step", durable_step, durable_step)


def dispatched_episodes(ledger: RecoveryLedger | None) -> list[EnvironmentEpisode]:
    """The episodes the ledger has out on an environment instance (what a commit exports):
    dispatched ones, and restored ones awaiting their dispatch (reserved under
    ``gym_attempt > 0``; their instance holds them, and a restart continues them only from
    a record, else relaunches them under a new rollout id)."""
    if ledger is None:
        return []
    episodes = []
    for group in ledger.groups():
        for sibling in group.siblings:
            attempt = sibling.current
            out = attempt.status is AttemptStatus.DISPATCHED or (
                attempt.status is AttemptStatus.RESERVED and attempt.gym_attempt > 0
            )
            if out and attempt.gym_instance_id:
                episodes.append(
                    EnvironmentEpisode(
                        attempt.rollout_id, attempt.gym_attempt, attempt.gym_instance_id
                    )
                )
    return sorted(episodes)


def abandoned_episodes(ledger: RecoveryLedger | None) -> set[EnvironmentEpisode]:
    """The attempts the ledger gave up (abandoned or failed) that ran on an instance: the
    environment may still hold or run their episodes until they are retired."""
    if ledger is None:
        return set()
    given_up = (AttemptStatus.ABANDONED, AttemptStatus.FAILED)
    return {
        EnvironmentEpisode(attempt.rollout_id, attempt.gym_attempt, attempt.gym_instance_id)
        for group in ledger.groups()
        for sibling in group.siblings
        for attempt in sibling.attempts
        if attempt.status in given_up and attempt.gym_instance_id
    }


def mark_restart_from_turn_zero(
    ledger_document: Mapping[str, Any], episodes: Mapping[EnvironmentEpisode, str]
) -> int:
    """In a captured ledger document, mark the dispatched attempts of ``episodes`` (episode →
    why it has no record) abandoned, so a restore relaunches their siblings as new attempts
    instead of expecting a record; returns how many it marked. The live ledger is untouched:
    the episodes run on in this incarnation."""
    by_rollout = {episode.rollout_id: (episode, why) for episode, why in episodes.items()}
    marked = 0
    for group in ledger_document.get("groups", []):
        for sibling in group["siblings"]:
            attempt = sibling["attempts"][-1]
            found = by_rollout.get(attempt["rollout_id"])
            if found is None or attempt["status"] != str(AttemptStatus.DISPATCHED):
                continue
            episode, why = found
            if (attempt["gym_attempt"], attempt["gym_instance_id"]) != (
                episode.attempt,
                episode.instance_id,
            ):
                continue
            attempt["status"] = str(AttemptStatus.ABANDONED)
            attempt["failure"] = f"restart: no environment record ({why})"
            marked += 1
    return marked


def encode_captured_ledger(captured: CapturedRolloutState) -> LedgerSidecar:
    """The captured ledger's sidecar bytes (after the cut); when a Gym replica failed the
    phase, its episodes' attempts are first marked abandoned in the saved document (never in
    the live ledger) and ``captured.restarted_from_turn_zero`` counts them."""
    assert captured.ledger_capture is not None
    if not captured.restart_from_turn_zero:
        return captured.ledger_capture.encode()
    document = captured.ledger_capture.document()
    captured.restarted_from_turn_zero = mark_restart_from_turn_zero(
        document, captured.restart_from_turn_zero
    )
    return encode_sidecar(document)


def should_snapshot_after_step(step: int, every_steps: int) -> bool:
    """Whether train step ``step`` completing is a snapshot's moment (``snapshotEverySteps``)."""
    return every_steps > 0 and step > 0 and step % every_steps == 0


def should_snapshot_after_rollouts(dispatched_since: int, every_rollouts: int) -> bool:
    """Whether ``dispatched_since`` rollout attempts dispatched since the last attempt began
    make a snapshot's moment (``snapshotEveryRollouts``): the work a kill loses is what was
    dispatched after the last cut, so this cadence follows rollout progress, not steps."""
    return every_rollouts > 0 and dispatched_since >= every_rollouts


def skip_outcome(
    progress: TrainingProgress, *, force: bool, seen: tuple[int | None, int | None], now: int
) -> SnapshotOutcome | None:
    """Step 1: skip inside an optimizer commit, or when nothing changed since the last
    published snapshot (``seen``: its mutation version and train step; ``now``: the barrier's
    mutation version); None: go on."""
    if progress.optimizer_commit_in_progress:
        return SnapshotOutcome.SKIPPED_COMMIT_WINDOW
    if not force and seen == (now, progress.trainer_version):
        return SnapshotOutcome.SKIPPED_UNCHANGED
    return None


def require_replay_from(replay_after: int, anchor: Anchor) -> None:
    """The rows kept for replay must start right after the anchor (else a resume from it
    could not retrain the steps since)."""
    if replay_after != anchor.step:
        raise SnapshotError(
            f"rows kept for replay start after step {replay_after}, but the anchor is {anchor.name}"
        )


def lost_episodes(
    without_record: Iterable[EnvironmentEpisode], unavailable: Mapping[str, str]
) -> dict[EnvironmentEpisode, str]:
    """The episodes without a record because their instance failed the phase, each with why
    (a restore relaunches them from turn 0: see :func:`mark_restart_from_turn_zero`)."""
    return {
        e: f"Gym {e.instance_id} unavailable: {unavailable[e.instance_id]}"
        for e in without_record
        if e.instance_id in unavailable
    }


@dataclasses.dataclass
class EnvironmentPhase:
    """What step 3 left for the cut: the environment's export and the episodes it was asked
    for, or why the attempt is discarded."""

    checkpoint_id: str
    snapshot: EnvironmentSnapshot | None = None
    requested: list[EnvironmentEpisode] = dataclasses.field(default_factory=list)
    unavailable: dict[str, str] = dataclasses.field(default_factory=dict)
    """Instances that failed the phase (their episodes restart from turn 0)."""
    discarded: str | None = None


def keep_export(
    captured: CapturedRolloutState,
    phase: EnvironmentPhase,
    dispatched: list[EnvironmentEpisode],
    detail: dict[str, Any],
) -> None:
    """Under the cut: keep the export's records that the cut still expects (``dispatched``).

    Episodes ran on after their copies: one that finished (its result is in this capture)
    or was given up since needs no record; one dispatched without a copy restarts from
    turn 0 on restore. Anything else that differs discards the attempt
    (``ExportMismatchError``).
    """
    assert phase.snapshot is not None
    check = check_export(phase.snapshot, phase.requested, dispatched)
    captured.environment_snapshot = check.kept
    detail["env_records"] = len(check.kept.episodes())
    detail["env_records_dropped"] = check.finished_since_copy
    if phase.unavailable and captured.ledger_capture is not None:
        # Marked in the saved document after the cut (encode_captured_ledger).
        captured.restart_from_turn_zero = lost_episodes(check.without_record, phase.unavailable)


def published_line(
    outcome: SnapshotOutcome, timings: SnapshotTimings, detail: Mapping[str, Any]
) -> str:
    """The log line of a published snapshot."""
    unavailable = (
        f"; environment instances unavailable: {sorted(detail['env_unavailable'])}"
        if "env_unavailable" in detail
        else ""
    )
    return (
        f"rollout snapshot {detail.get('snapshot_id')} {outcome.value} (train step "
        f"{detail.get('train_step')}, anchor {detail.get('anchor')}, cut held "
        f"{timings.cut_held_s:.4f}s{unavailable})"
    )


def snapshot_record(
    outcome: SnapshotOutcome,
    reason: str,
    timings: SnapshotTimings,
    detail: Mapping[str, Any],
    now: float,
) -> dict[str, Any]:
    """The attempt's line in ``snapshots.jsonl``: its outcome and detail, with the timings
    of a published attempt (``timing/rollout_checkpoint``)."""
    record: dict[str, Any] = {
        "kind": "snapshot",
        "t": now,
        "reason": reason,
        "rollout/checkpoint_outcome": outcome.value,
        **detail,
    }
    if outcome in (SnapshotOutcome.PUBLISHED, SnapshotOutcome.PUBLISHED_PARTIAL_ENV):
        record["timing/rollout_checkpoint"] = {
            k: round(v, 6) for k, v in dataclasses.asdict(timings).items()
        }
    return record
