"""Rollout snapshots: capture under the cut, the snapshot pump, and publication.

Why a snapshot besides trainer checkpoints: a trainer checkpoint costs a full model and
optimizer write, so runs save one every ``savePeriod`` steps; everything generated in
between (finished groups, sealed siblings, parked multi-turn episodes) would be lost at a
preemption. A snapshot saves only the rollout state, often (``snapshotIntervalSeconds``,
``snapshotEverySteps``), and *references* the model state: it anchors to the newest durable
trainer checkpoint ``step_<N>`` (or to the bootstrap anchor, the run's initial weights,
before the first one), and carries the groups trained since N with their rows. A resume
loads ``step_<N>``, retrains those steps in their recorded order, then restores the rollout
state — so the cadence is independent of ``savePeriod`` and no trained group is lost or
trained twice.

One ``capture(cut, kind)`` and one ``write_controller_sidecars`` serve trainer checkpoints
and snapshots, so a new piece of rollout state is saved by both as soon as it exists. The
kinds differ only where the seed's table says: a snapshot re-indexes an unfinished step's
groups into its replay view and captures the environment; a trainer checkpoint refuses to be
taken inside a step and never touches the environment.

A snapshot attempt runs the seed's six steps under the one save lock (see ``attempt``).
Its environment phase first retires the attempts the ledger abandoned, and the environment's
export is checked against the cut, not trimmed to it: an export that holds an episode the cut
does not know, or lacks one it expects, discards the attempt (``discarded_env``). A Gym
replica that fails the phase (its pod is gone at a preemption) costs only its own episodes:
the snapshot still publishes the buffer, ledger and spare pool (``published_partial_env``),
and the ledger it saves marks those episodes' attempts abandoned, so a restore relaunches
their siblings as new attempts from turn 0 instead of expecting a record.
Every attempt records its outcome (``rollout/checkpoint_outcome``), every published one its
timings (``timing/rollout_checkpoint``), through ``on_record`` (the trainer appends them to
``DIR/snapshots.jsonl``) and the trace. The rules each step applies are pure functions in
:mod:`.snapshots_decisions`; this module runs the steps and does their I/O.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from rolloutrun_runtime.algorithms.rollout_checkpointing.capture_views import (
    CapturedReplayView,
    CapturedResults,
    cow_view,
    prime_views,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.data_segments import (
    SegmentedWrite,
    SegmentSeed,
    SegmentWriter,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.inventory import (
    expected_staging_rows,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
    Anchor,
    Candidate,
    ManifestError,
    ManifestStore,
    PublicationFencedError,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.sidecars import (
    SidecarFragments,
    write_controller_sidecars,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots_decisions import (
    EnvironmentPhase,
    FingerprintCache,
    SnapshotError,
    SnapshotOutcome,
    SnapshotTimings,
    abandoned_episodes,
    dispatched_episodes,
    involuntary_switches,
    keep_export,
    mark_restart_from_turn_zero,
    published_line,
    require_replay_from,
    resolve_anchor,
    should_snapshot_after_rollouts,
    should_snapshot_after_step,
    skip_outcome,
    snapshot_record,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    CONTROLLER_STATE_SCHEMA,
    CapturedRolloutState,
    CaptureKind,
    RolloutParts,
    TrainingProgress,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter
from rolloutrun_runtime.crash import crash_point
from rolloutrun_runtime.data_plane import hold_gc
from rolloutrun_runtime.environments.checkpointing import (
    EnvironmentCheckpoint,
    EnvironmentCheckpointError,
    EnvironmentEpisode,
    EnvironmentSnapshot,
    NoEnvironmentCheckpoint,
)
from rolloutrun_runtime.environments.checkpointing.interfaces import ExportMismatchError
from rolloutrun_runtime.storage import StorageError

logger = logging.getLogger(__name__)

#: Seconds an environment phase may take in a periodic snapshot.
ENV_PHASE_TIMEOUT_S = 20.0
#: Longest wait before the commit for the in-process engines to be between calls (a busy one
#: never is: the snapshot then goes on; the wait only moves the cut a little later).
GENERATION_IDLE_WAIT_S = 0.1
#: How long the engines must have been between calls: a pause inside a burst of calls (the
#: episodes that left their copies call the model together; the next call is on its way
#: over HTTP) is shorter, the pause after the burst (the episodes run their tools) longer.
GENERATION_QUIET_S = 0.005
#: The loop sleeps this long before the cut: an idle loop thread wakes with a fresh CPU slice,
#: so a short cut is rarely preempted inside (~10 ms each when oversubscribed).
PRE_CUT_YIELD_S = 0.0005
SERIALIZE_SLICE = 64  # ledger groups serialized per turn of the loop before the cut (~1 ms)


class RolloutSnapshotter:
    """Captures rollout state for both checkpoint kinds and runs snapshot attempts.

    Public methods (the controller calls only these): ``capture``,
    ``write_controller_sidecars``, ``attempt``, ``run_pump``, ``trainer_checkpoint_published``,
    ``train_step_completed``, ``ensure_bootstrap_anchor`` and ``resumed_from``.
    """

    def __init__(
        self,
        parts: RolloutParts,
        *,
        manifests: ManifestStore | None,
        anchor_is_durable: Callable[[int], bool] | None = None,
        environment: EnvironmentCheckpoint | None = None,
        trace: TraceWriter | None = None,
        fence: Callable[[], None] | None = None,
        on_published: Callable[[dict[str, Any]], None] | None = None,
        on_record: Callable[[dict[str, Any]], None] | None = None,
        incarnation: int = 0,
        generation_idle: Callable[[float, float], Awaitable[bool]] | None = None,
    ) -> None:
        """``generation_idle``: waits (at most a timeout) for the trainer's in-process
        engines to have been between calls for a while
        (:class:`~rolloutrun_runtime.workers.SharesTrainerLoop`), or None."""
        self._parts = parts
        self._manifests = manifests
        self._anchor_is_durable = anchor_is_durable
        self._environment = environment or NoEnvironmentCheckpoint()
        self._trace = trace or TraceWriter(None)
        self._fence = fence
        self._on_published = on_published
        self._on_record = on_record
        self._incarnation = incarnation
        self._generation_idle = generation_idle
        self._last_mutation_version: int | None = None
        self._fenced: BaseException | None = None
        self._last_train_step: int | None = None
        #: Abandoned attempts the environment has retired (each is retired once).
        self._retired: set[EnvironmentEpisode] = set()
        self._wake = asyncio.Event()
        #: What woke the pump ("trainer_checkpoint", "train_step", "rollout_progress");
        #: None: the timer.
        self._wake_reason: str | None = None
        #: Rollout attempts dispatched since the last attempt began (``rollout_dispatched``).
        self._dispatched_since = 0
        self.outcomes: list[SnapshotOutcome] = []
        self.published: list[dict[str, Any]] = []
        #: The data plane is written incrementally: only rows new since the last snapshot.
        self._segments = SegmentWriter(manifests.missing_segments if manifests else None)
        #: Replay groups' and finalizer results' JSON, encoded once each (:mod:`.sidecars`).
        self._fragments = SidecarFragments(self._segments)
        self._fingerprint = FingerprintCache()
        #: The newest published snapshot's environment part: the episode records a lost Gym
        #: replica's turn-level episodes go on from elsewhere (elastic members).
        self.published_environment: EnvironmentSnapshot | None = None

    # ================================================================== capture
    def capture(self, cut: Any, kind: CaptureKind) -> CapturedRolloutState:
        """Copies of all rollout state (call under the exclusive cut).

        The cost is what changed since the previous capture, not the buffer's size: the
        replay buffer, the data plane, the ledger's group texts and the finalizer results
        are copy-on-write views, the journal its frozen entries; all JSON is made after."""
        cut.require_live()
        parts = self._parts
        state = parts.runtime_state
        progress = parts.read_progress()
        if kind is not CaptureKind.ROLLOUT_SNAPSHOT and state.open_step_groups:
            raise SnapshotError(
                f"a trainer checkpoint cannot be taken inside step {progress.trainer_version + 1}"
                f" ({len(state.open_step_groups)} groups selected, not committed)"
            )
        # a snapshot re-indexes the unfinished step's groups into its replay view
        replay_view = CapturedReplayView(parts.buffer.view(), state.open_step_groups)
        controller_state: dict[str, Any] = {
            "schema": CONTROLLER_STATE_SCHEMA,
            "kind": kind.value,
            "trainer_version": progress.trainer_version,
            "dataloader": parts.dataloader.state_dict(),
            "sampler": parts.sampler.state_dict(),
            "mutation_version": parts.barrier.mutation_version,
            # the rollout-relevant view: Gym endpoints and other operational keys may change
            "config_fingerprint": self._fingerprint(parts.config),
        }
        ledger_capture = None
        if parts.ledger is not None:
            # Only the groups changed since the last capture are serialized here; joining
            # the sidecar and its sha256 are written after the cut.
            ledger_capture = parts.ledger.sidecar_capture(
                spare_prompts=state.spare_prompts,
                batch_shortfall=state.batch_shortfall,
                sampler_stamps_target_steps=state.sampler_stamps_target_steps,
            )
        return CapturedRolloutState(
            kind=kind,
            train_step=progress.trainer_version,
            mutation_version=parts.barrier.mutation_version,
            cut_time=time.time(),
            controller_state=controller_state,
            data_plane=parts.data_plane.copy(),
            data_plane_metadata={},
            runtime_state_rest=state.to_json(results=False, journal=False),
            journal_entries=tuple(state.journal),
            pending_drops=tuple(state.pending_drops),
            ledger_capture=ledger_capture,
            replay_view=replay_view,
            retained_row_keys=tuple(state.retained_row_keys()),
            staging_refs=None if parts.ledger is None else expected_staging_rows(parts.ledger),
            finalizer_results=CapturedResults(cow_view(state.finalizer_results)),
        )

    #: Serializing a capture (off the loop): see :mod:`.sidecars`.
    write_controller_sidecars = staticmethod(write_controller_sidecars)

    def resumed_from(self, seed: SegmentSeed | None) -> None:
        """A restore was installed: the data-plane segments its snapshot wrote are this
        incarnation's too (the first snapshot after a resume writes only what changed)."""
        if seed is not None:
            self._segments.seed(seed)

    # ================================================================== bootstrap
    def ensure_bootstrap_anchor(self) -> None:
        """Record the bootstrap anchor (or refuse a config that differs from it)."""
        if self._manifests is not None:
            self._manifests.ensure_bootstrap_anchor(self._parts.config)

    # ================================================================== the pump
    def trainer_checkpoint_published(self, step: int) -> None:
        """A trainer checkpoint is durable: snapshot soon, anchored to it."""
        logger.debug("trainer checkpoint step_%d published; waking the snapshot pump", step)
        self._wake_reason = "trainer_checkpoint"
        self._wake.set()

    def train_step_completed(self, step: int, every_steps: int) -> None:
        """Step ``step`` is trained: snapshot soon when it is the ``every_steps``-th one."""
        if should_snapshot_after_step(step, every_steps):
            self._wake_reason = self._wake_reason or "train_step"
            self._wake.set()

    def rollout_dispatched(self, every_rollouts: int) -> None:
        """One rollout attempt dispatched: snapshot soon once ``every_rollouts`` were since
        the last attempt began (``snapshotEveryRollouts``)."""
        self._dispatched_since += 1
        if should_snapshot_after_rollouts(self._dispatched_since, every_rollouts):
            self._wake_reason = self._wake_reason or "rollout_progress"
            self._wake.set()

    async def run_pump(
        self, interval_s: float, every_steps: int = 0, every_rollouts: int = 0
    ) -> None:
        """Attempt a snapshot every ``interval_s`` seconds, after each trainer save, after
        every ``every_steps``-th train step (woken by ``train_step_completed``) and once
        ``every_rollouts`` attempts were dispatched (woken by ``rollout_dispatched``).

        ``interval_s`` 0 leaves only the wake-ups; with ``every_steps`` and
        ``every_rollouts`` 0 too, periodic snapshots are off (a forced one still runs).
        """
        if self._manifests is None or max(interval_s, every_steps, every_rollouts) <= 0:
            return
        if self._parts.ledger is None:
            # Without the ledger nothing records in-flight groups: a snapshot would move the
            # cursor past prompts it cannot bring back (targetLevel none: trainer checkpoints).
            logger.info("rollout snapshots off: dispatch does not record prompt groups")
            return
        while True:
            # asyncio.wait, not wait_for: a cancel must end the pump at once, whatever the
            # waiter is doing (3.11's wait_for can hold a cancelled task on its inner one).
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                await asyncio.wait({waiter}, timeout=interval_s if interval_s > 0 else None)
            finally:
                waiter.cancel()
            reason, self._wake_reason = self._wake_reason or "periodic", None
            self._wake.clear()
            self._dispatched_since = 0
            await self.attempt(reason=reason)

    # ================================================================== one attempt
    async def attempt(self, *, force: bool = False, reason: str = "periodic") -> SnapshotOutcome:
        """One snapshot attempt, the seed's six steps; returns (and records) its outcome."""
        if self._manifests is None:
            raise SnapshotError("rollout snapshots need checkpoint storage")
        timings = SnapshotTimings()
        async with self._parts.save_lock:
            try:
                outcome, detail = await self._attempt_locked(force, timings)
            except (asyncio.CancelledError, PublicationFencedError):
                raise  # a fenced trainer must stop, not retry at the next interval
            except (SnapshotError, ManifestError, StorageError, RuntimeError, OSError) as error:
                if error is self._fenced:
                    raise  # the fence's own error (e.g. the lease is lost), unchanged
                logger.warning("rollout snapshot failed: %s", error, exc_info=True)
                outcome, detail = SnapshotOutcome.FAILED, {"error": str(error)}
        self._record(outcome, reason, timings, detail)
        return outcome

    async def _attempt_locked(
        self, force: bool, timings: SnapshotTimings
    ) -> tuple[SnapshotOutcome, dict[str, Any]]:
        parts = self._parts
        if parts.ledger is None:
            raise SnapshotError(
                "rollout snapshots need ledger dispatch (checkpointing.targetLevel none records "
                "no in-flight groups); only trainer checkpoints can resume this run"
            )
        # 1. skip inside an optimizer commit, or when nothing changed
        progress = parts.read_progress()
        seen = (self._last_mutation_version, self._last_train_step)
        skip = skip_outcome(progress, force=force, seen=seen, now=parts.barrier.mutation_version)
        if skip is not None:
            return skip, {}
        # 2. the anchor
        anchor = resolve_anchor(progress.trainer_version, progress.durable_step)
        if anchor.kind == "step" and not await self._durable(anchor.step):
            return SnapshotOutcome.SKIPPED_ANCHOR_NOT_DURABLE, {"anchor": anchor.name}
        require_replay_from(parts.runtime_state.replay_after, anchor)
        # 3. the environment phase: copies of the running episodes at turn boundaries
        env_started = time.monotonic()
        settle = None if force else functools.partial(self._engines_at_rest, timings)
        phase = await self._environment_phase(f"snap-{uuid.uuid4().hex[:12]}", settle)
        if phase.discarded is not None:
            return SnapshotOutcome.DISCARDED_ENV, {"error": phase.discarded}
        timings.env_phase_s = time.monotonic() - env_started - timings.idle_wait_s
        serialize_started = time.monotonic()
        await self._serialize_changed_groups()
        # No automatic GC from here until the files are written and the capture is gone:
        # no pass over every buffered record lands in the cut or right after it.
        with hold_gc():
            prime_views(parts)  # the cut's copy-on-write views log from here on
            timings.serialize_ahead_s = time.monotonic() - serialize_started
            return await self._cut_and_publish(anchor, progress, phase, timings)

    async def _cut_and_publish(
        self,
        anchor: Anchor,
        progress: TrainingProgress,
        phase: EnvironmentPhase,
        timings: SnapshotTimings,
    ) -> tuple[SnapshotOutcome, dict[str, Any]]:
        # 4. the exclusive cut: re-check, check the export against the cut, capture; 5. leave
        # the cut, then end the environment phase (before any disk write)
        detail: dict[str, Any] = {}
        try:
            captured = await self._capture_under_cut(progress, phase, timings, detail)
        except ExportMismatchError as error:
            logger.warning("rollout snapshot %s discarded: %s", phase.checkpoint_id, error)
            return SnapshotOutcome.DISCARDED_ENV, {"error": str(error)}
        # 6. publish
        return await self._publish_captured(anchor, captured, phase.unavailable, timings, detail)

    async def _serialize_changed_groups(self) -> None:
        """Before the cut, a slice per turn of the loop: serialize the ledger groups changed
        since the last capture, so the cut serializes only the few that change meanwhile."""
        ledger = self._parts.ledger
        for _ in range(len(ledger or ()) // SERIALIZE_SLICE + 1):  # one pass; later: the cut
            assert ledger is not None
            if ledger.refresh_fragments(SERIALIZE_SLICE) < SERIALIZE_SLICE:
                return
            await asyncio.sleep(0)

    async def _engines_at_rest(self, timings: SnapshotTimings) -> None:
        """Wait (at most ``GENERATION_IDLE_WAIT_S``) until the in-process engines have been
        between calls for ``GENERATION_QUIET_S``: from here to the end of the write, the
        snapshot's work then holds back no decode step (``SnapshotTimings.idle_wait_s``)."""
        if self._generation_idle is None:
            return
        started = time.monotonic()
        await self._generation_idle(GENERATION_IDLE_WAIT_S, GENERATION_QUIET_S)
        timings.idle_wait_s = time.monotonic() - started

    async def _environment_phase(
        self, checkpoint_id: str, settle: Callable[[], Awaitable[None]] | None = None
    ) -> EnvironmentPhase:
        """Step 3: retire the attempts the ledger gave up, park the running episodes and
        export their copies; a failed phase discards the attempt (the environment resumes).

        ``settle`` runs between the prepare and the commit (or alone, when the environment
        holds no rollout state): a periodic snapshot waits there for the engines to rest.
        The prepare answers as the last running episode leaves its copy at a turn boundary,
        which is when the episodes call the model: a commit answered then (the Gym encodes
        every copy, the trainer decodes and checks them) lands in that burst of calls. The
        window stays open meanwhile, so an episode that passes another boundary leaves a
        newer copy; what is requested is still what was out when the prepare answered."""
        phase = EnvironmentPhase(checkpoint_id)
        environment, ledger = self._environment, self._parts.ledger
        if not environment.holds_rollout_state:
            if settle is not None:
                await settle()
            return phase
        deadline = time.time() + ENV_PHASE_TIMEOUT_S
        given_up = abandoned_episodes(ledger)
        self._retired &= given_up  # forget those whose group left the ledger
        retire = sorted(given_up - self._retired)
        try:
            crash_point("during_gym_prepare")
            failed = await environment.prepare(checkpoint_id, deadline, retire)
            self._retired.update(e for e in retire if e.instance_id not in failed)
            # Everything out now; one dispatched later has no copy and restarts from turn 0.
            phase.requested = dispatched_episodes(ledger)
            if settle is not None:
                await settle()
            crash_point("during_gym_commit")
            phase.snapshot = await environment.commit(
                checkpoint_id, deadline, phase.requested, failed
            )
        except EnvironmentCheckpointError as error:
            phase.discarded = str(error)
        else:
            if self._parts.read_progress().optimizer_commit_in_progress:
                phase.discarded = "a train step began committing"
        if phase.discarded is not None:
            await self._resume_environment(checkpoint_id)
        elif phase.snapshot is not None:
            phase.unavailable = dict(phase.snapshot.unavailable)
        return phase

    async def _capture_under_cut(
        self,
        progress: TrainingProgress,
        phase: EnvironmentPhase,
        timings: SnapshotTimings,
        detail: dict[str, Any],
    ) -> CapturedRolloutState:
        """Steps 4 and 5: capture under the exclusive cut, checking the environment's export
        against it; then leave the cut and end the environment phase, whatever happened."""
        parts = self._parts
        await asyncio.sleep(PRE_CUT_YIELD_S)  # the pumps run meanwhile
        switches_before = involuntary_switches()
        wait_started = time.monotonic()
        cut = None
        try:
            async with parts.barrier.checkpoint() as cut:
                held_started, held_cpu = time.monotonic(), time.thread_time()
                timings.barrier_wait_s = held_started - wait_started
                now = parts.read_progress()
                if now.durable_step != progress.durable_step:
                    raise SnapshotError("a trainer checkpoint was published during the attempt")
                captured = self.capture(cut, CaptureKind.ROLLOUT_SNAPSHOT)
                if phase.snapshot is not None:
                    dispatched = dispatched_episodes(parts.ledger)
                    keep_export(captured, phase, dispatched, detail)
                timings.cut_held_s = time.monotonic() - held_started
                timings.cut_held_cpu_s = time.thread_time() - held_cpu
        finally:
            # Until the barrier let mutations in again; the cyclic-GC pass it deferred may
            # run right after, with the pumps free to go on (it blocks the event loop like
            # any other pass, which the trainer keeps short with gc.freeze at start-up).
            released = cut.released_at if cut is not None else None
            timings.pump_paused_s = (released or time.monotonic()) - wait_started
            timings.cut_preempted = involuntary_switches() - switches_before
            if self._environment.holds_rollout_state:
                await self._resume_environment(phase.checkpoint_id)
        return captured

    async def _publish_captured(
        self,
        anchor: Anchor,
        captured: CapturedRolloutState,
        unavailable: Mapping[str, str],
        timings: SnapshotTimings,
        detail: dict[str, Any],
    ) -> tuple[SnapshotOutcome, dict[str, Any]]:
        """Step 6: write the files off the loop, publish the manifest last, report it."""
        candidate, segmented = await asyncio.to_thread(
            self._serialize_and_publish, anchor, captured, timings
        )
        self._segments.commit(segmented)
        crash_point("after_manifest_write")
        if captured.train_step == 0:
            crash_point("before_first_checkpoint")
        if captured.restart_from_turn_zero:
            detail["env_restart_from_turn_0"] = captured.restarted_from_turn_zero
        detail["data_plane_rows_written"] = segmented.new_rows + segmented.compacted_rows
        self._last_mutation_version = captured.mutation_version
        self._last_train_step = captured.train_step
        published = {
            "train_step": captured.train_step,
            "anchor_step": anchor.step,
            "manifest_uri": candidate.manifest_uri,
            "published_at": time.time(),
        }
        self.published.append(published)
        if captured.environment_snapshot is not None:
            self.published_environment = captured.environment_snapshot
        outcome = (
            SnapshotOutcome.PUBLISHED_PARTIAL_ENV if unavailable else SnapshotOutcome.PUBLISHED
        )
        if unavailable:
            detail["env_unavailable"] = dict(sorted(unavailable.items()))
        self._trace.emit(
            "snapshot_published",
            snapshot_id=candidate.manifest.snapshot_id,
            anchor=anchor.name,
            cut_time=captured.cut_time,
            manifest_uri=candidate.manifest_uri,
            outcome=outcome.value,
            env_unavailable=sorted(unavailable),
        )
        if self._on_published is not None:
            self._on_published(dict(published))
        return outcome, {
            **detail,
            "snapshot_id": candidate.manifest.snapshot_id,
            "anchor": anchor.name,
            "train_step": captured.train_step,
            "manifest_uri": candidate.manifest_uri,
        }

    def _serialize_and_publish(
        self, anchor: Anchor, captured: CapturedRolloutState, timings: SnapshotTimings
    ) -> tuple[Candidate, SegmentedWrite]:
        """Off the loop, in one thread hop (each hop is a hand-over of the interpreter lock
        and a wake-up of the loop): serialize the capture, then publish it."""
        write_started = time.monotonic()
        files = self.write_controller_sidecars(captured, self._segments.pack, self._fragments)
        segmented = self._segments.take_pending()
        publish_started = time.monotonic()
        timings.write_s = publish_started - write_started
        assert self._manifests is not None

        def fence() -> None:
            crash_point("before_manifest_write")
            if self._fence is not None:
                try:
                    self._fence()
                except Exception as error:
                    self._fenced = error
                    raise

        candidate = self._manifests.publish(
            config=self._parts.config,
            anchor=anchor,
            files=files,
            train_step=captured.train_step,
            mutation_version=captured.mutation_version,
            cut_time=captured.cut_time,
            incarnation=self._incarnation,
            extra={"replay_steps": captured.train_step - anchor.step},
            fence=fence,
            keep_latest=self._parts.config.checkpointing.keep_latest,
            segments=segmented.manifest_segments(),
            segment_files=segmented.files_to_write(),
        )
        timings.publish_s = time.monotonic() - publish_started
        return candidate, segmented

    async def _durable(self, step: int) -> bool:
        if self._anchor_is_durable is None:
            return True
        return await asyncio.to_thread(self._anchor_is_durable, step)

    async def _resume_environment(self, checkpoint_id: str) -> None:
        try:
            crash_point("during_gym_resume")
            await self._environment.resume(checkpoint_id)
        except EnvironmentCheckpointError as error:
            # The commit stands; the environment's checkpoint lease reopens it by itself.
            logger.warning("environment resume after %s failed: %s", checkpoint_id, error)

    def _record(
        self,
        outcome: SnapshotOutcome,
        reason: str,
        timings: SnapshotTimings,
        detail: Mapping[str, Any],
    ) -> None:
        self.outcomes.append(outcome)
        record = snapshot_record(outcome, reason, timings, detail, time.time())
        if outcome in (SnapshotOutcome.PUBLISHED, SnapshotOutcome.PUBLISHED_PARTIAL_ENV):
            logger.info("%s", published_line(outcome, timings, detail))
        else:
            self._trace.emit("snapshot_skipped", reason=outcome.value)
            logger.debug("rollout snapshot attempt: %s %s", outcome.value, dict(detail))
        if self._on_record is not None:
            self._on_record(record)


__all__ = [
    # re-exported from snapshots_decisions: the snapshot half's public names stay here
    "ENV_PHASE_TIMEOUT_S",
    "RolloutSnapshotter",
    "SnapshotError",
    "SnapshotOutcome",
    "SnapshotTimings",
    "abandoned_episodes",
    "dispatched_episodes",
    "mark_restart_from_turn_zero",
    "resolve_anchor",
    "should_snapshot_after_step",
]
