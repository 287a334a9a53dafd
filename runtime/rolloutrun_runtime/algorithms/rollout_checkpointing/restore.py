"""Restoring a run: choose what to resume from, read it whole, check it, hand it over.

Why a separate half: restoring must never leave a run half-restored. ``RolloutRestorer``
reads and checks *everything* (manifest checksums, the ledger sidecar's checksum, schema and
group count against the checkpoint's own record, the data-plane inventory, the sampler
cursor, the steps to replay) into a :class:`RestoredRolloutState` before the controller
installs any of it; a check that fails raises :class:`RestoreError` naming the problem.

What to resume from (``choose``), in order: ``checkpointing.resumeFrom`` when it verifies
(else the reason is logged and the chain goes on), the newest valid snapshot, the newest
committed trainer checkpoint, a fresh start. A trainer checkpoint newer than the chosen
snapshot's train step wins (it holds more trained steps, and the snapshot's rollout state
would be older than its weights).

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
import json
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.algorithms.rollout_checkpointing.inventory import (
    require_complete,
    take_inventory,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
    Anchor,
    Candidate,
    ManifestError,
    ManifestStore,
    fingerprint_of,
    rollout_config_view,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.state import (
    CONTROLLER_STATE_FILE,
    CONTROLLER_STATE_SCHEMA,
    DATA_PLANE_PREFIX,
    ENVIRONMENT_FILE,
    JOURNAL_FILE,
    LEDGER_FILE,
    RUNTIME_STATE_FILE,
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
from rolloutrun_runtime.config import RunConfig
from rolloutrun_runtime.crash import crash_point
from rolloutrun_runtime.data_plane import DataPlane, DataPlaneError
from rolloutrun_runtime.data_plane.store import METADATA_FILE, ROWS_FILE
from rolloutrun_runtime.environments.checkpointing import (
    EnvironmentCheckpoint,
    EnvironmentCheckpointError,
    NoEnvironmentCheckpoint,
)
from rolloutrun_runtime.environments.checkpointing.interfaces import restore_scope
from rolloutrun_runtime.experience.rollout_recovery import (
    LedgerError,
    PromptRef,
    RecoveryLedger,
    read_recovery_sidecar,
)
from rolloutrun_runtime.storage import StorageError

logger = logging.getLogger(__name__)

#: Every rollout file a checkpoint may hold (read when present).
ROLLOUT_FILES = (
    CONTROLLER_STATE_FILE,
    RUNTIME_STATE_FILE,
    LEDGER_FILE,
    JOURNAL_FILE,
    ENVIRONMENT_FILE,
    DATA_PLANE_PREFIX + ROWS_FILE,
    DATA_PLANE_PREFIX + METADATA_FILE,
)
#: Seconds the environment may take to install a snapshot's episodes.
ENV_RESTORE_TIMEOUT_S = 30.0


class RestoreError(RuntimeError):
    """A checkpoint cannot be restored; nothing of it was installed."""


class ResumeKind(enum.StrEnum):
    FRESH = "fresh"
    SNAPSHOT = "snapshot"
    TRAINER_CHECKPOINT = "trainer_checkpoint"


@dataclasses.dataclass
class ResumeChoice:
    """What ``choose`` picked, and what it passed over (and why)."""

    kind: ResumeKind
    candidate: Candidate | None = None
    trainer_step: int | None = None
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)


def prefer(
    snapshot_train_step: int | None, trainer_step: int | None, *, snapshot_preferred: bool
) -> ResumeKind:
    """Snapshot or trainer checkpoint: the one holding more trained steps (ties: snapshot)."""
    if snapshot_train_step is not None and (
        snapshot_preferred or trainer_step is None or trainer_step <= snapshot_train_step
    ):
        return ResumeKind.SNAPSHOT
    if trainer_step is not None:
        return ResumeKind.TRAINER_CHECKPOINT
    return ResumeKind.FRESH


def check_cursor(prompts: list[PromptRef], dataloader_state: Mapping[str, Any]) -> None:
    """Every restored prompt must lie before the dataloader cursor (else it would repeat)."""
    cursor = (int(dataloader_state["epoch"]), int(dataloader_state["position"]))
    ahead = [p for p in prompts if (p.epoch, p.index) >= cursor]
    if ahead:
        raise RestoreError(
            f"{len(ahead)} restored prompts lie at or past the dataloader cursor "
            f"(epoch {cursor[0]}, position {cursor[1]}), e.g. prompt {ahead[0].prompt_id} at "
            f"epoch {ahead[0].epoch}, position {ahead[0].index}"
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


class RolloutRestorer:
    """Chooses a resume source and reads it whole (public: ``choose``, ``restore``,
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

    # ================================================================== choose
    def anchor_is_durable(self, anchor: Anchor) -> bool:
        if anchor.kind == "bootstrap":
            return True
        return self._checkpointer is not None and self._checkpointer.is_durable(anchor.step)

    def choose(self) -> ResumeChoice:
        """The resume chain: resumeFrom, newest valid snapshot, newest trainer checkpoint."""
        preferred = self._config.checkpointing.resume_from
        candidate = None
        skipped: list[tuple[str, str]] = []
        if self._manifests is not None:
            report = self._manifests.select(
                config=self._config,
                anchor_is_durable=self.anchor_is_durable,
                preferred_uri=preferred,
            )
            candidate, skipped = report.chosen, report.skipped
        trainer_step = self._checkpointer.latest_step() if self._checkpointer else None
        kind = prefer(
            candidate.manifest.train_step if candidate else None,
            trainer_step,
            snapshot_preferred=bool(
                preferred and candidate and candidate.manifest_uri == preferred
            ),
        )
        if kind is ResumeKind.TRAINER_CHECKPOINT and candidate is not None:
            logger.info(
                "trainer checkpoint step_%d is newer than snapshot %d (train step %d)",
                trainer_step,
                candidate.manifest.snapshot_id,
                candidate.manifest.train_step,
            )
        return ResumeChoice(
            kind=kind,
            candidate=candidate if kind is ResumeKind.SNAPSHOT else None,
            trainer_step=trainer_step if kind is ResumeKind.TRAINER_CHECKPOINT else None,
            skipped=skipped,
        )

    # ================================================================== restore
    def restore(self, choice: ResumeChoice) -> RestoredRolloutState | None:
        """Read and check everything ``choice`` names (blocking); None for a fresh start."""
        crash_point("during_restore")
        if choice.kind is ResumeKind.FRESH:
            return None
        try:
            if choice.kind is ResumeKind.SNAPSHOT:
                assert choice.candidate is not None
                return self._from_snapshot(choice.candidate)
            assert choice.trainer_step is not None
            return self._from_trainer_checkpoint(choice.trainer_step)
        except RestoreError:
            raise
        except (
            ManifestError,
            StorageError,
            TrainerCheckpointError,
            DataPlaneError,
            LedgerError,
            ValueError,
            KeyError,
        ) as error:
            raise RestoreError(f"cannot restore ({choice.kind.value}): {error}") from error

    def _from_snapshot(self, candidate: Candidate) -> RestoredRolloutState:
        assert self._manifests is not None
        manifest = candidate.manifest
        files = {
            name: self._manifests.read_file(candidate, name)
            for name in sorted(manifest.files)
            if name in ROLLOUT_FILES
        }
        trainer = None
        if manifest.anchor.kind == "step":
            if self._checkpointer is None:
                raise RestoreError(f"{candidate.manifest_uri}: anchor needs trainer checkpoints")
            trainer = self._checkpointer.load(manifest.anchor.step)
        return self._assemble(
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

    def _from_trainer_checkpoint(self, step: int) -> RestoredRolloutState:
        assert self._checkpointer is not None
        loaded = self._checkpointer.load(step, extra_names=ROLLOUT_FILES)
        saved = loaded.trainer_state.get("config_fingerprint")
        if saved != fingerprint_of(rollout_config_view(self._config)):
            logger.warning(
                "resuming %s with a different rollout-relevant config (fingerprint %s)",
                loaded.uri,
                str(saved)[:12],
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
        where = source.path or "checkpoint"
        # controller state (older trainer checkpoints kept it in trainer_state.json)
        if CONTROLLER_STATE_FILE in files:
            controller = json.loads(files[CONTROLLER_STATE_FILE])
            if controller.get("schema") != CONTROLLER_STATE_SCHEMA:
                raise RestoreError(
                    f"{where}: controller state schema {controller.get('schema')!r} is not "
                    f"readable (this runtime reads {CONTROLLER_STATE_SCHEMA})"
                )
        elif fallback_state is not None:
            controller = dict(fallback_state)
        else:
            raise RestoreError(f"{where}: lacks {CONTROLLER_STATE_FILE}")
        train_step = int(controller["trainer_version"])
        # runtime state
        runtime_json = json.loads(files[RUNTIME_STATE_FILE]) if RUNTIME_STATE_FILE in files else {}
        runtime = (
            RolloutRuntimeState.from_json(runtime_json) if runtime_json else RolloutRuntimeState()
        )
        if self._config.checkpointing.deterministic and not RolloutRuntimeState.keeps_reserves(
            runtime_json
        ):
            logger.warning(
                "%s keeps no spare reserves (written by an older runtime): groups of the steps "
                "it admitted are replaced from the spare pool in finishing order, so this "
                "resume is not bit-identical until those steps are trained",
                where,
            )
        # data plane and its replay view
        dp_files = {
            name[len(DATA_PLANE_PREFIX) :]: data
            for name, data in files.items()
            if name.startswith(DATA_PLANE_PREFIX)
        }
        if dp_files:
            plane, dp_metadata = DataPlane.from_files(dp_files)
        else:
            plane, dp_metadata = DataPlane(), {}
        replay_json = controller.get("replay", dp_metadata.get("replay", []))
        replay_groups = [ReplayGroup.from_json(g) for g in replay_json]
        # the ledger, checked against what the checkpoint recorded about it
        ledger = None
        if LEDGER_FILE in files:
            facts = controller.get("rollout_recovery", {})
            recovered = read_recovery_sidecar(
                files[LEDGER_FILE],
                expected_sha256=facts.get("rollout_recovery_sha256"),
                expected_schema=facts.get("rollout_recovery_schema"),
                expected_group_count=facts.get("rollout_recovery_groups"),
            )
            ledger = recovered.ledger
            runtime.batch_shortfall = dict(recovered.batch_shortfall)
            runtime.sampler_stamps_target_steps = recovered.sampler_stamps_target_steps
            # the spare pool: schema >= 5 always carries one (maybe empty); schema 4 may not
            if recovered.spare_prompts is not None:
                runtime.spare_prompts = list(recovered.spare_prompts)
        elif self._config.uses_ledger:
            ledger = RecoveryLedger()
        # a trainer checkpoint covers every step it holds: release their replay rows
        released = set(runtime.advance_replay_anchor(anchor_step))
        replay_steps = runtime.replay_steps(anchor_step)
        expected = list(range(anchor_step + 1, train_step + 1))
        if [s.step for s in replay_steps] != expected:
            raise RestoreError(
                f"{where}: anchored to step {anchor_step} at train step {train_step}, it must "
                f"replay steps {expected}, but its journal holds "
                f"{[s.step for s in replay_steps]}"
            )
        if any(not s.row_groups and s.groups for s in replay_steps):
            raise RestoreError(f"{where}: a step to replay has no rows kept")
        # inventory, then clear what nothing references
        inventory = take_inventory(
            plane,
            replay_view=replay_groups,
            retained_row_keys=runtime.retained_row_keys(),
            ledger=ledger,
        )
        require_complete(inventory, where)
        unexpected = set(inventory.orphan_train) - released
        if unexpected:
            logger.warning("%s: clearing %d unreferenced train rows", where, len(unexpected))
        plane.clear("train", inventory.orphan_train)
        plane.clear("staging", inventory.orphan_staging)
        # the cursor must cover the restored work
        prompts = list(runtime.spare_prompts) + runtime.reserved_prompts()
        if ledger is not None:
            prompts.extend(group.prompt for group in ledger.groups())
        check_cursor(prompts, controller["dataloader"])
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
        id (the ledger mints one for every dispatched attempt not in the map).
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
                outcome = None
            if outcome is None:
                yield {}
                return
            for episode, why in outcome.refused:
                logger.warning("episode %s restarts from turn 0: %s", episode.rollout_id, why)
            yield {episode.rollout_id: episode.instance_id for episode in outcome.restored}


__all__ = [
    "RestoreError",
    "RestoredRolloutState",
    "ResumeChoice",
    "ResumeKind",
    "RolloutRestorer",
    "check_cursor",
    "prefer",
]
