"""Shared rollout state: what the pumps change and every checkpoint saves.

Why one place: trainer checkpoints and rollout snapshots must save the same rollout state
under the same exclusive cut, and a restore must fill it before the pumps start. Keeping it
in one ``RolloutRuntimeState`` that the controller owns (and nothing else copies) means a
new piece of rollout state is saved by every checkpoint kind as soon as it is added here.

``RolloutParts`` is the bundle of controller parts both checkpoint halves read; of those,
only ``runtime_state`` changes. The halves read live training counters through
``read_progress`` and never touch controller fields.

Deterministic mode keeps each admitted step's **spare reserve** here too (``StepReserve``,
``Leftover``): the prompts that replace the step's dropped groups are set aside when the
step is admitted, bound to its slots, and handed on to later steps when unused, so which
prompt replaces which group never depends on finishing order. They are rollout state like
the spare pool: saved by every checkpoint and counted as pending by the audit.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from rolloutrun_runtime.algorithms.replay_buffer import ReplayGroup
from rolloutrun_runtime.cow import CowMap
from rolloutrun_runtime.experience.rollout_recovery import PromptRef

if TYPE_CHECKING:
    from rolloutrun_runtime.algorithms.replay_buffer import ReplayBuffer
    from rolloutrun_runtime.algorithms.samplers import InOrderSampler, PromptDataloader
    from rolloutrun_runtime.contract.run_config import RunConfig
    from rolloutrun_runtime.data_plane import DataPlane, DataPlaneBarrier
    from rolloutrun_runtime.environments.checkpointing import (
        EnvironmentEpisode,
        EnvironmentSnapshot,
    )
    from rolloutrun_runtime.experience.rollout_recovery import RecoveryLedger, SidecarCapture

#: Schema of ``RolloutRuntimeState.to_json``; bump it when the saved fields change.
#: 2 added the training journal and the steps trained since the anchor (schema 1 still reads,
#: with both empty); 3 added the deterministic spare reserves (``step_reserves``,
#: ``leftovers``; schemas 1 and 2 read with none).
RUNTIME_STATE_SCHEMA = 3
READABLE_RUNTIME_STATE_SCHEMAS = (1, 2, 3)
#: Schema of ``training_journal.json``.
TRAINING_JOURNAL_SCHEMA = 1

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
class StepReserve:
    """One admitted step's prompts, in slot order, and its spare reserve (deterministic mode).

    Slot ``i`` is the ``i``-th prompt of the step's reservation. With ``k`` reserve prompts
    per slot (``len(reserve) == k * len(prompts)``), slot ``i`` owns ``reserve[i*k:(i+1)*k]``:
    a dropped group of slot ``i`` is replaced by the slot's next unused one, so the choice is
    a function of the slot, never of which group finished first.
    """

    prompts: tuple[PromptRef, ...]
    reserve: tuple[PromptRef, ...]
    used: list[bool]

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("a step reserve needs at least one slot")
        if len(self.used) != len(self.reserve):
            raise ValueError(
                f"a step reserve has {len(self.reserve)} prompts but {len(self.used)} used flags"
            )
        if len(self.reserve) % len(self.prompts):
            raise ValueError(
                f"a step reserve of {len(self.reserve)} prompts does not split over "
                f"{len(self.prompts)} slots"
            )

    @property
    def per_slot(self) -> int:
        return len(self.reserve) // len(self.prompts)

    def next_unused(self, slot: int) -> int | None:
        """The reserve position slot ``slot`` would use next (None: its reserve is spent)."""
        start = slot * self.per_slot
        for position in range(start, start + self.per_slot):
            if not self.used[position]:
                return position
        return None

    def place_of(self, prompt_id: int, epoch: int) -> tuple[int, int] | None:
        """``(slot, replacement)`` of a prompt of this step: 0 for the slot's own prompt,
        ``j + 1`` for its ``j``-th reserve prompt; None when the prompt is not this step's.
        ``(prompt_id, epoch)`` names one drawn prompt (an epoch draws each prompt once)."""
        for slot, prompt in enumerate(self.prompts):
            if (prompt.prompt_id, prompt.epoch) == (prompt_id, epoch):
                return slot, 0
        for position, prompt in enumerate(self.reserve):
            if (prompt.prompt_id, prompt.epoch) == (prompt_id, epoch):
                return divmod(position, self.per_slot)[0], position % self.per_slot + 1
        return None

    def unused(self) -> list[tuple[int, PromptRef]]:
        """``(position, prompt)`` of every reserve prompt not used (yet)."""
        return [(i, p) for i, p in enumerate(self.reserve) if not self.used[i]]

    def to_json(self) -> dict[str, Any]:
        return {
            "prompts": [p.to_json() for p in self.prompts],
            "reserve": [p.to_json() for p in self.reserve],
            "used": list(self.used),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> StepReserve:
        return cls(
            prompts=tuple(
                PromptRef.from_json(p, f"{where}.prompts[{i}]")
                for i, p in enumerate(data["prompts"])
            ),
            reserve=tuple(
                PromptRef.from_json(p, f"{where}.reserve[{i}]")
                for i, p in enumerate(data["reserve"])
            ),
            used=[bool(u) for u in data["used"]],
        )


@dataclass(frozen=True)
class Leftover:
    """An unused reserve prompt of a committed step, waiting for a later step's reserve."""

    step: int
    position: int
    prompt: PromptRef

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "position": self.position, "prompt": self.prompt.to_json()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str) -> Leftover:
        return cls(
            step=int(data["step"]),
            position=int(data["position"]),
            prompt=PromptRef.from_json(data["prompt"], f"{where}.prompt"),
        )


def take_leftovers(
    leftovers: list[Leftover], newest_trained: int, count: int
) -> tuple[list[Leftover], list[Leftover]]:
    """``(taken, kept)``: up to ``count`` leftovers of steps ``<= newest_trained``, in
    ``(step, position)`` order.

    Only steps certainly trained when the taking step is admitted may give: whether a later
    step has committed by then is timing, and so would be the prompts it hands on.
    """
    eligible = sorted(
        (left for left in leftovers if left.step <= newest_trained),
        key=lambda left: (left.step, left.position),
    )
    taken = eligible[: max(0, count)]
    chosen = set(taken)
    return taken, [left for left in leftovers if left not in chosen]


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
    finalizer_results: dict[str, FinalizerResult] = field(default_factory=CowMap)
    """Finalized groups' results, kept until the group is trained (copy-on-write: a
    capture's view costs the results changed since the previous one)."""
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
    step_reserves: dict[int, StepReserve] = field(default_factory=dict)
    """Deterministic mode: per admitted, uncommitted step, its slots and spare reserve. A
    step without one (admitted by a runtime that kept none) drops groups as in
    asynchronous mode."""
    leftovers: list[Leftover] = field(default_factory=list)
    """Deterministic mode: unused reserve prompts of committed steps, for later reserves."""
    step_rewards: dict[int, list[float]] = field(default_factory=dict)
    """Per stamped, uncommitted step, the rewards of its rollouts in groups finalized or
    dropped so far (the step record's ``reward_mean``): saved, so that a step trained after
    a restore reports the rollouts generated before it too."""

    def shortfall(self, step: int) -> int:
        return self.batch_shortfall.get(step, 0)

    def forget_step(self, step: int) -> None:
        """Drop per-step bookkeeping of a committed step."""
        self.batch_shortfall.pop(step, None)
        self.replacements.pop(step, None)

    def reserve_step(
        self,
        step: int,
        prompts: list[PromptRef],
        count: int,
        *,
        newest_trained: int,
        draw: Callable[[int], list[PromptRef]],
    ) -> StepReserve:
        """Set aside ``count`` reserve prompts for ``step`` (call where the step is admitted).

        First prompts left in the spare pool (only a resume of a runtime that kept one in
        deterministic mode leaves any), then leftovers of steps ``<= newest_trained``, then
        ``draw`` (the dataloader) for the rest.
        """
        if step in self.step_reserves:
            raise ValueError(f"step {step} already has a spare reserve")
        reserve = self.spare_prompts[:count]
        del self.spare_prompts[: len(reserve)]
        taken, self.leftovers = take_leftovers(self.leftovers, newest_trained, count - len(reserve))
        reserve += [left.prompt for left in taken]
        if len(reserve) < count:
            reserve += draw(count - len(reserve))
        record = StepReserve(tuple(prompts), tuple(reserve), [False] * len(reserve))
        self.step_reserves[step] = record
        return record

    def commit_reserve(self, step: int) -> list[Leftover]:
        """``step`` committed: its unused reserve prompts become leftovers (returned)."""
        record = self.step_reserves.pop(step, None)
        if record is None:
            return []
        handed_on = [Leftover(step, position, prompt) for position, prompt in record.unused()]
        self.leftovers.extend(handed_on)
        return handed_on

    def place_of(self, step: int | None, prompt_id: int, epoch: int) -> tuple[int, int] | None:
        """``(slot, replacement)`` of a group of ``step`` (None: no reserve or not found)."""
        record = self.step_reserves.get(step) if step is not None else None
        return record.place_of(prompt_id, epoch) if record is not None else None

    def reserved_prompts(self) -> list[PromptRef]:
        """Reserve prompts drawn and not (yet) admitted as a group: pending, like spares."""
        unused = [p for record in self.step_reserves.values() for _, p in record.unused()]
        return unused + [left.prompt for left in self.leftovers]

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
        # an entry already without rows stays the same object (a snapshot's writer keeps
        # each entry's JSON by identity: see ``sidecars.SidecarFragments``)
        self.journal = [
            entry
            if entry.step > durable_step or not entry.row_groups
            else TrainedStep(entry.step, entry.groups, (), entry.dropped)
            for entry in self.journal
        ]
        self.replay_after = durable_step
        return released

    def journal_json(self) -> dict[str, Any]:
        """``training_journal.json``: every committed step once, in order."""
        return training_journal_json(self.journal, self.pending_drops)

    def to_json(self, *, results: bool = True, journal: bool = True) -> dict[str, Any]:
        """The saved form; ``results=False`` leaves out ``finalizer_results`` (one per
        buffered group; a capture shares the records and adds their JSON after its cut),
        ``journal=False`` the journal (one entry per step trained; a capture shares the
        frozen entries and adds :func:`journal_entries_json` after its cut)."""
        data: dict[str, Any] = {
            "schema": RUNTIME_STATE_SCHEMA,
            "pending_drops": [p.to_json() for p in self.pending_drops],
            "replay_after": self.replay_after,
            "spare_prompts": [p.to_json() for p in self.spare_prompts],
            "batch_shortfall": {str(k): v for k, v in sorted(self.batch_shortfall.items())},
            "replacements": {str(k): v for k, v in sorted(self.replacements.items())},
            "sampler_stamps_target_steps": self.sampler_stamps_target_steps,
            "step_reserves": {
                str(step): record.to_json() for step, record in sorted(self.step_reserves.items())
            },
            "leftovers": [left.to_json() for left in self.leftovers],
            "step_rewards": {str(k): v for k, v in sorted(self.step_rewards.items())},
        }
        if journal:
            data["journal"] = journal_entries_json(self.journal)
        if results:
            data["finalizer_results"] = [r.to_json() for r in self.finalizer_results.values()]
        return data

    @staticmethod
    def keeps_reserves(data: Mapping[str, Any]) -> bool:
        """Whether a saved state records spare reserves (schema 3 on; older ones did not)."""
        return "step_reserves" in data

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
            finalizer_results=CowMap((r.group_id, r) for r in results),
            journal=journal,
            pending_drops=[
                PromptRef.from_json(p, f"pending_drops[{i}]")
                for i, p in enumerate(data.get("pending_drops", []))
            ],
            replay_after=int(data.get("replay_after", 0)),
            step_reserves={
                int(step): StepReserve.from_json(record, f"step_reserves[{step}]")
                for step, record in data.get("step_reserves", {}).items()
            },
            leftovers=[
                Leftover.from_json(left, f"leftovers[{i}]")
                for i, left in enumerate(data.get("leftovers", []))
            ],
            step_rewards={
                int(step): [float(r) for r in rewards]
                for step, rewards in data.get("step_rewards", {}).items()
            },
        )


def journal_entry_json(entry: TrainedStep) -> dict[str, Any]:
    """One entry of the runtime state's ``journal``: the step's journal entry and its kept
    row groups."""
    return {**entry.journal_json(), "row_groups": [g.to_json() for g in entry.row_groups]}


def journal_entries_json(journal: Sequence[TrainedStep]) -> list[dict[str, Any]]:
    """The runtime state's ``journal``: each step's :func:`journal_entry_json`."""
    return [journal_entry_json(entry) for entry in journal]


def training_journal_json(
    journal: Sequence[TrainedStep], pending_drops: Sequence[PromptRef]
) -> dict[str, Any]:
    """``training_journal.json``: every committed step once, in order."""
    steps = [entry.journal_json() for entry in journal]
    if pending_drops and journal:
        # drops since the last commit: listed under it here, under the next step once
        # that one commits (each checkpoint's journal lists every drop exactly once)
        steps[-1] = journal[-1].journal_json(tuple(pending_drops))
    return {"schema": TRAINING_JOURNAL_SCHEMA, "steps": steps}


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


@dataclass
class RolloutParts:
    """The controller parts both checkpoint halves read (the run state's; a restore
    refills them in place, so the snapshotter holds this one object for the whole run)."""

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

    Everything here is a copy or immutable: the pumps may change the live state as soon as
    the cut is left, while these are serialized and written. The large parts are shared, not
    copied, and taken in time proportional to what changed since the previous capture (the
    cut's cost does not grow with the buffer): the replay view, the data plane, the ledger's
    group texts and the finalizer results are copy-on-write views (:mod:`rolloutrun_runtime.
    cow`) of frozen records, row dicts that are replaced and never mutated, and JSON text;
    the journal is its frozen entries. Their JSON is made after the cut.
    """

    kind: CaptureKind
    train_step: int
    mutation_version: int
    cut_time: float
    controller_state: dict[str, Any]
    """Dataloader, sampler, replay view, counters: ``rollout/controller_state.json``."""
    data_plane: DataPlane
    data_plane_metadata: dict[str, Any]
    runtime_state_rest: dict[str, Any]
    """The runtime state's JSON but its journal and finalizer results (small)."""
    journal_entries: tuple[TrainedStep, ...] = ()
    pending_drops: tuple[PromptRef, ...] = ()
    ledger_capture: SidecarCapture | None = None
    """The ledger sidecar (each group's JSON text), taken under the cut; joined after it."""
    replay_view: Sequence[ReplayGroup] = ()
    """The replay view at the cut; its JSON (``controller_state["replay"]``) is made after."""
    restart_from_turn_zero: Mapping[EnvironmentEpisode, str] = field(default_factory=dict)
    """Episodes the saved ledger marks abandoned (no environment record), applied after the
    cut; ``restarted_from_turn_zero`` counts the attempts it marked."""
    restarted_from_turn_zero: int = 0
    retained_row_keys: tuple[str, ...] = ()
    staging_refs: set[str] | None = None
    """What the inventory expects besides the replay view (taken under the cut, compared
    with the data plane copy after it)."""
    finalizer_results: Iterable[FinalizerResult] = ()
    """``runtime_state["finalizer_results"]`` at the cut (never mutated); JSON made after."""
    environment_snapshot: EnvironmentSnapshot | None = None
    """The environment's records still out at the cut; encoded with the files, off the loop."""

    @cached_property
    def runtime_state(self) -> dict[str, Any]:
        """``RolloutRuntimeState.to_json(results=False)`` at the cut (made after it)."""
        return {**self.runtime_state_rest, "journal": journal_entries_json(self.journal_entries)}

    @cached_property
    def journal(self) -> dict[str, Any]:
        """``training_journal.json`` at the cut (made after it)."""
        return training_journal_json(self.journal_entries, self.pending_drops)
