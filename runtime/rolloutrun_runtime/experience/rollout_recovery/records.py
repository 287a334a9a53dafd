"""The recovery ledger's records: prompt groups -> siblings -> attempts, and their JSON.

Why a module of its own: the records are the vocabulary every reader of a rollout shares
(the controller, the snapshotter, restore, the audit), while the transition rules that change
them live in :mod:`.ledger` and the sidecar's bytes in :mod:`.sidecar`. Each record parses
itself strictly (unknown or missing fields raise ``LedgerSidecarError``), so a sidecar from a
newer or damaged writer is refused rather than half read.

Names follow the environment's episode keys: an attempt's physical rollout id is
``<group_id>_g<i>_a<uuidhex>``; its capture (row) key is that id at ``gym_attempt`` 0 and
``<rollout_id>-a<gym_attempt>`` after a turn-level restore continued it (see :mod:`.ids`).
The on-disk field names ``gym_instance_id`` and ``gym_attempt`` are kept so older sidecars
read.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rolloutrun_runtime.contract.layout import LEDGER_SCHEMA_VERSION
from rolloutrun_runtime.cow import CowMap
from rolloutrun_runtime.experience.rollout_recovery.ids import (
    RolloutIdError,
    new_uuid_hex,
    rollout_id_for,
    row_key_for,
)


class LedgerError(RuntimeError):
    """Base of the recovery ledger's errors."""


class LedgerTransitionError(LedgerError):
    """A state change that the ledger's transition rules forbid (nothing was changed)."""


class LedgerSidecarError(LedgerError):
    """A sidecar cannot be trusted: bad checksum, unknown schema or field, wrong count."""


class LedgerRestartError(LedgerError):
    """Restart normalization refused the ledger (e.g. a finalization with unknown outcome)."""


class LiveCut(Protocol):
    """A barrier cut (mutation slot or exclusive cut) that can prove it is held."""

    def require_live(self) -> None: ...


class AttemptStatus(enum.StrEnum):
    RESERVED = "reserved"
    DISPATCHED = "dispatched"
    SEALED = "sealed"
    FAILED = "failed"
    ABANDONED = "abandoned"


class GroupStatus(enum.StrEnum):
    GENERATING = "generating"
    READY_TO_FINALIZE = "ready_to_finalize"
    FINALIZING = "finalizing"
    FINALIZATION_UNKNOWN = "finalization_unknown"
    FINALIZED = "finalized"
    CLAIMED = "claimed"


class GroupPhase(enum.StrEnum):
    RESERVED = "reserved"
    ADMITTED = "admitted"


class Granularity(enum.StrEnum):
    """What a restart keeps of an unfinished group."""

    SIBLING = "sibling"
    PROMPT_GROUP = "prompt_group"


class RestoreLevel(enum.StrEnum):
    TURN = "turn"
    SIBLING = "sibling"
    PROMPT_GROUP = "prompt_group"


# ---------------------------------------------------------------------- records
@dataclass(frozen=True)
class PromptRef:
    """A dataset locator: the prompt itself is never stored, the Gym rebuilds it."""

    prompt_id: int
    epoch: int = 0
    index: int = 0

    def to_json(self) -> dict[str, int]:
        return {"prompt_id": self.prompt_id, "epoch": self.epoch, "index": self.index}

    @classmethod
    def from_json(cls, data: Any, where: str) -> PromptRef:
        fields = _strict(data, where, {"prompt_id", "epoch", "index"})
        return cls(
            prompt_id=_int(fields, "prompt_id", where),
            epoch=_int(fields, "epoch", where),
            index=_int(fields, "index", where),
        )


@dataclass(frozen=True)
class EnvironmentEpisode:
    """A backend-neutral episode name: the rollout id and the environment attempt."""

    rollout_id: str
    attempt: int = 0

    @property
    def capture_key(self) -> str:
        """The row key: the bare rollout id at attempt 0, ``<rollout_id>-a<attempt>`` after."""
        return row_key_for(self.rollout_id, self.attempt)


@dataclass
class RolloutAttempt:
    """One try at generating a sibling; append-only within its sibling."""

    attempt_uuid: str
    rollout_id: str
    status: AttemptStatus = AttemptStatus.RESERVED
    gym_instance_id: str | None = None
    gym_attempt: int = 0
    reward: float | None = None
    row_key: str | None = None
    failure: str | None = None

    @property
    def episode(self) -> EnvironmentEpisode:
        return EnvironmentEpisode(self.rollout_id, self.gym_attempt)

    def to_json(self) -> dict[str, Any]:
        # str(member), not member.value: a StrEnum's value descriptor costs twice as much,
        # and a capture under the cut calls this for every attempt of every group.
        return {
            "attempt_uuid": self.attempt_uuid,
            "rollout_id": self.rollout_id,
            "status": str(self.status),
            "gym_instance_id": self.gym_instance_id,
            "gym_attempt": self.gym_attempt,
            "reward": self.reward,
            "row_key": self.row_key,
            "failure": self.failure,
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> RolloutAttempt:
        keys = {"attempt_uuid", "rollout_id", "status", "gym_instance_id", "gym_attempt"}
        keys |= {"reward", "row_key", "failure"}
        fields = _strict(data, where, keys)
        reward = fields["reward"]
        return cls(
            attempt_uuid=str(fields["attempt_uuid"]),
            rollout_id=str(fields["rollout_id"]),
            status=_enum(AttemptStatus, fields["status"], where),
            gym_instance_id=_opt_str(fields["gym_instance_id"]),
            gym_attempt=_int(fields, "gym_attempt", where),
            reward=None if reward is None else float(reward),
            row_key=_opt_str(fields["row_key"]),
            failure=_opt_str(fields["failure"]),
        )


@dataclass
class SiblingRecord:
    """One GRPO generation slot ``<group_id>_g<i>`` and its attempts."""

    sibling_id: str
    index: int
    attempts: list[RolloutAttempt] = field(default_factory=list)

    @property
    def current(self) -> RolloutAttempt:
        return self.attempts[-1]

    @property
    def failed_attempts(self) -> int:
        return sum(a.status is AttemptStatus.FAILED for a in self.attempts)

    def to_json(self) -> dict[str, Any]:
        return {
            "sibling_id": self.sibling_id,
            "index": self.index,
            "attempts": [a.to_json() for a in self.attempts],
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> SiblingRecord:
        fields = _strict(data, where, {"sibling_id", "index", "attempts"})
        attempts = fields["attempts"]
        if not isinstance(attempts, list) or not attempts:
            raise LedgerSidecarError(f"{where}: attempts must be a non-empty list")
        return cls(
            sibling_id=str(fields["sibling_id"]),
            index=_int(fields, "index", where),
            attempts=[
                RolloutAttempt.from_json(a, f"{where}.attempts[{i}]")
                for i, a in enumerate(attempts)
            ],
        )


@dataclass
class PromptGroupRecord:
    """One admitted prompt group: where its prompt is, which step it is for, its siblings."""

    group_id: str
    admission_id: str
    prompt: PromptRef
    target_step: int | None
    start_weight_version: int
    granularity: Granularity = Granularity.SIBLING
    restore_level: RestoreLevel = RestoreLevel.SIBLING
    phase: GroupPhase = GroupPhase.RESERVED
    status: GroupStatus = GroupStatus.GENERATING
    claimed_step: int | None = None
    siblings: list[SiblingRecord] = field(default_factory=list)

    def sealed(self) -> bool:
        return all(s.current.status is AttemptStatus.SEALED for s in self.siblings)

    def to_json(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "admission_id": self.admission_id,
            "prompt_ref": self.prompt.to_json(),
            "target_step": self.target_step,
            "start_weight_version": self.start_weight_version,
            "recovery_granularity": str(self.granularity),
            "restore_level": str(self.restore_level),
            "phase": str(self.phase),
            "status": str(self.status),
            "claimed_step": self.claimed_step,
            "siblings": [s.to_json() for s in self.siblings],
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> PromptGroupRecord:
        keys = {"group_id", "admission_id", "prompt_ref", "target_step", "start_weight_version"}
        keys |= {"recovery_granularity", "restore_level", "phase", "status", "claimed_step"}
        keys |= {"siblings"}
        fields = _strict(data, where, keys)
        siblings = fields["siblings"]
        if not isinstance(siblings, list) or not siblings:
            raise LedgerSidecarError(f"{where}: siblings must be a non-empty list")
        target = fields["target_step"]
        claimed = fields["claimed_step"]
        return cls(
            group_id=str(fields["group_id"]),
            admission_id=str(fields["admission_id"]),
            prompt=PromptRef.from_json(fields["prompt_ref"], f"{where}.prompt_ref"),
            target_step=None if target is None else int(target),
            start_weight_version=_int(fields, "start_weight_version", where),
            granularity=_enum(Granularity, fields["recovery_granularity"], where),
            restore_level=_enum(RestoreLevel, fields["restore_level"], where),
            phase=_enum(GroupPhase, fields["phase"], where),
            status=_enum(GroupStatus, fields["status"], where),
            claimed_step=None if claimed is None else int(claimed),
            siblings=[
                SiblingRecord.from_json(s, f"{where}.siblings[{i}]") for i, s in enumerate(siblings)
            ],
        )


def resume_attempt_elsewhere(group: PromptGroupRecord, attempt: RolloutAttempt) -> bool:
    """Elastic members: a dispatched attempt of a generating turn-level group (sibling
    granularity) whose Gym was lost continues its episode record on another replica: same
    rollout id, ``gym_attempt + 1`` (never a number reused from an earlier turn), reserved and
    owned by no replica yet, as a restart's restored attempt is. False, changing nothing,
    for any other attempt (it restarts from turn 0 under a new rollout id)."""
    if (group.restore_level, group.granularity, group.status, attempt.status) != (
        RestoreLevel.TURN,
        Granularity.SIBLING,
        GroupStatus.GENERATING,
        AttemptStatus.DISPATCHED,
    ):
        return False
    attempt.status, attempt.gym_instance_id = AttemptStatus.RESERVED, None
    attempt.gym_attempt += 1
    return True


def encode_json(value: Any) -> str:
    """The sidecar's deterministic JSON (sorted keys, no spaces), one spelling for the whole
    document and for each group's cached part of it."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def sidecar_rest(
    spare_prompts: Iterable[PromptRef], batch_shortfall: Mapping[int, int], stamps: bool
) -> dict[str, Any]:
    """The sidecar document besides its groups."""
    return {
        "schema_version": LEDGER_SCHEMA_VERSION,
        "batch_shortfall": {str(k): int(v) for k, v in sorted(batch_shortfall.items())},
        "sampler_stamps_target_steps": bool(stamps),
        "spare_prompts": [p.to_json() for p in spare_prompts],
    }


@dataclass
class GroupTexts:
    """Each group's sidecar JSON text as of its last change (None until serialized again),
    in the ledger's group order, and the groups changed since (the ledger reports every
    change), so a capture re-serializes only those. ``texts`` is copy-on-write: a capture's
    view of it costs the entries changed since the previous capture."""

    texts: CowMap[str, str | None] = field(default_factory=CowMap)
    dirty: set[str] = field(default_factory=set)

    @classmethod
    def all_changed(cls, group_ids: Iterable[str]) -> GroupTexts:
        """Every group changed (to serialize again), in the ledger's order."""
        texts: CowMap[str, str | None] = CowMap(dict.fromkeys(group_ids))
        return cls(texts=texts, dirty=set(texts))

    def changed(self, group_id: str) -> None:
        # a new group goes to the end (the ledger has just added it there); a known one
        # keeps its place
        self.texts[group_id] = None
        self.dirty.add(group_id)

    def dropped(self, group_id: str) -> None:
        self.texts.pop(group_id, None)
        self.dirty.discard(group_id)

    def refresh(self, groups: Mapping[str, PromptGroupRecord], limit: int) -> int:
        """Serialize up to ``limit`` changed groups; returns how many it serialized."""
        done = 0
        while self.dirty and done < limit:
            group_id = self.dirty.pop()
            self.texts[group_id] = encode_json(groups[group_id].to_json())
            done += 1
        return done


# ---------------------------------------------------------------------- parsing helpers
def _strict(data: Any, where: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise LedgerSidecarError(f"{where}: expected an object, got {type(data).__name__}")
    unknown = set(data) - keys
    if unknown:
        raise LedgerSidecarError(f"{where}: unknown field(s) {sorted(unknown)}")
    missing = keys - set(data)
    if missing:
        raise LedgerSidecarError(f"{where}: missing field(s) {sorted(missing)}")
    return data


def _int(fields: Mapping[str, Any], key: str, where: str) -> int:
    value = fields[key]
    if not isinstance(value, int) or isinstance(value, bool):
        raise LedgerSidecarError(f"{where}.{key}: expected an integer, got {value!r}")
    return value


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def _enum(kind: type[enum.Enum], value: Any, where: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise LedgerSidecarError(
            f"{where}: {value!r} is not a valid {kind.__name__} "
            f"({', '.join(str(m.value) for m in kind)})"
        ) from None


@dataclass
class RestartReport:
    """What ``prepare_for_restart`` changed."""

    abandoned: list[EnvironmentEpisode] = field(default_factory=list)
    resumed: list[EnvironmentEpisode] = field(default_factory=list)
    minted: list[str] = field(default_factory=list)
    unclaimed_groups: list[str] = field(default_factory=list)
    stale_row_keys: list[str] = field(default_factory=list)


def relaunch_reason(status: AttemptStatus) -> str:
    """Why a restart abandons an attempt in ``status`` that the environment did not restore
    (its sibling is relaunched under a new rollout id, a fresh side-effect revision space)."""
    if status is AttemptStatus.RESERVED:
        return "restart: reserved at the cut (it may have run after it); relaunched as new"
    return "restart"


def new_attempt(sibling_id: str, attempt_uuid: str | None = None) -> RolloutAttempt:
    """A fresh reserved attempt with a physical rollout id ``<sibling_id>_a<uuidhex>``."""
    attempt_uuid = attempt_uuid or new_uuid_hex()
    try:
        rollout_id = rollout_id_for(sibling_id, attempt_uuid)
    except RolloutIdError as error:
        raise LedgerError(str(error)) from None
    return RolloutAttempt(attempt_uuid=attempt_uuid, rollout_id=rollout_id)
