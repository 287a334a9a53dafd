"""Reading a run's durable state: the newest trainer checkpoint or snapshot, its journal,
ledger, runtime state and data-plane metadata, into one :class:`DurableState`.

Why thin and apart: this is the audit's only I/O besides the Gym's records. It reads what a
restart would read (the newest committed ``step_<N>``, or an intact snapshot taken after
it) through the storage layout of :mod:`rolloutrun_runtime.contract.layout`, never through
the writers' modules, so the audit checks what was written rather than what the writers
believe they wrote.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rolloutrun_runtime.audit.side_effects import load_side_effects
from rolloutrun_runtime.audit.state import (
    AuditError,
    DurableState,
    LedgerAttempt,
    LedgerGroup,
    Prompt,
)
from rolloutrun_runtime.contract.layout import (
    CONTROLLER_STATE_FILE,
    DATA_PLANE_METADATA_FILE,
    DATA_PLANE_PREFIX,
    DEFAULT_STORAGE_DIR,
    JOURNAL_FILE,
    LEDGER_FILE,
    MANIFEST_NAME,
    RUNTIME_STATE_FILE,
    SNAPSHOT_DIR,
    SNAPSHOTS_PREFIX,
    STEP_ENTRY,
    TRAINER_STATE_FILE,
    snapshot_dir,
    step_entry,
)

logger = logging.getLogger(__name__)


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
    ids = sorted(
        {
            int(match.group(1))
            for key in storage.list(SNAPSHOTS_PREFIX + "/")
            if (match := SNAPSHOT_DIR.match(key.split("/")[1] if "/" in key else ""))
        },
        reverse=True,
    )
    for sid in ids:
        manifest = _read_json(storage, f"{snapshot_dir(sid)}/{MANIFEST_NAME}", required=False)
        if isinstance(manifest, dict) and "seed" in manifest.get("config_view", {}):
            return int(manifest["config_view"]["seed"])
    return None


def _snapshot_files(storage: Any, entry: str, manifest: Mapping[str, Any]) -> dict[str, bytes]:
    """A snapshot's files by name as its manifest lists them: each its own object (manifest
    schemas 1-2), or its slice of the snapshot's pack (schema 3: ``pack`` and each record's
    ``offset``). Whether they match the manifest is the caller's check."""
    records = manifest.get("files", {})
    pack = manifest.get("pack")
    if not pack:
        return {name: storage.read_bytes(f"{entry}/{name}") for name in records}
    raw = storage.read_bytes(f"{entry}/{pack}")
    return {
        name: raw[int(r["offset"]) : int(r["offset"]) + int(r["bytes"])]
        for name, r in records.items()
    }


def _newest_snapshot_after(
    storage: Any, step: int
) -> tuple[str, str, int, dict[str, bytes]] | None:
    """The newest intact snapshot whose train step is past ``step``: (entry, state file, step,
    its files by name).

    A snapshot counts only with its manifest committed and every file matching the
    manifest's sha256 (what a restore would accept); a damaged one is passed over, logged.
    """
    import hashlib

    from rolloutrun_runtime.storage import StorageError, list_committed

    for entry in reversed(list_committed(storage, SNAPSHOTS_PREFIX, marker_name=MANIFEST_NAME)):
        manifest = _read_json(storage, f"{entry}/{MANIFEST_NAME}", required=False)
        if not isinstance(manifest, dict) or int(manifest.get("train_step", -1)) <= step:
            return None
        try:
            files = _snapshot_files(storage, entry, manifest)
        except StorageError as error:  # a missing file: the snapshot is damaged
            logger.warning("audit passes over %s: %s", entry, error)
            continue
        intact = all(
            hashlib.sha256(files[name]).hexdigest() == facts["sha256"]
            for name, facts in manifest.get("files", {}).items()
        )
        if not intact or CONTROLLER_STATE_FILE not in manifest.get("files", {}):
            logger.warning("audit passes over %s: files do not match its manifest", entry)
            continue
        return entry, CONTROLLER_STATE_FILE, int(manifest["train_step"]), files
    return None


@dataclass
class _EntryFiles:
    """The newest entry's files as the storage calls its readers make: a trainer
    checkpoint's and an unpacked snapshot's are objects; a snapshot's files read (and
    checked) already are served from memory, a packed one's included."""

    storage: Any
    entry: str
    read: Mapping[str, bytes] | None = None

    def keys(self) -> list[str]:
        if self.read is None:
            return list(self.storage.list(self.entry + "/"))
        return [f"{self.entry}/{name}" for name in sorted(self.read)]

    def read_bytes(self, key: str) -> bytes:
        if self.read is None:
            return bytes(self.storage.read_bytes(key))
        from rolloutrun_runtime.storage import ObjectNotFoundError

        name = key.removeprefix(self.entry + "/")
        if name not in self.read:
            raise ObjectNotFoundError(self.storage.uri_for(key), "not one of the snapshot's files")
        return self.read[name]

    def uri_for(self, key: str) -> str:
        return str(self.storage.uri_for(key))


@dataclass
class _Entry:
    """The raw documents of the newest committed entry (trainer checkpoint or snapshot)."""

    source: str
    step: int
    state: dict[str, Any]
    journal: Mapping[str, Any]
    journal_uri: str
    ledger_raw: bytes | None
    runtime_state: dict[str, Any] | None
    data_plane: dict[str, Any] | None
    seed: int | None
    #: The chunks a schema-6 ledger head and a format-4 data-plane index list (key -> bytes).
    ledger_chunks: Mapping[str, bytes] = field(default_factory=dict)


def _ledger_chunks(storage: Any, ledger_raw: bytes) -> dict[str, bytes]:
    """The chunks a schema-6 ledger head lists."""
    from rolloutrun_runtime.experience.rollout_recovery.sidecar import chain_keys

    return _read_chunks(storage, chain_keys(ledger_raw))


def _read_chunks(storage: Any, keys: list[str]) -> dict[str, bytes]:
    """Chain chunks by key (absent ones are left out: the readers name them)."""
    from rolloutrun_runtime.storage import StorageError

    chunks = {}
    for key in keys:
        try:
            chunks[key] = storage.read_bytes(key)
        except StorageError:
            continue
    return chunks


def _newest_entry(storage: Any, uri: str) -> tuple[str, str, int, dict[str, bytes] | None]:
    """The newest committed trainer checkpoint, or an intact snapshot taken after it:
    ``(entry, state file, step, a snapshot's files by name)``."""
    from rolloutrun_runtime.storage import list_committed

    steps = [
        int(match.group(1))
        for name in list_committed(storage, "")
        if (match := STEP_ENTRY.match(name))
    ]
    if not steps:
        raise AuditError(f"{uri} holds no committed trainer checkpoint")
    step = max(steps)
    newer = _newest_snapshot_after(storage, step)
    if newer is not None:
        return newer
    return step_entry(step), TRAINER_STATE_FILE, step, None


def _read_entry(uri: str, seed: int | None) -> tuple[Any, _Entry]:
    """Open the storage and read the newest entry's documents (raw, not yet checked)."""
    from rolloutrun_runtime.storage import StorageError, open_storage

    try:
        storage = open_storage(uri)
        entry, state_file, step, read = _newest_entry(storage, uri)
        files = _EntryFiles(storage, entry, read)
        keys = files.keys()
        state = _read_json(files, f"{entry}/{state_file}", required=True)
        journal_keys = sorted(k for k in keys if k.rsplit("/", 1)[-1] == JOURNAL_FILE)
        if not journal_keys:
            raise AuditError(
                f"{storage.uri_for(entry)} has no {JOURNAL_FILE}: this runtime does not "
                "journal trained steps, so trained prompts cannot be audited"
            )
        journal = _read_json(files, journal_keys[0], required=True)
        ledger_raw: bytes | None = None
        ledger_chunks: dict[str, bytes] = {}
        if f"{entry}/{LEDGER_FILE}" in keys:
            ledger_raw = files.read_bytes(f"{entry}/{LEDGER_FILE}")
            ledger_chunks = _ledger_chunks(storage, ledger_raw)
        runtime_state = _read_json(files, f"{entry}/{RUNTIME_STATE_FILE}", required=False)
        data_plane_metadata = f"{entry}/{DATA_PLANE_PREFIX}{DATA_PLANE_METADATA_FILE}"
        data_plane = _read_json(files, data_plane_metadata, required=False)
        index_chain = (data_plane or {}).get("index_chain", [])
        keys = [str(c.get("key")) for c in index_chain if isinstance(c, dict)]
        ledger_chunks.update(_read_chunks(storage, keys))
        if seed is None:
            seed = _seed_from_manifests(storage)
    except StorageError as error:
        raise AuditError(f"cannot read {uri}: {error}") from error
    return storage, _Entry(
        source=storage.uri_for(entry),
        step=step,
        state=state,
        journal=journal,
        journal_uri=storage.uri_for(journal_keys[0]),
        ledger_raw=ledger_raw,
        ledger_chunks=ledger_chunks,
        runtime_state=runtime_state,
        data_plane=data_plane,
        seed=seed,
    )


def _ledger_and_spare(raw: _Entry) -> tuple[list[LedgerGroup], list[Prompt]]:
    """The ledger's groups and spare pool, the sidecar checked against the entry's facts
    (before the ledger sidecar existed: the runtime state's spare prompts)."""
    from rolloutrun_runtime.experience.rollout_recovery import (
        LedgerSidecarError,
        read_recovery_sidecar,
    )
    from rolloutrun_runtime.experience.rollout_recovery.sidecar import sidecar_document

    if raw.ledger_raw is not None:
        facts = raw.state.get("rollout_recovery", {})
        try:
            read_recovery_sidecar(
                raw.ledger_raw,
                expected_sha256=facts.get("rollout_recovery_sha256"),
                expected_schema=facts.get("rollout_recovery_schema"),
                expected_group_count=facts.get("rollout_recovery_groups"),
                chunks=raw.ledger_chunks,
            )
        except LedgerSidecarError as error:
            raise AuditError(f"{raw.source}: {error}") from error
        return parse_ledger(sidecar_document(raw.ledger_raw, raw.ledger_chunks))
    if raw.runtime_state:
        return [], [
            Prompt(int(p["prompt_id"]), int(p["epoch"]))
            for p in raw.runtime_state.get("spare_prompts", [])
        ]
    return [], []


def _retained_train_keys(runtime_state: Mapping[str, Any]) -> list[str]:
    """The ``train`` rows the runtime state's journal keeps for replay."""
    return [
        key
        for entry_json in runtime_state.get("journal", [])
        for group in entry_json.get("row_groups", [])
        for key in group.get("row_keys", [])
    ]


def load_durable_state(
    run_dir: Path | None,
    *,
    storage_uri: str | None = None,
    seed: int | None = None,
    max_steps: int | None = None,
) -> DurableState:
    """Read the newest committed entry and the Gym audit files of ``run_dir`` (None: of the
    storage, see :func:`load_side_effects`).

    The newest entry is the newest trainer checkpoint, or an intact snapshot taken after it
    (a run stopped between trainer checkpoints); after a completed run it is the final
    trainer checkpoint.
    """
    from rolloutrun_runtime.data_plane.store import DataPlaneError, row_keys_in

    if storage_uri is None and run_dir is None:
        raise AuditError("give a run's log directory or its storage URI")
    uri = storage_uri or "file://" + str((Path(run_dir or ".") / DEFAULT_STORAGE_DIR).resolve())
    storage, raw = _read_entry(uri, seed)
    trained, dropped = parse_journal(raw.journal, raw.journal_uri)
    ledger, spare = _ledger_and_spare(raw)
    reserved = parse_reserves(raw.runtime_state or {})
    retained = _retained_train_keys(raw.runtime_state or {})
    try:
        row_keys = row_keys_in(raw.data_plane, raw.ledger_chunks) if raw.data_plane else {}
    except DataPlaneError as error:
        raise AuditError(f"{raw.source}: {error}") from error
    replay = (raw.data_plane or {}).get("user", {}).get("replay", raw.state.get("replay", []))
    loader = raw.state["dataloader"]
    dataset_size = int(loader["dataset_size"])
    cursor_epoch, cursor_position = int(loader["epoch"]), int(loader["position"])
    effects, torn = load_side_effects(run_dir, storage)
    permutations = (
        None if raw.seed is None else permutations_for(raw.seed, dataset_size, cursor_epoch)
    )
    return DurableState(
        source=raw.source,
        step=raw.step,
        dataset_size=dataset_size,
        cursor_epoch=cursor_epoch,
        cursor_position=cursor_position,
        permutations=permutations,
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
