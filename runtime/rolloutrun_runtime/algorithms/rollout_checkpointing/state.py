"""Shared rollout state: what the pumps change and every checkpoint saves.

Why one place: trainer checkpoints and rollout snapshots must save the same rollout state
under the same exclusive cut, and a restore must fill it before the pumps start. Keeping it
in one ``RolloutRuntimeState`` that the controller owns (and nothing else copies) means a
new piece of rollout state is saved by every checkpoint kind as soon as it is added here.

``RolloutParts`` is the bundle of controller parts both checkpoint halves read; of those,
only ``runtime_state`` changes. The halves read live training counters through
``read_progress`` and never touch controller fields.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.experience.rollout_recovery import PromptRef

if TYPE_CHECKING:
    from rolloutrun_runtime.algorithms.replay_buffer import ReplayBuffer
    from rolloutrun_runtime.algorithms.samplers import InOrderSampler, PromptDataloader
    from rolloutrun_runtime.config import RunConfig
    from rolloutrun_runtime.data_plane import DataPlane, DataPlaneBarrier
    from rolloutrun_runtime.experience.rollout_recovery import RecoveryLedger

#: Schema of ``RolloutRuntimeState.to_json``; bump it when the saved fields change.
#: 2 added the training journal and the steps trained since the anchor (schema 1 still reads,
#: with both empty).
RUNTIME_STATE_SCHEMA = 2
READABLE_RUNTIME_STATE_SCHEMAS = (1, 2)
#: Schema of ``training_journal.json``.
TRAINING_JOURNAL_SCHEMA = 1

#: File names inside a trainer checkpoint and a rollout snapshot: both halves write or read
#: them, and they never import each other.
CONTROLLER_STATE_FILE = "rollout/controller_state.json"
RUNTIME_STATE_FILE = "rollout/runtime_state.json"
LEDGER_FILE = "rollout/rollout_recovery.json"
JOURNAL_FILE = "training_journal.json"
ENVIRONMENT_FILE = "environment/episodes.json"
DATA_PLANE_PREFIX = "data_plane/"
#: Format of ``rollout/controller_state.json``.
CONTROLLER_STATE_SCHEMA = 1


@dataclass(frozen=True)
class JournalGroup:
    """One group a train step trained, as the auditor reads it."""

    group_id: str
    prompt_id: int
    epoch: int
    target_step: int | None

    def to_json(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "prompt_id": self.prompt_id,
            "epoch": self.epoch,
            "target_step": self.target_step,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JournalGroup:
        target = data.get("target_step")
        return cls(
            group_id=str(data["group_id"]),
            prompt_id=int(data["prompt_id"]),
            epoch=int(data.get("epoch", 0)),
            target_step=None if target is None else int(target),
        )


@dataclass(frozen=True)
class TrainedStep:
    """A committed train step: which groups it trained, in order (the journal's unit).

    ``row_groups`` are the replay groups whose ``train`` rows stay in the data plane until a
    trainer checkpoint at or after this step is durable: a snapshot anchored to an older
    checkpoint replays them (retrains them, in this order) on resume.
    """

    step: int
    groups: tuple[JournalGroup, ...]
    row_groups: tuple[ReplayGroup, ...] = ()
    dropped: tuple[PromptRef, ...] = ()
    """Prompts given up (no learning signal, attempts exhausted, stale) since the previous
    step: drawn, never trained, and not lost."""

    def journal_json(self, extra_dropped: tuple[PromptRef, ...] = ()) -> dict[str, Any]:
        return {
            "step": self.step,
            "weight_version_before": self.step - 1,
            "groups": [g.to_json() for g in self.groups],
            "dropped": [
                {"prompt_id": p.prompt_id, "epoch": p.epoch}
                for p in (*self.dropped, *extra_dropped)
            ],
        }


@dataclass
class FinalizerResult:
    """What finalizing a group produced, kept until the group is trained (for metrics)."""

    group_id: str
    target_step: int | None
    rewards: list[float]
    model_tokens: int
    tokens_by_version: dict[int, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "target_step": self.target_step,
            "rewards": list(self.rewards),
            "model_tokens": self.model_tokens,
            "tokens_by_version": {str(k): v for k, v in sorted(self.tokens_by_version.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FinalizerResult:
        return cls(
            group_id=str(data["group_id"]),
            target_step=None if data["target_step"] is None else int(data["target_step"]),
            rewards=[float(r) for r in data["rewards"]],
            model_tokens=int(data["model_tokens"]),
            tokens_by_version={int(k): int(v) for k, v in data["tokens_by_version"].items()},
        )


@dataclass
class RolloutRuntimeState:
    """Rollout state the pumps change and every checkpoint saves (one instance per run)."""

    spare_prompts: list[PromptRef] = field(default_factory=list)
    """Prompts drawn from the dataloader but not admitted; they replace dropped groups."""
    batch_shortfall: dict[int, int] = field(default_factory=dict)
    """Per stamped step, how many groups were given up (the step closes short)."""
    replacements: dict[int, int] = field(default_factory=dict)
    """Per stamped step, how many dropped groups were replaced from the spare pool."""
    sampler_stamps_target_steps: bool = True
    """Whether admitted groups carry a target step (the in-order sampler)."""
    finalizer_results: dict[str, FinalizerResult] = field(default_factory=dict)
    """Finalized groups' results, kept until the group is trained."""
    open_step_groups: list[ReplayGroup] = field(default_factory=list)
    """Groups the unfinished train step selected (claimed in the ledger, rows still in the
    data plane). Not saved as such: a snapshot re-indexes them into its replay view, and a
    trainer checkpoint is never taken inside a step."""
    journal: list[TrainedStep] = field(default_factory=list)
    """Every committed step since step 1 (cumulative): the training journal."""
    pending_drops: list[PromptRef] = field(default_factory=list)
    """Prompts given up since the last committed step (the next journal entry lists them)."""
    replay_after: int = 0
    """Steps after this one keep their ``train`` rows (``TrainedStep.row_groups``) until a
    trainer checkpoint covering them is durable; it is the newest durable step."""

    def shortfall(self, step: int) -> int:
        return self.batch_shortfall.get(step, 0)

    def forget_step(self, step: int) -> None:
        """Drop per-step bookkeeping of a committed step."""
        self.batch_shortfall.pop(step, None)
        self.replacements.pop(step, None)

    def replay_steps(self, anchor_step: int) -> list[TrainedStep]:
        """The committed steps after ``anchor_step`` (retrained on a resume from it)."""
        return [entry for entry in self.journal if entry.step > anchor_step]

    def retained_row_keys(self) -> list[str]:
        """``train`` rows kept for replay (steps after ``replay_after``)."""
        return [
            key
            for entry in self.replay_steps(self.replay_after)
            for group in entry.row_groups
            for key in group.row_keys
        ]

    def advance_replay_anchor(self, durable_step: int) -> list[str]:
        """A trainer checkpoint at ``durable_step`` is durable: release the rows it covers.

        Returns the ``train`` row keys no snapshot needs any more (clear them under a cut).
        """
        if durable_step <= self.replay_after:
            return []
        released = [
            key
            for entry in self.journal
            if self.replay_after < entry.step <= durable_step
            for group in entry.row_groups
            for key in group.row_keys
        ]
        self.journal = [
            entry
            if entry.step > durable_step
            else TrainedStep(entry.step, entry.groups, (), entry.dropped)
            for entry in self.journal
        ]
        self.replay_after = durable_step
        return released

    def journal_json(self) -> dict[str, Any]:
        """``training_journal.json``: every committed step once, in order."""
        steps = [entry.journal_json() for entry in self.journal]
        if self.pending_drops and self.journal:
            # drops since the last commit: listed under it here, under the next step once
            # that one commits (each checkpoint's journal lists every drop exactly once)
            steps[-1] = self.journal[-1].journal_json(tuple(self.pending_drops))
        return {"schema": TRAINING_JOURNAL_SCHEMA, "steps": steps}

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": RUNTIME_STATE_SCHEMA,
            "journal": [
                {**entry.journal_json(), "row_groups": [g.to_json() for g in entry.row_groups]}
                for entry in self.journal
            ],
            "pending_drops": [p.to_json() for p in self.pending_drops],
            "replay_after": self.replay_after,
            "spare_prompts": [p.to_json() for p in self.spare_prompts],
            "batch_shortfall": {str(k): v for k, v in sorted(self.batch_shortfall.items())},
            "replacements": {str(k): v for k, v in sorted(self.replacements.items())},
            "sampler_stamps_target_steps": self.sampler_stamps_target_steps,
            "finalizer_results": [r.to_json() for r in self.finalizer_results.values()],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RolloutRuntimeState:
        if data.get("schema") not in READABLE_RUNTIME_STATE_SCHEMAS:
            raise ValueError(
                f"rollout runtime state schema {data.get('schema')!r} is not readable "
                f"(this runtime reads {READABLE_RUNTIME_STATE_SCHEMAS})"
            )
        journal = [
            TrainedStep(
                step=int(entry["step"]),
                groups=tuple(JournalGroup.from_json(g) for g in entry["groups"]),
                row_groups=tuple(ReplayGroup.from_json(g) for g in entry.get("row_groups", [])),
                dropped=tuple(
                    PromptRef(int(d["prompt_id"]), int(d.get("epoch", 0)))
                    for d in entry.get("dropped", [])
                ),
            )
            for entry in data.get("journal", [])
        ]
        results = [FinalizerResult.from_json(r) for r in data["finalizer_results"]]
        return cls(
            spare_prompts=[
                PromptRef.from_json(p, f"spare_prompts[{i}]")
                for i, p in enumerate(data["spare_prompts"])
            ],
            batch_shortfall={int(k): int(v) for k, v in data["batch_shortfall"].items()},
            replacements={int(k): int(v) for k, v in data["replacements"].items()},
            sampler_stamps_target_steps=bool(data["sampler_stamps_target_steps"]),
            finalizer_results={r.group_id: r for r in results},
            journal=journal,
            pending_drops=[
                PromptRef.from_json(p, f"pending_drops[{i}]")
                for i, p in enumerate(data.get("pending_drops", []))
            ],
            replay_after=int(data.get("replay_after", 0)),
        )


@dataclass(frozen=True)
class TrainingProgress:
    """The controller's live training counters, as ``read_progress`` returns them."""

    trainer_version: int
    """Optimizer steps applied (the weight version the trainer holds)."""
    optimizer_commit_in_progress: bool
    """True between applying a step and clearing its rows: no snapshot may cut here."""
    durable_step: int | None
    """The newest trainer checkpoint step that is published, if any."""
    max_steps: int


@dataclass(frozen=True)
class ResumeSource:
    """What setup restored from; the defaults describe a fresh run."""

    path: str | None = None
    is_rollout_snapshot: bool = False
    step: int = 0
    data_plane_metadata: Mapping[str, Any] = field(default_factory=dict)
    load_timings: Mapping[str, float] = field(default_factory=dict)

    @property
    def fresh(self) -> bool:
        return self.path is None


@dataclass(frozen=True)
class RolloutParts:
    """The controller parts both checkpoint halves read (only ``runtime_state`` changes)."""

    config: RunConfig
    data_plane: DataPlane
    barrier: DataPlaneBarrier
    buffer: ReplayBuffer
    dataloader: PromptDataloader
    sampler: InOrderSampler
    ledger: RecoveryLedger | None
    runtime_state: RolloutRuntimeState
    save_lock: asyncio.Lock
    read_progress: Callable[[], TrainingProgress]
    log_metrics: Callable[[Mapping[str, float]], None]
    environment_checkpoint: object | None = None


class CaptureKind(enum.StrEnum):
    """Which checkpoint a capture is for (the seed's table of differences)."""

    TRAINER_CHECKPOINT = "trainer_checkpoint"
    ROLLOUT_SNAPSHOT = "rollout_snapshot"


@dataclass
class CapturedRolloutState:
    """In-memory copies of the rollout state taken under the exclusive cut.

    Everything here is a copy: the pumps may change the live state as soon as the cut is
    left, while these are serialized and written.
    """

    kind: CaptureKind
    train_step: int
    mutation_version: int
    cut_time: float
    controller_state: dict[str, Any]
    """Dataloader, sampler, replay view, counters: ``rollout/controller_state.json``."""
    data_plane: DataPlane
    data_plane_metadata: dict[str, Any]
    runtime_state: dict[str, Any]
    journal: dict[str, Any]
    ledger_document: dict[str, Any] | None = None
    """The ledger sidecar as dicts, taken under the cut; serialized after it."""
    environment_snapshot: bytes | None = None
