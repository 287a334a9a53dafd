"""``rolloutrun audit RUN_DIR``: prove from durable state alone that a run lost nothing.

Why from durable state only: a crash tears memory, logs and in-flight writes, so a claim
that "no prompt was lost and none trained twice" is only worth something if it is checked
against what a restart would read: the newest committed trainer checkpoint (or snapshot) of
the run's storage and the Gym replicas' side-effect records (audit files, or objects under
the storage's ``gym-audit/``). Nothing here reads metrics, the trace or a process's memory.

The loading is thin I/O (:func:`load_durable_state`); every check is a pure function over
the loaded :class:`DurableState` and returns its own small report, so each one is
table-tested against doctored states:

* **prompts** — for every epoch up to the final dataloader cursor, each drawn prompt
  (from the per-epoch permutation, a pure function of seed and epoch) is trained exactly
  once (the training journal), still pending (ledger, spare pool, deterministic spare
  reserves, replay view), or recorded as dropped by the journal. ``lost`` counts drawn
  prompts that are none of these; ``duplicated`` counts prompts trained more than once
  within an epoch; ``undrawn`` counts trained or pending prompts beyond the cursor (a cursor
  that went backwards).
* **side effects** — no ``(rollout_id, revision)`` appears twice across the Gym audit files
  and the ``gym-audit/`` objects of the run's storage (across replicas, in the run-wide
  ``<rollout>/<revision>.json`` layout and the older per-replica one). An unreadable line
  inside an audit file, or an unreadable object, fails the audit (named by file and line,
  or key): a record that cannot be read may hide a duplicate. An audit file's unterminated
  last line is a torn tail (a crash mid-append; its effect was never applied, and the
  writer cuts it when it reopens the file): reported, tolerated, not counted as applied.
* **gym attempts** — per rollout, the environment attempt recorded with its effects never
  goes back (one more per turn-level restore; an older attempt applying an effect after a
  newer one is a zombie), the ledger's ``gym_attempt`` is never behind what the environment
  applied, and only turn-level groups have ``gym_attempt > 0``.
* **rows** — every ``staging`` row of the data plane is referenced by a ledger attempt,
  every ``train`` row belongs to a replay group (or a step kept for replay), and the replay
  view holds exactly the ledger's finalized groups.

Exit 0 only when every check holds; 1 when one fails; 2 when the state cannot be read.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

AUDIT_SCHEMA = 1
JOURNAL_FILE = "training_journal.json"
TRAINER_STATE_FILE = "trainer_state.json"
SNAPSHOT_STATE_FILE = "rollout/controller_state.json"
LEDGER_FILE = "rollout/rollout_recovery.json"
RUNTIME_STATE_FILE = "rollout/runtime_state.json"
DATA_PLANE_METADATA = "data_plane/metadata.json"
GYM_AUDIT_GLOB = "gym-*.audit.jsonl"
#: Under the run's storage: ``rolloutrun gym --audit-uri`` objects (gs:// cluster runs).
GYM_AUDIT_PREFIX = "gym-audit"
_STEP_ENTRY = re.compile(r"^step_(\d+)$")
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


# --------------------------------------------------------------------------- checks
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


# --------------------------------------------------------------------------- parsing
def parse_journal(document: Mapping[str, Any], where: str) -> tuple[list, list[Prompt]]:
    """``training_journal.json`` -> ``([(step, Prompt)], dropped)``; unknown schema fails."""
    if document.get("schema") != 1:
        raise AuditError(f"{where}: unknown training journal schema {document.get('schema')!r}")
    trained: list[tuple[int, Prompt]] = []
    dropped: list[Prompt] = []
    previous = 0
    for entry in document.get("steps", []):
        step = int(entry["step"])
        if step <= previous:
            raise AuditError(f"{where}: journal steps out of order ({previous} then {step})")
        previous = step
        for group in entry.get("groups", []):
            trained.append((step, Prompt(int(group["prompt_id"]), int(group.get("epoch", 0)))))
        for group in entry.get("dropped", []):
            dropped.append(Prompt(int(group["prompt_id"]), int(group.get("epoch", 0))))
    return trained, dropped


def parse_ledger(document: Mapping[str, Any]) -> tuple[list[LedgerGroup], list[Prompt]]:
    """The sidecar's groups and spare pool (the schema is checked by the ledger's reader)."""
    groups = []
    for group in document.get("groups", []):
        ref = group["prompt_ref"]
        attempts = tuple(
            LedgerAttempt(
                rollout_id=str(a["rollout_id"]),
                status=str(a["status"]),
                gym_attempt=int(a["gym_attempt"]),
                row_key=a.get("row_key"),
            )
            for sibling in group["siblings"]
            for a in sibling["attempts"]
        )
        groups.append(
            LedgerGroup(
                group_id=str(group["group_id"]),
                prompt=Prompt(int(ref["prompt_id"]), int(ref["epoch"])),
                status=str(group["status"]),
                restore_level=str(group["restore_level"]),
                attempts=attempts,
            )
        )
    spare = [
        Prompt(int(p["prompt_id"]), int(p["epoch"])) for p in document.get("spare_prompts", [])
    ]
    return groups, spare


def parse_reserves(runtime_state: Mapping[str, Any]) -> list[Prompt]:
    """``runtime_state.json``'s reserve prompts not admitted as a group: each step's unused
    ones and the leftovers handed on (none before runtime state schema 3)."""
    reserved = []
    for step, record in runtime_state.get("step_reserves", {}).items():
        prompts, used = record["reserve"], record["used"]
        if len(prompts) != len(used):
            raise AuditError(
                f"step {step}'s spare reserve has {len(prompts)} prompts, {len(used)} used flags"
            )
        reserved += [p for p, was_used in zip(prompts, used, strict=True) if not was_used]
    reserved += [left["prompt"] for left in runtime_state.get("leftovers", [])]
    return [Prompt(int(p["prompt_id"]), int(p["epoch"])) for p in reserved]


def parse_side_effects(lines: Iterable[str], source: str) -> tuple[list[SideEffect], int]:
    """A Gym audit file's lines; a torn (unparseable) line is counted, not trusted."""
    effects: list[SideEffect] = []
    torn = 0
    for line in lines:
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            effects.append(
                SideEffect(
                    source=source,
                    rollout_id=str(entry["rollout_id"]),
                    attempt=int(entry["attempt"]),
                    revision=int(entry["revision"]),
                    turn=int(entry.get("turn", 0)),
                )
            )
        except (ValueError, KeyError, TypeError):
            torn += 1
    return effects, torn


def parse_audit_file(text: str, source: str) -> tuple[list[SideEffect], TornRecords]:
    """An audit file's records; each unreadable line is named ``<source>:<line>``, as a
    torn tail when it is the unterminated last one (not counted as applied: the writer
    never finished it, and cuts it when it reopens the file)."""
    *complete, tail = text.split("\n")
    effects: list[SideEffect] = []
    torn = TornRecords()
    for number, line in enumerate(complete, 1):
        parsed, bad = parse_side_effects([line], source)
        effects += parsed
        if bad:
            torn.places.append(f"{source}:{number}")
    if tail.strip():
        torn.tails.append(f"{source}:{len(complete) + 1}")
    return effects, torn


def parse_side_effect_object(raw: bytes, key: str, source: str) -> SideEffect | None:
    """One ``--audit-uri`` object at ``key`` (``<rollout>/<revision>.json``, or the older
    ``<instance>/<rollout>/<revision>.json``; the JSON of one audit line); ``None`` if torn.
    An object whose content names another ``(rollout_id, revision)`` than its key is not
    trusted either.
    """
    from rolloutrun_runtime.environments.gym.effects import parse_effect_key

    parsed = parse_effect_key(key)
    effects, torn = parse_side_effects([raw.decode("utf-8", errors="replace")], source)
    if torn or len(effects) != 1 or parsed is None:
        return None
    (effect,) = effects
    if (effect.rollout_id, effect.revision) != parsed[1:]:
        return None
    return effect


def load_side_effects(
    run_dir: Path, storage: Any, *, threads: int = 16
) -> tuple[list[SideEffect], TornRecords]:
    """Side effects from ``RUN_DIR/gym-*.audit.jsonl`` and from the storage's objects.

    ``rolloutrun gym --audit-uri <storage>/gym-audit`` (gs:// cluster runs) writes one
    object per effect at ``gym-audit/<rollout>/<revision>.json`` (older versions:
    ``gym-audit/<instance>/<rollout>/<revision>.json``); they are read in parallel. Returns
    ``(effects, torn)``: an unreadable object counts like a torn line inside a file. A
    storage that cannot be listed is an :class:`AuditError`.
    """
    from concurrent.futures import ThreadPoolExecutor

    from rolloutrun_runtime.environments.gym.effects import parse_effect_key
    from rolloutrun_runtime.storage import StorageError

    effects: list[SideEffect] = []
    torn = TornRecords()
    for path in sorted(run_dir.glob(GYM_AUDIT_GLOB)):
        text = path.read_bytes().decode("utf-8", errors="replace")
        lines, bad = parse_audit_file(text, path.name)
        effects += lines
        torn.places += bad.places
        torn.tails += bad.tails
    start = len(GYM_AUDIT_PREFIX) + 1
    try:
        keys = [
            key
            for key in storage.list(GYM_AUDIT_PREFIX + "/")
            if parse_effect_key(key[start:]) is not None  # not the file:// audit files
        ]
    except StorageError as error:
        raise AuditError(f"cannot list the Gym side effects: {error}") from error

    def read(key: str) -> SideEffect | None:
        try:
            raw = storage.read_bytes(key)
        except StorageError as error:
            logger.warning("audit counts %s as torn: %s", storage.uri_for(key), error)
            return None
        return parse_side_effect_object(raw, key[start:], key)

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for key, effect in zip(keys, pool.map(read, keys), strict=True):
            if effect is None:
                torn.places.append(key)
            else:
                effects.append(effect)
    return effects, torn


def permutations_for(seed: int, dataset_size: int, epochs: int) -> dict[int, list[int]]:
    """The dataloader's per-epoch orders (the same pure function it draws from)."""
    from rolloutrun_runtime.algorithms.samplers import PromptDataloader

    loader = PromptDataloader(dataset_size, seed)
    return {epoch: [int(i) for i in loader._permutation(epoch)] for epoch in range(epochs + 1)}


# --------------------------------------------------------------------------- loading (I/O)
def _read_json(storage: Any, key: str, *, required: bool) -> Any:
    from rolloutrun_runtime.storage import ObjectNotFoundError

    try:
        raw = storage.read_bytes(key)
    except ObjectNotFoundError:
        if required:
            raise AuditError(f"{storage.uri_for(key)} is missing") from None
        return None
    try:
        return json.loads(raw)
    except ValueError as error:
        raise AuditError(f"{storage.uri_for(key)} is not valid JSON: {error}") from error


def _seed_from_manifests(storage: Any) -> int | None:
    """The run seed as the newest readable snapshot manifest's config view records it."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
        MANIFEST_NAME,
        SNAPSHOTS_PREFIX,
        parse_snapshot_id,
        snapshot_dir,
    )

    ids = sorted(
        {
            sid
            for key in storage.list(SNAPSHOTS_PREFIX + "/")
            if (sid := parse_snapshot_id(key.split("/")[1] if "/" in key else "")) is not None
        },
        reverse=True,
    )
    for sid in ids:
        manifest = _read_json(storage, f"{snapshot_dir(sid)}/{MANIFEST_NAME}", required=False)
        if isinstance(manifest, dict) and "seed" in manifest.get("config_view", {}):
            return int(manifest["config_view"]["seed"])
    return None


def _newest_snapshot_after(storage: Any, step: int) -> tuple[str, str, int] | None:
    """The newest intact snapshot whose train step is past ``step``: (entry, state file, step).

    A snapshot counts only with its manifest committed and every file matching the
    manifest's sha256 (what a restore would accept); a damaged one is passed over, logged.
    """
    import hashlib

    from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
        MANIFEST_NAME,
        SNAPSHOTS_PREFIX,
    )
    from rolloutrun_runtime.storage import StorageError, list_committed

    for entry in reversed(list_committed(storage, SNAPSHOTS_PREFIX, marker_name=MANIFEST_NAME)):
        manifest = _read_json(storage, f"{entry}/{MANIFEST_NAME}", required=False)
        if not isinstance(manifest, dict) or int(manifest.get("train_step", -1)) <= step:
            return None
        try:
            intact = all(
                hashlib.sha256(storage.read_bytes(f"{entry}/{name}")).hexdigest() == facts["sha256"]
                for name, facts in manifest.get("files", {}).items()
            )
        except StorageError as error:  # a missing file: the snapshot is damaged
            logger.warning("audit passes over %s: %s", entry, error)
            continue
        if not intact or SNAPSHOT_STATE_FILE not in manifest.get("files", {}):
            logger.warning("audit passes over %s: files do not match its manifest", entry)
            continue
        return entry, SNAPSHOT_STATE_FILE, int(manifest["train_step"])
    return None


def load_durable_state(
    run_dir: Path,
    *,
    storage_uri: str | None = None,
    seed: int | None = None,
    max_steps: int | None = None,
) -> DurableState:
    """Read the newest committed entry and the Gym audit files of ``run_dir``.

    The newest entry is the newest trainer checkpoint, or an intact snapshot taken after it
    (a run stopped between trainer checkpoints); after a completed run it is the final
    trainer checkpoint.
    """
    from rolloutrun_runtime.data_plane.store import DataPlaneError, row_keys_in
    from rolloutrun_runtime.experience.rollout_recovery import (
        LedgerSidecarError,
        read_recovery_sidecar,
    )
    from rolloutrun_runtime.storage import StorageError, list_committed, open_storage

    uri = storage_uri or "file://" + str((run_dir / "checkpoints").resolve())
    try:
        storage = open_storage(uri)
        steps = [
            int(match.group(1))
            for name in list_committed(storage, "")
            if (match := _STEP_ENTRY.match(name))
        ]
        if not steps:
            raise AuditError(f"{uri} holds no committed trainer checkpoint")
        step = max(steps)
        entry, state_file = f"step_{step}", TRAINER_STATE_FILE
        newer = _newest_snapshot_after(storage, step)
        if newer is not None:
            entry, state_file, step = newer
        keys = storage.list(entry + "/")
        state = _read_json(storage, f"{entry}/{state_file}", required=True)
        journal_keys = sorted(k for k in keys if k.rsplit("/", 1)[-1] == JOURNAL_FILE)
        if not journal_keys:
            raise AuditError(
                f"{storage.uri_for(entry)} has no {JOURNAL_FILE}: this runtime does not "
                "journal trained steps, so trained prompts cannot be audited"
            )
        journal = _read_json(storage, journal_keys[0], required=True)
        ledger_raw: bytes | None = None
        if f"{entry}/{LEDGER_FILE}" in keys:
            ledger_raw = storage.read_bytes(f"{entry}/{LEDGER_FILE}")
        runtime_state = _read_json(storage, f"{entry}/{RUNTIME_STATE_FILE}", required=False)
        data_plane = _read_json(storage, f"{entry}/{DATA_PLANE_METADATA}", required=False)
        if seed is None:
            seed = _seed_from_manifests(storage)
    except StorageError as error:
        raise AuditError(f"cannot read {uri}: {error}") from error

    source = storage.uri_for(entry)
    trained, dropped = parse_journal(journal, storage.uri_for(journal_keys[0]))
    ledger: list[LedgerGroup] = []
    spare: list[Prompt] = []
    if ledger_raw is not None:
        facts = state.get("rollout_recovery", {})
        try:
            read_recovery_sidecar(
                ledger_raw,
                expected_sha256=facts.get("rollout_recovery_sha256"),
                expected_schema=facts.get("rollout_recovery_schema"),
                expected_group_count=facts.get("rollout_recovery_groups"),
            )
        except LedgerSidecarError as error:
            raise AuditError(f"{source}: {error}") from error
        ledger, spare = parse_ledger(json.loads(ledger_raw))
    elif runtime_state:
        spare = [
            Prompt(int(p["prompt_id"]), int(p["epoch"]))
            for p in runtime_state.get("spare_prompts", [])
        ]
    reserved = parse_reserves(runtime_state or {})
    retained = [
        key
        for entry_json in (runtime_state or {}).get("journal", [])
        for group in entry_json.get("row_groups", [])
        for key in group.get("row_keys", [])
    ]
    try:
        row_keys = row_keys_in(data_plane) if data_plane else {}
    except DataPlaneError as error:
        raise AuditError(f"{source}: {error}") from error
    replay = (data_plane or {}).get("user", {}).get("replay", state.get("replay", []))
    loader = state["dataloader"]
    dataset_size = int(loader["dataset_size"])
    cursor_epoch, cursor_position = int(loader["epoch"]), int(loader["position"])
    effects, torn = load_side_effects(run_dir, storage)
    return DurableState(
        source=source,
        step=step,
        dataset_size=dataset_size,
        cursor_epoch=cursor_epoch,
        cursor_position=cursor_position,
        permutations=(None if seed is None else permutations_for(seed, dataset_size, cursor_epoch)),
        trained=trained,
        dropped=dropped,
        ledger=ledger,
        spare=spare,
        reserved=reserved,
        replay=list(replay),
        staging_keys=row_keys.get("staging", []),
        train_keys=row_keys.get("train", []),
        retained_train_keys=retained,
        side_effects=effects,
        torn_audit=torn,
        max_steps=max_steps,
    )


def run_audit(
    run_dir: Path, *, config_file: Path | None = None, storage_uri: str | None = None
) -> AuditReport:
    """Load and audit ``run_dir``; ``config_file`` supplies the seed and the storage URI."""
    seed = max_steps = None
    if config_file is not None:
        from rolloutrun_runtime.contract.run_config import load_run_config

        cfg = load_run_config(config_file)
        cfg = cfg.model_copy(update={"log_dir": str(run_dir)})
        seed, max_steps = cfg.seed, cfg.grpo.max_steps
        storage_uri = storage_uri or cfg.resolved_storage_uri()
    state = load_durable_state(run_dir, storage_uri=storage_uri, seed=seed, max_steps=max_steps)
    return audit(state)


# --------------------------------------------------------------------------- CLI
def register(parser: argparse.ArgumentParser) -> None:
    """Check from durable state that a run lost no prompt and repeated no side effect."""
    parser.add_argument("run_dir", help="the run's log directory")
    parser.add_argument(
        "--config", default=None, help="the run's YAML (gives the seed and the storage URI)"
    )
    parser.add_argument("--storage", default=None, help="storage URI (default RUN_DIR/checkpoints)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(handler=main)


def _render_text(report: AuditReport) -> str:
    verdict = "OK" if report.ok else "FAILED"
    p = report.prompts
    lines = [
        f"audit {verdict}: {report.source} (step {report.step})",
        f"  prompts: drawn {p.drawn}, trained {p.trained}, pending {p.pending}, dropped "
        f"{p.dropped}; lost {p.lost}, duplicated {p.duplicated}, undrawn {p.undrawn} "
        f"(drawn set from the {p.drawn_from})",
        f"  side effects: {report.side_effects.applied} applied, "
        f"{report.side_effects.duplicated} applied twice, "
        f"{report.side_effects.torn_lines} unreadable, "
        f"{report.side_effects.torn_tails} torn tails (tolerated)",
        f"  gym attempts: {report.gym_attempts.turn_restores} turn restores, "
        f"{report.gym_attempts.violations} violations",
        f"  rows: {report.rows.orphaned_staging} orphaned staging, "
        f"{report.rows.orphaned_train} orphaned train, replay/ledger mismatches "
        f"{report.rows.replay_not_finalized + report.rows.finalized_not_in_replay}",
    ]
    lines += [f"    unreadable: {place}" for place in report.side_effects.torn_examples]
    lines += [f"    torn tail: {place}" for place in report.side_effects.torn_tail_examples]
    lines += [f"    {example}" for example in report.gym_attempts.examples[:EXAMPLES]]
    lines += [f"    {example}" for example in report.rows.examples]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import sys

    try:
        report = run_audit(
            Path(args.run_dir),
            config_file=Path(args.config) if args.config else None,
            storage_uri=args.storage,
        )
    except AuditError as error:
        print(f"rolloutrun audit: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report.to_json(), indent=1, sort_keys=True))
    else:
        print(_render_text(report))
    return 0 if report.ok else 1
