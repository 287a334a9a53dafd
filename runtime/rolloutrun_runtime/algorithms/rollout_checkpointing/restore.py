"""Restoring a run: choose what to resume from, read it whole, check it, hand it over.

Why a separate half: restoring must never leave a run half-restored. ``RolloutRestorer``
reads and checks *everything* (manifest checksums, the ledger sidecar's checksum, schema and
group count against the checkpoint's own record, the data-plane inventory, the sampler
cursor, the steps to replay) into a :class:`RestoredRolloutState` before the controller
installs any of it; a check that fails raises :class:`RestoreError` naming the problem.
The reading steps of one entry are pure functions in :mod:`.restore_assembly`.

What to resume from (``plan``): every durable entry (committed snapshot manifests and
committed trainer checkpoints) is a candidate, newest first by training progress (the step it
resumes at; at equal step the snapshot, which also holds the rollout state). Each candidate is
read, verified and decided whole (config compatibility on every resume kind, manifest field
types, checksums, ledger normalization, replay capacity, inventory, cursor) with no side
effect; the first that passes is the plan, a refused one is logged (and traced) with its
reason and the next older one is tried. When every candidate is refused for a reason a
restart cannot change, :class:`UnrestorableError` lists them (the trainer exits
``UNRESTORABLE_EXIT_CODE``); a storage that holds no entry is a fresh start. A storage error
other than a missing object is not a refusal: it propagates, so a restart retries.

``checkpointing.resumeHint`` (rendered by the operator from its Lease annotation, which lags
the storage) is only a hint: it is logged when a newer entry exists and decides nothing.
``checkpointing.resumeFrom`` is the user's pin: only the entry it names is tried, and the
choice is reported as pinned; a pin that names no durable entry, or one that is refused, is
unrestorable.

A snapshot anchored to ``step_<N>`` (or to the bootstrap anchor, N = 0) at train step
``N + k`` restores the weights of N and lists the k steps to retrain (``replay_steps``,
each with its groups in their trained order, whose rows the snapshot kept). The controller
retrains them before its pumps start; with ``deterministic: true`` that reproduces the
weights bit for bit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import time
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.algorithms.rollout_checkpointing.data_segments import (
    SegmentSeed,
    seed_from_snapshot,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
    READ_THREADS,
    Anchor,
    Candidate,
    ManifestError,
    ManifestStore,
    SnapshotManifest,
    fingerprint_of,
    resume_config_differences,
    rollout_config_view,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.restore_assembly import (
    RestoreError,
    check_capacity,
    check_cursor,
    check_restored_work,
    clear_unreferenced,
    read_controller_state,
    read_data_plane,
    read_ledger,
    read_runtime_state,
    relaunch_count,
    replay_since_anchor,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    ResumeSource,
    RolloutRuntimeState,
    TrainedStep,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter
from rolloutrun_runtime.algorithms.trainer_checkpoint import (
    LoadedTrainerCheckpoint,
    TrainerCheckpointer,
    TrainerCheckpointError,
)
from rolloutrun_runtime.contract.layout import (
    DATA_PLANE_METADATA_FILE,
    DATA_PLANE_PREFIX,
    ENVIRONMENT_FILE,
    MANIFEST_NAME,
    ROLLOUT_FILES,
    snapshot_dir,
    step_entry,
)
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.crash import crash_point
from rolloutrun_runtime.data_plane import DataPlane, DataPlaneError
from rolloutrun_runtime.environments.checkpointing import (
    EnvironmentCheckpoint,
    EnvironmentCheckpointError,
    NoEnvironmentCheckpoint,
)
from rolloutrun_runtime.environments.checkpointing.interfaces import restore_scope
from rolloutrun_runtime.experience.rollout_recovery import LedgerError, RecoveryLedger
from rolloutrun_runtime.metrics import EnvironmentRestoreMetrics
from rolloutrun_runtime.storage import ObjectNotFoundError, join_key

logger = logging.getLogger(__name__)

#: Seconds the environment may take to install a snapshot's episodes.
ENV_RESTORE_TIMEOUT_S = 30.0


class UnrestorableError(RestoreError):
    """Every durable entry was refused for a reason a restart cannot change."""

    def __init__(self, refused: list[tuple[str, str]], *, pinned: str | None = None) -> None:
        self.refused = list(refused)
        head = (
            f"the pinned entry {pinned} (checkpointing.resumeFrom) cannot be restored"
            if pinned
            else f"none of the {len(refused)} durable entries can be restored"
        )
        super().__init__(head + "".join(f"\n  {uri}: {why}" for uri, why in refused))


class ResumeKind(enum.StrEnum):
    FRESH = "fresh"
    SNAPSHOT = "snapshot"
    TRAINER_CHECKPOINT = "trainer_checkpoint"


@dataclasses.dataclass
class ResumeChoice:
    """What ``plan`` picked, and what it passed over (and why)."""

    kind: ResumeKind
    candidate: Candidate | None = None
    trainer_step: int | None = None
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    pinned: bool = False
    """True when ``checkpointing.resumeFrom`` (the user's pin) named this entry."""
    restored: RestoredRolloutState | None = dataclasses.field(default=None, repr=False)
    """The planned restore, read and checked (None: fresh, or not read yet)."""


@dataclasses.dataclass(frozen=True)
class DurableEntry:
    """A committed entry a run may resume from, before it is read."""

    kind: ResumeKind
    uri: str
    resume_step: int
    """The train step a resume from it continues at."""
    snapshot_id: int | None = None
    manifest: SnapshotManifest | None = dataclasses.field(default=None, compare=False, repr=False)
    """The snapshot's manifest as listed (verified, not read again, when it is tried)."""

    @property
    def label(self) -> str:
        """How logs name it: ``snapshot rollout_snapshots/snapshot_…`` or ``… step_<N>``."""
        if self.snapshot_id is not None:
            return f"snapshot {snapshot_dir(self.snapshot_id)}"
        return f"trainer checkpoint {step_entry(self.resume_step)}"

    @property
    def progress(self) -> tuple[int, bool, int]:
        """Training progress: the step, then a snapshot over a bare checkpoint, then the id."""
        return (self.resume_step, self.kind is ResumeKind.SNAPSHOT, self.snapshot_id or 0)


def newest_first(entries: list[DurableEntry]) -> list[DurableEntry]:
    """The order candidates are tried in: the most training progress first."""
    return sorted(entries, key=lambda entry: entry.progress, reverse=True)


def pinned_entries(entries: list[DurableEntry], pin: str) -> list[DurableEntry]:
    """The entry a user's pin names (a manifest or ``step_<N>`` URI); refused when none."""
    pin = pin.rstrip("/")

    def names(entry: DurableEntry) -> set[str]:
        if entry.kind is ResumeKind.SNAPSHOT:  # the manifest or its snapshot directory
            return {entry.uri, entry.uri.rsplit("/", 1)[0]}
        return {entry.uri}

    named = [e for e in entries if pin in names(e)]
    if not named:
        raise UnrestorableError(
            [(pin, "names no committed snapshot manifest or trainer checkpoint of this storage")],
            pinned=pin,
        )
    return named[:1]


def hint_note(ordered: list[DurableEntry], hint: str | None) -> str | None:
    """Why the operator's hint is not what is tried first (None: it is, or there is none)."""
    if not hint or not ordered or ordered[0].uri == hint:
        return None
    hinted = next((e for e in ordered if e.uri == hint), None)
    if hinted is None:
        return f"the resume hint {hint} names no committed entry; trying the newest first"
    newest = ordered[0]
    return (
        f"the resume hint {hint} (train step {hinted.resume_step}) lags the storage: "
        f"{newest.uri} (train step {newest.resume_step}) is newer and is tried first"
    )


#: Errors of a candidate's content: it is refused and the next older one is tried. A
#: storage error other than a missing object is not among them (a restart may not see it).
_REFUSALS = (
    ManifestError,
    ObjectNotFoundError,
    TrainerCheckpointError,
    DataPlaneError,
    LedgerError,
    ValueError,
    KeyError,
    TypeError,
)


@dataclasses.dataclass
class RestoredRolloutState:
    """Everything a checkpoint restores, read and checked, not yet installed."""

    source: ResumeSource
    anchor_step: int
    """Weights come from ``step_<anchor_step>`` (0: the run's initial weights)."""
    train_step: int
    trainer: LoadedTrainerCheckpoint | None
    dataloader_state: dict[str, Any]
    sampler_state: dict[str, Any]
    data_plane: DataPlane
    replay_groups: list[ReplayGroup]
    ledger: RecoveryLedger | None
    runtime_state: RolloutRuntimeState
    replay_steps: list[TrainedStep]
    environment_snapshot: bytes | None = None
    snapshot_id: int | None = None
    cut_time: float | None = None
    segment_seed: SegmentSeed | None = None
    """A snapshot's data-plane segments as restored: the next snapshot's writer starts
    from them (``RolloutSnapshotter.resumed_from``)."""


class RolloutRestorer:
    """Chooses a resume source and reads it whole (public: ``plan``, ``restore``,
    ``environment_restore_scope``)."""

    def __init__(
        self,
        config: RunConfig,
        *,
        manifests: ManifestStore | None,
        checkpointer: TrainerCheckpointer | None,
        environment: EnvironmentCheckpoint | None = None,
        trace: TraceWriter | None = None,
    ) -> None:
        self._config = config
        self._manifests = manifests
        self._checkpointer = checkpointer
        self._environment = environment or NoEnvironmentCheckpoint()
        self._trace = trace or TraceWriter(None)
        #: What the environment refused of this incarnation's restore (the step records').
        self.environment_restore = EnvironmentRestoreMetrics()
        #: The restore's episodes a down replica did not take: rollout id -> (owner, record).
        self.unavailable_episodes: dict[str, tuple[str, Mapping[str, Any]]] = {}

    # ================================================================== plan
    def anchor_is_durable(self, anchor: Anchor) -> bool:
        if anchor.kind == "bootstrap":
            return True
        return self._checkpointer is not None and self._checkpointer.is_durable(anchor.step)

    def entries(self) -> tuple[list[DurableEntry], list[tuple[str, str]]]:
        """Every committed entry of the storage, and the manifests that cannot be listed."""
        found: list[DurableEntry] = []
        unlisted: list[tuple[str, str]] = []
        if self._manifests is not None:
            storage = self._manifests.storage
            ids = self._manifests.committed_ids()
            with ThreadPoolExecutor(READ_THREADS) as pool:  # one round trip, not one per id
                loads = [pool.submit(self._manifests.load_manifest, sid) for sid in ids]
            for snapshot_id, load in zip(ids, loads, strict=True):
                uri = storage.uri_for(join_key(snapshot_dir(snapshot_id), MANIFEST_NAME))
                try:
                    manifest = load.result()
                except (ManifestError, ObjectNotFoundError) as error:
                    unlisted.append((uri, str(error)))
                    self._refuse(f"snapshot {snapshot_dir(snapshot_id)}", uri, str(error))
                    continue
                found.append(
                    DurableEntry(
                        ResumeKind.SNAPSHOT, uri, manifest.train_step, snapshot_id, manifest
                    )
                )
        if self._checkpointer is not None:
            storage = self._checkpointer.storage
            for step in self._checkpointer.committed_steps():
                uri = storage.uri_for(step_entry(step))
                found.append(DurableEntry(ResumeKind.TRAINER_CHECKPOINT, uri, step))
        return found, unlisted

    def plan(self) -> ResumeChoice:
        """Read, verify and decide the newest restorable entry; nothing is installed.

        Raises :class:`UnrestorableError` when entries exist and every one is refused.
        """
        crash_point("during_restore")
        owner = self._manifests.owner_problem() if self._manifests is not None else None
        if owner is not None:  # another run's checkpoints, even at or past this maxSteps
            raise UnrestorableError([owner])
        checkpointing = self._config.checkpointing
        found, refused = self.entries()
        ordered = newest_first(found)
        pin = checkpointing.resume_from
        if pin:
            ordered = pinned_entries(ordered, pin)
        else:
            note = hint_note(ordered, checkpointing.resume_hint)
            if note:
                logger.info("%s", note)
        newest_refusal: BaseException | None = None
        for entry in ordered:
            try:
                restored, candidate = self._read(entry)
            except RestoreError as error:
                refused.append((entry.uri, str(error)))
                self._refuse(entry.label, entry.uri, str(error))
                newest_refusal = newest_refusal or error.__cause__ or error
                continue
            newest = newest_first(found)[0]
            if pin and newest is not entry:
                logger.warning(
                    "resuming from %s as pinned by checkpointing.resumeFrom, although %s "
                    "(train step %d) is newer",
                    entry.uri,
                    newest.uri,
                    newest.resume_step,
                )
            logger.info(
                "resuming from %s (%s, train step %d%s)",
                entry.uri,
                entry.kind.value,
                entry.resume_step,
                ", pinned" if pin else "",
            )
            return ResumeChoice(
                kind=entry.kind,
                candidate=candidate,
                trainer_step=(
                    entry.resume_step if entry.kind is ResumeKind.TRAINER_CHECKPOINT else None
                ),
                skipped=refused,
                pinned=bool(pin),
                restored=restored,
            )
        if ordered or refused:
            raise UnrestorableError(refused, pinned=pin) from newest_refusal
        return ResumeChoice(kind=ResumeKind.FRESH)

    def _refuse(self, label: str, uri: str, why: str) -> None:
        logger.warning("passing over %s: %s", label, why)
        self._trace.emit("restore_refused", entry=uri, reason=why)

    def _read(self, entry: DurableEntry) -> tuple[RestoredRolloutState, Candidate | None]:
        """One entry, read and decided whole, or a RestoreError saying why it is refused."""
        try:
            if entry.kind is ResumeKind.SNAPSHOT:
                assert self._manifests is not None and entry.snapshot_id is not None
                candidate = self._manifests.verify(
                    entry.snapshot_id,
                    config=self._config,
                    anchor_is_durable=self.anchor_is_durable,
                    manifest=entry.manifest,
                )
                return self._from_snapshot(candidate), candidate
            return self._from_trainer_checkpoint(entry.resume_step), None
        except RestoreError:
            raise
        except _REFUSALS as error:
            raise RestoreError(f"cannot restore ({entry.kind.value}): {error}") from error

    # ================================================================== restore
    def restore(self, choice: ResumeChoice) -> RestoredRolloutState | None:
        """The planned restore, or read and check what ``choice`` names; None when fresh."""
        if choice.kind is ResumeKind.FRESH:
            return None
        if choice.restored is not None:
            return choice.restored
        crash_point("during_restore")
        try:
            if choice.kind is ResumeKind.SNAPSHOT:
                assert choice.candidate is not None
                return self._from_snapshot(choice.candidate)
            assert choice.trainer_step is not None
            return self._from_trainer_checkpoint(choice.trainer_step)
        except RestoreError:
            raise
        except _REFUSALS as error:
            raise RestoreError(f"cannot restore ({choice.kind.value}): {error}") from error

    def _from_snapshot(self, candidate: Candidate) -> RestoredRolloutState:
        assert self._manifests is not None
        manifest = candidate.manifest
        if manifest.anchor.kind == "step" and self._checkpointer is None:
            raise RestoreError(f"{candidate.manifest_uri}: anchor needs trainer checkpoints")
        # read and checked by ``verify``, concurrently: taken from the candidate here
        files = {
            name: self._manifests.read_file(candidate, name)
            for name in sorted(manifest.files)
            if name in ROLLOUT_FILES
        }
        files.update(
            {key: self._manifests.read_segment(candidate, key) for key in manifest.segments}
        )
        trainer = None
        if manifest.anchor.kind == "step" and self._checkpointer is not None:
            trainer = self._checkpointer.load(manifest.anchor.step)
        restored = self._assemble(
            files,
            source=ResumeSource(
                path=candidate.manifest_uri,
                is_rollout_snapshot=True,
                step=manifest.train_step,
            ),
            anchor_step=manifest.anchor.step,
            trainer=trainer,
            fallback_state=None,
            snapshot_id=manifest.snapshot_id,
            cut_time=manifest.cut_time,
        )
        metadata = files.get(DATA_PLANE_PREFIX + DATA_PLANE_METADATA_FILE)
        if metadata is not None and manifest.segments:
            # the rows just read back, before anything replaced one: the writer's memory
            restored.segment_seed = seed_from_snapshot(
                restored.data_plane, metadata, manifest.segments, files
            )
        return restored

    def _from_trainer_checkpoint(self, step: int) -> RestoredRolloutState:
        assert self._checkpointer is not None
        loaded = self._checkpointer.load(step, extra_names=ROLLOUT_FILES)
        saved = loaded.trainer_state.get("config_fingerprint")
        current = fingerprint_of(rollout_config_view(self._config))
        saved_view = loaded.trainer_state.get("config_view")
        if saved != current and not isinstance(saved_view, dict):
            raise RestoreError(
                f"{loaded.uri}: written with a different rollout-relevant config (config "
                f"fingerprint {str(saved)[:12]}…, this run's {current[:12]}…)"
            )
        differing = (
            resume_config_differences(saved_view, self._config, saved)
            if saved != current and isinstance(saved_view, dict)
            else []
        )
        if differing:
            raise RestoreError(
                f"{loaded.uri}: written with a different rollout-relevant config in "
                f"{', '.join(differing)}; refusing to restore"
            )
        return self._assemble(
            loaded.files,
            source=ResumeSource(path=loaded.uri, is_rollout_snapshot=False, step=step),
            anchor_step=step,
            trainer=loaded,
            fallback_state=loaded.trainer_state,
            snapshot_id=None,
            cut_time=None,
        )

    def _assemble(
        self,
        files: Mapping[str, bytes],
        *,
        source: ResumeSource,
        anchor_step: int,
        trainer: LoadedTrainerCheckpoint | None,
        fallback_state: Mapping[str, Any] | None,
        snapshot_id: int | None,
        cut_time: float | None,
    ) -> RestoredRolloutState:
        """Read one entry's files whole, step by step (see :mod:`.restore_assembly`); any
        step that fails raises RestoreError before anything is installed."""
        where = source.path or "checkpoint"
        config = self._config
        controller = read_controller_state(files, fallback_state, where)
        train_step = int(controller["trainer_version"])
        runtime = read_runtime_state(files, where, deterministic=config.checkpointing.deterministic)
        plane, dp_metadata = read_data_plane(files)
        replay_json = controller.get("replay", dp_metadata.get("replay", []))
        replay_groups = [ReplayGroup.from_json(g) for g in replay_json]
        ledger = read_ledger(files, controller, runtime, uses_ledger=config.uses_ledger)
        released, replay_steps = replay_since_anchor(runtime, anchor_step, train_step, where)
        clear_unreferenced(plane, replay_groups, runtime, ledger, released, where)
        check_restored_work(
            runtime,
            ledger,
            controller["dataloader"],
            replayed=len(replay_groups),
            capacity=config.rollout.replay_capacity,
            where=where,
        )
        return RestoredRolloutState(
            source=dataclasses.replace(source, data_plane_metadata=dp_metadata),
            anchor_step=anchor_step,
            train_step=train_step,
            trainer=trainer,
            dataloader_state=dict(controller["dataloader"]),
            sampler_state=dict(controller["sampler"]),
            data_plane=plane,
            replay_groups=replay_groups,
            ledger=ledger,
            runtime_state=runtime,
            replay_steps=replay_steps,
            environment_snapshot=files.get(ENVIRONMENT_FILE),
            snapshot_id=snapshot_id,
            cut_time=cut_time,
        )

    # ================================================================== environment
    @contextlib.asynccontextmanager
    async def environment_restore_scope(
        self, restored: RestoredRolloutState
    ) -> AsyncIterator[dict[str, str]]:
        """Install a snapshot's copied episodes for the ``async with`` body, which gets
        ``{rollout_id: instance_id}``: the environment keeps them when the body completes and
        drops them when it raises (the seed's restore scope; see ``restore_scope``).

        Refused episodes are logged; their siblings restart from turn 0 under a new rollout
        id (the ledger mints one for every dispatched attempt not in the map). A down
        replica's episodes are kept in ``unavailable_episodes`` with their records.
        """
        data = restored.environment_snapshot
        if data is None or not self._environment.holds_rollout_state:
            yield {}
            return
        # Unique per attempt: a restore of the same snapshot in the same second (an incarnation
        # that failed fast) must not reuse an id the Gym already ended.
        checkpoint_id = f"restore-{restored.snapshot_id}-{time.time_ns()}"
        async with contextlib.AsyncExitStack() as stack:
            try:
                outcome = await stack.enter_async_context(
                    restore_scope(
                        self._environment, checkpoint_id, time.time() + ENV_RESTORE_TIMEOUT_S, data
                    )
                )
            except EnvironmentCheckpointError as error:
                logger.warning(
                    "environment restore failed; its episodes restart from turn 0: %s", error
                )
                self.environment_restore.failed = True
                self._refuse_environment(restored, None, None, str(error))
                outcome = None
            if outcome is None:
                yield {}
                return
            for episode, why in outcome.refused:
                logger.warning("episode %s restarts from turn 0: %s", episode.rollout_id, why)
                self.environment_restore.refused_episodes += 1
                self._refuse_environment(restored, episode.rollout_id, episode.instance_id, why)
            self.unavailable_episodes = {  # the resume carries them as a lost replica's
                e.rollout_id: (e.instance_id, record) for e, record in outcome.unavailable
            }
            yield {episode.rollout_id: episode.instance_id for episode in outcome.restored}

    def _refuse_environment(
        self,
        restored: RestoredRolloutState,
        rollout_id: str | None,
        instance_id: str | None,
        reason: str,
    ) -> None:
        """Trace a refused environment restore: one episode, or all (``rollout_id`` None)."""
        self._trace.emit(
            "environment_restore_refused",
            snapshot_id=restored.snapshot_id,
            rollout_id=rollout_id,
            instance_id=instance_id,
            reason=reason,
        )


__all__ = [
    "DurableEntry",
    "RestoreError",
    "RestoredRolloutState",
    "ResumeChoice",
    "ResumeKind",
    "RolloutRestorer",
    "UnrestorableError",
    "check_capacity",
    "check_cursor",
    "hint_note",
    "newest_first",
    "pinned_entries",
    "relaunch_count",
]
