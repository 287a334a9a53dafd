"""Snapshot manifests: what a committed snapshot's ``MANIFEST.json`` says, and its anchor.

Why apart from the store (:mod:`.manifest`): the manifest is a wire format read by restore,
the audit and tools, and every check of it is a pure function of its bytes and the run's
config. Keeping those checks here, with no storage, lets a reader see at once what makes a
manifest acceptable; the store adds only where manifests live and how they are committed.

A snapshot is only as good as its **anchor**: the trainer checkpoint whose weights it
continues from. Before the first optimizer step that is the bootstrap anchor (step 0, with a
fingerprint of the rollout-relevant config); afterwards the newest durable ``step_<N>``. The
snapshot cadence is independent of the trainer-checkpoint cadence: a snapshot taken at step
``N + k`` anchors to ``step_<N>`` and carries the groups trained since N for replay.

Parsing fails closed: a manifest of an unknown schema, with an unknown or missing field or a
field of the wrong JSON type is refused, naming the field. The manifest records the sha256
of every file, so a snapshot corrupted after publication is detected and skipped. The file
names and schema version are spelled in :mod:`rolloutrun_runtime.contract.layout`.

**Packed files (schema 3).** A snapshot's files are written as one file (``pack``): their
bytes concatenated in name order, each file's record adding its ``offset``. Why: on file://
each file is a temporary file, a write, an fsync and a rename, and each folder it needs a
mkdir and an fsync, and retention undoes all of it; one file per snapshot makes that one
write and one fsync, in one folder (the writer child's CPU per snapshot step was ~8 ms for
~16 fsyncs, ~10 renames, 5 unlinks and 4 mkdirs). The manifest is the pack's only index:
nothing in the pack is parsed, a file is its slice, checked against its sha256 like an
unpacked file. Schemas 1 and 2 (one object per name) are still read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rolloutrun_runtime.contract.config_fingerprint import fingerprint_of, flatten
from rolloutrun_runtime.contract.layout import (
    MANIFEST_SCHEMA_VERSION,
    READABLE_MANIFEST_SCHEMA_VERSIONS,
    SNAPSHOT_DIR,
)
from rolloutrun_runtime.contract.run_config import RunConfig

#: Config keys that may change between incarnations without invalidating a snapshot. All
#: other keys count (fail closed): a new key added to RunConfig is part of the fingerprint
#: until someone argues it is operational and lists it here.
OPERATIONAL_KEYS: frozenset[str] = frozenset(
    {
        "name",
        "logDir",
        "gym.endpoints",
        "gym.requestMaxBytes",
        "gym.checkpointLeaseGraceSeconds",
        "workers",
        "policy.device",
        "grpo.maxSteps",
        "rollout.rolloutTimeoutSeconds",
        "checkpointing.storageUri",
        "checkpointing.resumeFrom",
        "checkpointing.resumeHint",
        "checkpointing.snapshotIntervalSeconds",
        "checkpointing.snapshotEverySteps",
        "checkpointing.snapshotEveryRollouts",
        "checkpointing.keepLatest",
        "checkpointing.trace",
        "checkpointing.preemptionGraceSeconds",
        "checkpointing.deferFinalize",
        "checkpointing.savePeriod",
    }
)


class ManifestError(RuntimeError):
    """A snapshot manifest cannot be used; the message says which and why."""


def owner_problem(owner: Any, run_name: str) -> str | None:
    """Why storage whose bootstrap anchor names run ``owner`` is not ``run_name``'s."""
    if owner == run_name:
        return None
    return (
        f"storage belongs to run {owner!r}, not {run_name!r} (give this run its own "
        f"storage.uri, or name it {owner!r} to resume that run)"
    )


class FingerprintMismatchError(ManifestError):
    """The run's rollout-relevant config differs from the one the snapshots were taken with."""

    def __init__(self, source: str, differing: list[str]) -> None:
        self.differing = differing
        super().__init__(
            f"{source}: the run config differs from the one its snapshots were taken with in "
            f"{', '.join(differing)}; refusing to restore (start a new run, or restore the "
            "previous values)"
        )


class PublicationFencedError(ManifestError):
    """Another publisher committed this snapshot id first (a newer incarnation)."""


# --------------------------------------------------------------------------- fingerprints
def rollout_config_view(config: RunConfig) -> dict[str, Any]:
    """The flattened rollout-relevant config: every key except the operational ones."""
    return flatten(config.to_yaml_dict(), OPERATIONAL_KEYS)


def differing_keys(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
) -> list[str]:
    """Keys whose values differ, with both values, sorted by key.

    With ``defaults`` (a view of the config's defaults, :func:`default_config_view`), a key
    the saved view lacks is no difference when its current value is its default: see
    :func:`resume_config_differences` for why that, and only that, is forgiven.
    """
    return [_described(key, saved, current) for key in _differing(saved, current, defaults)]


def _differing(
    saved: Mapping[str, Any], current: Mapping[str, Any], defaults: Mapping[str, Any] | None
) -> list[str]:
    return [
        key
        for key in sorted(set(saved) | set(current))
        if saved.get(key, ...) != current.get(key, ...)
        and not (
            defaults is not None
            and key not in saved
            and key in defaults
            and current.get(key, ...) == defaults[key]
        )
    ]


def _described(key: str, saved: Mapping[str, Any], current: Mapping[str, Any]) -> str:
    return f"{key} (was {saved.get(key, '<unset>')!r}, now {current.get(key, '<unset>')!r})"


@functools.cache
def _default_view() -> tuple[tuple[str, Any], ...]:
    return tuple(rollout_config_view(RunConfig()).items())


def default_config_view() -> dict[str, Any]:
    """The rollout-relevant view of a config that sets nothing: this release's defaults."""
    return dict(_default_view())


def resume_config_differences(
    saved_view: Mapping[str, Any], config: RunConfig, saved_fingerprint: object = None
) -> list[str]:
    """Why a run with ``config`` may not continue state recorded with ``saved_view`` (empty:
    it may), one entry per differing key with both values. With ``saved_fingerprint`` (what
    the state recorded beside the view), a view that does not hash to it is not trusted
    (fail closed: the record was altered or is not this rule's).

    The fingerprint (a hash of the whole view) is the fast path: equal fingerprints, equal
    views. When they differ, the recorded *view* decides, by one rule: every key both views
    hold must be equal (turn and sibling level count as one: :func:`one_durable_level`), and
    a key only the current view holds must be at its default.

    Why this rule. A release that adds a config field with a default adds a key to the view,
    so a run started on the old release has a different fingerprint after an operator
    upgrade although nothing about it changed: the old release had no such knob and behaved
    as its default does (that is what a defaulted field added to a release means; a release
    that changes behaviour under an old config changes code, which no fingerprint sees).
    Forgiving exactly those keys keeps such a run resumable. Everything else stays refused:
    a value the user changed, a key set away from its default, a key dropped from the config,
    and a *changed default*, because the recorded view holds the effective values, not just
    the non-default ones (fingerprinting only non-default values would have let a release
    that changes ``grpo.groupSize``'s default resume old runs with the new group size).
    """
    if saved_fingerprint is not None and saved_fingerprint != fingerprint_of(dict(saved_view)):
        return [
            f"the recorded config view does not match its fingerprint "
            f"{str(saved_fingerprint)[:12]}… (altered, or written by another fingerprint rule)"
        ]
    current = rollout_config_view(config)
    keys = _differing(
        one_durable_level(saved_view),
        one_durable_level(current),
        one_durable_level(default_config_view()),
    )
    return [_described(key, saved_view, current) for key in keys]  # the values as recorded


#: Where the recovery level sits in a config view, and the levels whose durable state has
#: one shape (:func:`one_durable_level`).
LEVEL_KEY = "checkpointing.targetLevel"
LEVELS_OF_ONE_SHAPE = frozenset({"turn", "sibling"})


def one_durable_level(view: Mapping[str, Any]) -> Mapping[str, Any]:
    """``view`` with turn level read as sibling level, for the resume comparison only.

    Why: the two write the same state (the ledger at sibling granularity; turn adds the
    environment's episode records, in their own file) and a restore takes either at either
    level (a sibling-level one leaves the records unused; a turn-level one without them
    restarts those episodes from turn 0, as for a record a Gym refuses). And the level a run
    records is the one it *settled* on: a run asking for turn level whose Gyms have no
    checkpoint control plane runs, and records, sibling level, while its next incarnation
    plans its restore before its Gyms answer, still asking for turn level. Prompt-group and
    none stay apart: their ledgers differ."""
    if view.get(LEVEL_KEY) in LEVELS_OF_ONE_SHAPE:
        return {**view, LEVEL_KEY: "sibling"}
    return view


# --------------------------------------------------------------------------- the manifest
@dataclasses.dataclass(frozen=True)
class Anchor:
    """The trainer checkpoint a snapshot continues from."""

    kind: str  # "bootstrap" or "step"
    step: int
    weight_version: int

    @property
    def name(self) -> str:
        return "bootstrap" if self.kind == "bootstrap" else f"step_{self.step}"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, "weight_version": self.weight_version}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Anchor:
        kind = data["kind"]
        if kind not in {"bootstrap", "step"}:
            raise ValueError(f"unknown anchor kind {kind!r}")
        return cls(kind=kind, step=int(data["step"]), weight_version=int(data["weight_version"]))


BOOTSTRAP_ANCHOR = Anchor(kind="bootstrap", step=0, weight_version=0)


@dataclasses.dataclass(frozen=True)
class SnapshotManifest:
    """What a committed snapshot holds and what it needs to be restored."""

    run_name: str
    snapshot_id: int
    anchor: Anchor
    fingerprint: str
    config_view: dict[str, Any]
    train_step: int
    mutation_version: int
    files: dict[str, dict[str, Any]]  # name -> {"sha256": hex, "bytes": n}
    created_at: float
    cut_time: float
    incarnation: int = 0
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    segments: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Data-plane segments (keys under the storage root) -> {"sha256", "bytes"} (schema 2)."""
    pack: str = ""
    """The packed file holding every file, each record's ``offset`` into it (schema 3);
    empty: one object per name (schemas 1-2)."""
    schema_version: int = MANIFEST_SCHEMA_VERSION

    def to_bytes(self) -> bytes:
        # Field by field, not dataclasses.asdict: that deep-copies the config view first.
        # No indent: json's C encoder runs only without one (a publication writes one
        # manifest, config view included; ``python -m json.tool`` shows it indented).
        data = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
        data["anchor"] = self.anchor.to_json()
        if not self.pack:
            del data["pack"]  # the one-file-per-name layout: a schema-2 manifest, as it was
        return json.dumps(data, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes, source: str) -> SnapshotManifest:
        data = parse_json_object(raw, source, "manifest is ")
        version = data.get("schema_version")
        if version not in READABLE_MANIFEST_SCHEMA_VERSIONS or isinstance(version, bool):
            raise ManifestError(
                f"{source}: unknown manifest schema version {version!r} "
                f"(this runtime reads {', '.join(map(str, READABLE_MANIFEST_SCHEMA_VERSIONS))})"
            )
        names = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        missing = sorted(
            field.name
            for field in dataclasses.fields(cls)
            if field.name not in data
            and field.default is dataclasses.MISSING
            and field.default_factory is dataclasses.MISSING
        )
        if unknown or missing:
            raise ManifestError(
                f"{source}: malformed manifest (unknown fields: {unknown or 'none'}, "
                f"missing fields: {missing or 'none'})"
            )
        wrong = _wrong_field_types(data)
        if wrong:
            raise ManifestError(f"{source}: malformed manifest ({'; '.join(wrong)})")
        try:
            data["anchor"] = Anchor.from_json(data["anchor"])
            return cls(**data)
        except (KeyError, TypeError, ValueError) as error:
            raise ManifestError(f"{source}: malformed manifest ({error})") from error


#: The JSON type each manifest field must have (bool is not an int here: JSON ``true`` is not
#: a step). A field of another type is a refusal naming it, never a ``TypeError`` later.
_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "run_name": str,
    "snapshot_id": int,
    "anchor": dict,
    "fingerprint": str,
    "config_view": dict,
    "train_step": int,
    "mutation_version": int,
    "files": dict,
    "created_at": (int, float),
    "cut_time": (int, float),
    "incarnation": int,
    "extra": dict,
    "segments": dict,
    "pack": str,
    "schema_version": int,
}


def _wrong_field_types(data: Mapping[str, Any]) -> list[str]:
    """``"field X is T, expected U"`` for each manifest field (and file record) of a wrong type."""
    wrong = []
    for name, expected in _FIELD_TYPES.items():
        value = data.get(name)
        if name in data and (isinstance(value, bool) or not isinstance(value, expected)):
            wanted = " or ".join(
                t.__name__ for t in (expected if isinstance(expected, tuple) else (expected,))
            )
            wrong.append(f"field {name} is {type(value).__name__}, expected {wanted}")
    for field in ("files", "segments"):
        records = data.get(field)
        for file_name, record in records.items() if isinstance(records, dict) else ():
            if not (
                isinstance(record, dict)
                and isinstance(record.get("sha256"), str)
                and isinstance(record.get("bytes"), int)
                and not isinstance(record.get("bytes"), bool)
            ):
                wrong.append(f"field {field}[{file_name!r}] is not {{sha256: str, bytes: int}}")
    pack = data.get("pack")
    if isinstance(pack, str) and pack:
        if "/" in pack or pack != pack.strip() or pack in (".", ".."):
            wrong.append(f"field pack {pack!r} is not one plain file name")
        records = data.get("files")
        for file_name, record in records.items() if isinstance(records, dict) else ():
            offset = record.get("offset") if isinstance(record, dict) else None
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
                wrong.append(f"field files[{file_name!r}] has no offset into the pack")
    return wrong


# --------------------------------------------------------------------------- packed files
def pack_files(files: Mapping[str, bytes]) -> tuple[list[bytes], dict[str, dict[str, Any]]]:
    """A schema-3 snapshot's files as the pack's parts in order (name order; joined, they are
    the pack) and each file's manifest record: its sha256, size and offset in the pack."""
    parts: list[bytes] = []
    records: dict[str, dict[str, Any]] = {}
    offset = 0
    for name in sorted(files):
        data = bytes(files[name])
        records[name] = {**file_record(data), "offset": offset}
        parts.append(data)
        offset += len(data)
    return parts, records


def unpack_file(uri: str, pack: bytes, name: str, record: Mapping[str, Any]) -> bytes:
    """File ``name``'s slice of ``pack`` (read from ``uri``), checked against its record
    (a slice past the pack's end, as a truncated pack leaves, fails its checksum)."""
    offset = int(record["offset"])
    data = pack[offset : offset + int(record["bytes"])]
    check_file_record(f"{uri}#{name}", data, record)
    return data


def parse_json_object(raw: bytes, source: str, what: str = "") -> dict[str, Any]:
    """``raw`` as a JSON object, else a ManifestError ``<source>: <what>not valid JSON``."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ManifestError(f"{source}: {what}not valid JSON ({error})") from error
    if not isinstance(data, dict):
        raise ManifestError(f"{source}: {what}not a JSON object")
    return data


def sha256_of(content: bytes | Path) -> tuple[str, int]:
    """sha256 hex digest and size of bytes or a local file (streamed)."""
    digest = hashlib.sha256()
    if isinstance(content, Path):
        size = 0
        with content.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
                size += len(block)
        return digest.hexdigest(), size
    digest.update(content)
    return digest.hexdigest(), len(content)


def file_record(content: bytes | Path) -> dict[str, Any]:
    """A manifest's record of one file: its sha256 and size."""
    digest, size = sha256_of(content)
    return {"sha256": digest, "bytes": size}


def check_file_record(uri: str, data: bytes, expected: Mapping[str, Any]) -> None:
    """Refuse ``data`` read from ``uri`` unless it matches the manifest's record of it."""
    digest, size = sha256_of(data)
    if digest != expected["sha256"] or size != expected["bytes"]:
        raise ManifestError(
            f"{uri}: checksum mismatch (expected sha256 {expected['sha256'][:12]}… of "
            f"{expected['bytes']} bytes, found {digest[:12]}… of {size} bytes)"
        )


def parse_snapshot_id(entry: str) -> int | None:
    match = SNAPSHOT_DIR.match(entry.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A committed snapshot that passed every check, ready to restore."""

    manifest: SnapshotManifest
    entry: str
    manifest_uri: str
    verified: dict[str, bytes] = dataclasses.field(default_factory=dict, repr=False, compare=False)
    """Files already read and checked by ``verify``: a restore does not read them again."""


@dataclasses.dataclass
class SelectionReport:
    """Why each newer snapshot was passed over (for logs and the trace)."""

    chosen: Candidate | None = None
    skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
