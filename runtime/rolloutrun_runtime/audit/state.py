"""What the audit reads, already parsed: the loaded :class:`DurableState` and its parts.

Why a module of plain frozen records: the checks are pure functions over these, table-tested
against doctored states, so the shapes they read are kept apart from both the I/O that
fills them (:mod:`.durable`, :mod:`.side_effects`) and the checks that judge them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: How many example ids each report lists (the counts are always complete).
EXAMPLES = 20


class AuditError(RuntimeError):
    """The durable state cannot be read well enough to audit it."""


# --------------------------------------------------------------------------- loaded state
@dataclass(frozen=True)
class Prompt:
    """A dataset locator as the checkpoint saves it (``prompt_id`` within ``epoch``)."""

    prompt_id: int
    epoch: int


@dataclass(frozen=True)
class LedgerAttempt:
    rollout_id: str
    status: str
    gym_attempt: int
    row_key: str | None


@dataclass(frozen=True)
class LedgerGroup:
    group_id: str
    prompt: Prompt
    status: str
    restore_level: str
    attempts: tuple[LedgerAttempt, ...]


@dataclass(frozen=True)
class SideEffect:
    """One line of a Gym audit file."""

    source: str
    rollout_id: str
    attempt: int
    revision: int
    turn: int


@dataclass
class TornRecords:
    """Side-effect records that cannot be read (see the module doc).

    ``places`` (``file:line`` inside an audit file, or an object's key) fail the audit;
    ``tails`` (an audit file's unterminated last line) are reported and tolerated.
    """

    places: list[str] = field(default_factory=list)
    tails: list[str] = field(default_factory=list)


@dataclass
class DurableState:
    """Everything the audit reads, already parsed (the checks never touch storage)."""

    source: str
    step: int
    dataset_size: int
    cursor_epoch: int
    cursor_position: int
    permutations: dict[int, list[int]] | None
    """Per epoch, the drawn order (None when the seed is unknown: counts are used)."""
    trained: list[tuple[int, Prompt]]
    """``(step, prompt)`` for every group the journal says was trained, in order."""
    dropped: list[Prompt] = field(default_factory=list)
    ledger: list[LedgerGroup] = field(default_factory=list)
    spare: list[Prompt] = field(default_factory=list)
    reserved: list[Prompt] = field(default_factory=list)
    """Deterministic spare reserves drawn and not admitted (unused or handed on)."""
    replay: list[dict[str, Any]] = field(default_factory=list)
    staging_keys: list[str] = field(default_factory=list)
    train_keys: list[str] = field(default_factory=list)
    retained_train_keys: list[str] = field(default_factory=list)
    side_effects: list[SideEffect] = field(default_factory=list)
    torn_audit: TornRecords = field(default_factory=TornRecords)
    max_steps: int | None = None
