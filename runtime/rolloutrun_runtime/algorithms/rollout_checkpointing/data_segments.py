"""Incremental data-plane writes for rollout snapshots: content-addressed row segments.

Why: a snapshot used to rewrite the whole data plane (``rows.npz``) each time; at 10,000
buffered groups that is seconds of packing and upload per snapshot, for rows that mostly
did not change since the last one. Rows are replaced, never mutated (``DataPlane.put``
stores a new dict), so a row object the last published snapshot wrote is still the same
content: a snapshot writes one new segment holding only the rows added or replaced since
then, and its ``metadata.json`` (format 3) names, for each row, the segment that holds it.

Segments live under ``rollout_snapshots/data_segments/<sha256>.npz`` (the name is the hash
of the bytes) and are shared by every snapshot whose manifest lists them; they are written,
durable, before the manifest (the commit), and a retained manifest's segments are never
collected (``ManifestStore.collect_segments``). A segment whose live rows fall below
``COMPACT_BELOW`` of what it holds is compacted: its live rows are rewritten into the new
segment, so storage stays within a small factor of the live rows; so are the smallest ones
while a snapshot would reference more than ``MAX_SEGMENTS`` (a restore reads each one).

The writer's memory (which row object lives in which segment) changes only once a
snapshot's manifest is published (:meth:`SegmentWriter.commit`): a failed or killed
publication leaves it as the last published snapshot left it.

Two incarnations of a trainer can overlap until the Lease fences the old one (a partitioned
trainer still reaching storage), and a segment is written before the manifest that lists
it: so an unreferenced segment is collected only once older than :func:`orphan_grace_s`
(git's prune expiry), never while another publication may still commit it; and before
reusing segments, the writer checks they still exist (a collector without that grace, or a
hand-made delete, may have taken them) and rewrites the rows of any missing one into the
new segment, so no snapshot names a segment that is gone.

The ledger sidecar's groups travel the same way (:meth:`SegmentWriter.stage_ledger`): a
chain of JSON chunks (:mod:`rolloutrun_runtime.json_chain`) stored beside the segments,
listed in the manifest with them, written before it and collected as they are; a snapshot
writes one chunk of the groups changed since the last published one.

A new incarnation's writer starts from the snapshot it restored (:func:`seed_from_snapshot`,
:meth:`SegmentWriter.seed`): the rows it read back are placed in the segments they came
from, so its first snapshot writes only what changed since, not every row again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any

from rolloutrun_runtime.contract.layout import (
    CHAINED_DATA_PLANE_FORMAT,
    DATA_PLANE_METADATA_FILE,
    SEGMENTED_DATA_PLANE_FORMAT,
    chain_chunk_key,
    data_segment_key,
)
from rolloutrun_runtime.contract.pod import DEFAULT_LEASE_DURATION_S
from rolloutrun_runtime.data_plane import DataPlane
from rolloutrun_runtime.data_plane.store import (
    PARTITIONS,
    chained_metadata,
    expand_index,
    pack_segment,
    segment_short_id,
)
from rolloutrun_runtime.experience.rollout_recovery.sidecar import LedgerSidecar, SidecarCapture
from rolloutrun_runtime.json_chain import ChainStage, ChainWriter, ChunkRecord

log = logging.getLogger(__name__)

#: A segment whose live rows are fewer than this fraction of its rows is compacted.
COMPACT_BELOW = 0.5
#: The most segments one snapshot references (the smallest are merged beyond it).
MAX_SEGMENTS = 32
#: The least age (seconds) at which an unreferenced segment is collected: room for clock
#: skew between pods and the storage's clock, and for slow uploads.
ORPHAN_GRACE_FLOOR_S = 600.0
#: How many publication windows (see :func:`orphan_grace_s`) an orphan outlives.
ORPHAN_GRACE_WINDOWS = 4


def orphan_grace_s(
    snapshot_interval_s: float,
    preemption_grace_s: float,
    lease_duration_s: float = DEFAULT_LEASE_DURATION_S,
) -> float:
    """How old an unreferenced segment must be before it is collected.

    A segment is written before its manifest commits; a publication lasts at most about a
    snapshot interval (a forced one, the preemption grace), and an old trainer keeps running
    at most a Lease duration after a new one took over. An orphan younger than a few such
    windows (and than ``ORPHAN_GRACE_FLOOR_S``) may be a live publication's: it is kept.
    """
    window = snapshot_interval_s + preemption_grace_s + lease_duration_s
    return max(ORPHAN_GRACE_FLOOR_S, ORPHAN_GRACE_WINDOWS * window)


@dataclasses.dataclass(frozen=True)
class SegmentRecord:
    """One written segment: its key, checksum, size and how many rows it holds."""

    key: str
    sha256: str
    size: int
    rows: int

    def manifest_record(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "bytes": self.size}


#: Per partition, per row key: the row object last written and the segment holding it.
Placement = dict[str, dict[str, tuple[Mapping[str, Any], str]]]


@dataclasses.dataclass
class SegmentedWrite:
    """One snapshot's data plane as segments, ready to publish."""

    files: dict[str, bytes]
    """``{metadata.json: bytes}``: the snapshot's own data-plane file."""
    new_segments: dict[str, bytes]
    """Segments to write (durable) before the manifest."""
    referenced: dict[str, SegmentRecord]
    """Every segment the snapshot needs (the manifest lists them with their checksums)."""
    placement: Placement
    new_rows: int
    compacted_rows: int
    ledger_chain: ChainStage | None = None
    """The ledger sidecar's chain this snapshot lists (its chunks are in ``referenced``)."""
    index_chain: ChainStage | None = None
    """``metadata.json``'s row index as a chain (its chunks are in ``referenced``)."""

    @property
    def chains(self) -> list[ChainStage]:
        return [stage for stage in (self.ledger_chain, self.index_chain) if stage is not None]

    def manifest_segments(self) -> dict[str, dict[str, Any]]:
        """Every segment and chain chunk the snapshot lists (key -> sha256 and bytes)."""
        listed = {key: record.manifest_record() for key, record in self.referenced.items()}
        for stage in self.chains:
            listed.update({r.key: {"sha256": r.sha256, "bytes": r.size} for r in stage.records})
        return dict(sorted(listed.items()))

    def files_to_write(self) -> dict[str, bytes]:
        """The new segments and chain chunks, written (durable) before the manifest."""
        files = dict(self.new_segments)
        for stage in self.chains:
            files.update(stage.new_files)
        return files


@dataclasses.dataclass(frozen=True)
class SegmentSeed:
    """What a restored snapshot wrote: where each restored row object lives, and the
    segments' records (a new incarnation's writer starts from it)."""

    placement: Placement
    records: dict[str, SegmentRecord]
    index_chain: list[ChunkRecord] = dataclasses.field(default_factory=list)
    """The chain of its ``metadata.json`` row index (format 4; empty before)."""


def seed_from_snapshot(
    plane: DataPlane,
    metadata: bytes,
    segments: Mapping[str, Mapping[str, Any]],
    chunks: Mapping[str, bytes] | None = None,
) -> SegmentSeed | None:
    """The writer's memory of a restored snapshot: ``plane`` as read back from it (its row
    objects, before anything replaced one), its data-plane ``metadata.json`` and its
    manifest's ``segments``. None when the snapshot is not segmented.

    A segment's row count is the rows the metadata places in it (it may hold more, dead
    ones: compaction then comes later than it would have, never wrongly).
    """
    meta = json.loads(metadata)
    if meta.get("format") not in (SEGMENTED_DATA_PLANE_FORMAT, CHAINED_DATA_PLANE_FORMAT):
        return None
    chain = [
        ChunkRecord.from_json(record, "data-plane metadata.json index")
        for record in meta.get("index_chain", [])
    ]
    meta = expand_index(meta, chunks or {})  # (``chunks``: a format-4 index's)
    names = list(meta["segments"])
    counts = dict.fromkeys(names, 0)
    placement: Placement = {}
    for partition in PARTITIONS:
        packed = meta["index"].get(partition, {"keys": [], "segment": []})
        rows, placed = plane.rows_of(partition), {}
        for key, at in zip(packed["keys"], packed["segment"], strict=True):
            name = names[at]
            counts[name] += 1
            row = rows.get(key)
            if row is not None and name in segments:
                placed[key] = (row, name)
            else:  # the index names a row the writer does not place: not the chain's map
                chain = []
        placement[partition] = placed
    records = {
        name: SegmentRecord(name, str(segments[name]["sha256"]), int(segments[name]["bytes"]), n)
        for name, n in counts.items()
        if name in segments
    }
    return SegmentSeed(placement, records, chain)


def choose_compaction(
    live: Mapping[str, int],
    records: Mapping[str, SegmentRecord],
    *,
    compact_below: float = COMPACT_BELOW,
    max_segments: int = MAX_SEGMENTS,
) -> set[str]:
    """Segments whose live rows go into the new segment: the mostly dead ones, then the
    smallest while more than ``max_segments`` would be referenced (the new one counts)."""
    chosen = {key for key, count in live.items() if count < compact_below * records[key].rows}
    kept = sorted((key for key in live if key not in chosen), key=lambda key: (live[key], key))
    excess = len(kept) + 1 - max_segments
    if excess > 0:
        chosen.update(kept[:excess])
    return chosen


def _index_bytes(placement: Placement) -> int:
    """About the bytes of a chained index of ``placement``: per row its key, partition and
    the segment's short id with their JSON punctuation (``json_chain``'s rewrite rule)."""
    return sum(sum(map(len, placed)) + 26 * len(placed) for placed in placement.values())


class SegmentWriter:
    """Remembers what the last published snapshot wrote; prepares the next one's segments.

    Used under the snapshotter's save lock, one snapshot at a time (``prepare`` off the
    loop, ``commit`` once the manifest is published).
    """

    def __init__(self, missing: Callable[[Collection[str]], set[str]] | None = None) -> None:
        """``missing(keys)``: which of ``keys`` storage no longer holds (checked before a
        snapshot reuses them; ``None``: trust the memory, for writers without storage)."""
        self._placement: Placement = {partition: {} for partition in PARTITIONS}
        self._records: dict[str, SegmentRecord] = {}
        self._pending: SegmentedWrite | None = None
        self._missing = missing
        #: Segments found missing (so rewritten) since the writer was made.
        self.missing_found: set[str] = set()
        #: The ledger sidecar's groups as a chain of chunks (:meth:`stage_ledger`).
        self.ledger_chain = ChainWriter(chain_chunk_key)
        #: ``metadata.json``'s row index (format 4) as a chain of chunks.
        self.index_chain = ChainWriter(chain_chunk_key)
        self._staged_ledger: ChainStage | None = None
        self._gone: set[str] | None = None

    def _check_gone(self) -> set[str]:
        """Which committed segments and chain chunks storage no longer holds (one listing
        per snapshot, shared by the ledger's chain and the data plane)."""
        if self._gone is None:
            known = {*self._records, *self.ledger_chain.keys, *self.index_chain.keys}
            self._gone = self._missing(sorted(known)) if self._missing and known else set()
        return self._gone

    def stage_ledger(self, capture: SidecarCapture) -> LedgerSidecar:
        """The ledger sidecar as a schema-6 head and its chain: the committed chunks and one
        of the groups changed since (listed and written with the next :meth:`prepare`)."""
        self._gone = None  # checked afresh for each snapshot (a failed one may have left it)
        self._staged_ledger = self.ledger_chain.stage(capture.fragments, gone=self._check_gone())
        return capture.encode_chained(self._staged_ledger)

    def seed(self, seed: SegmentSeed) -> None:
        """Start from a restored snapshot's segments (a writer that wrote nothing yet)."""
        if self._records:
            return  # it has written since: its own memory is newer
        self._placement = {p: dict(seed.placement.get(p, {})) for p in PARTITIONS}
        self._records = dict(seed.records)
        if seed.index_chain:
            live = _index_bytes(self._placement)
            self.index_chain.seed(seed.index_chain, live)

    def forget(self, keys: Collection[str]) -> None:
        """Drop ``keys`` from the memory: their rows count as not written."""
        gone = set(keys)
        self._records = {key: r for key, r in self._records.items() if key not in gone}
        self._placement = {
            partition: {k: placed for k, placed in rows.items() if placed[1] not in gone}
            for partition, rows in self._placement.items()
        }

    def pack(self, plane: DataPlane, metadata: Mapping[str, Any]) -> dict[str, bytes]:
        """``write_controller_sidecars``'s data-plane step: :meth:`prepare`, kept for
        :meth:`take_pending`. Not the replay view again: ``controller_state.json`` holds it
        (restore and the audit read it there first)."""
        user = {key: value for key, value in metadata.items() if key != "replay"}
        self._pending = self.prepare(plane, user)
        return self._pending.files

    def take_pending(self) -> SegmentedWrite:
        """What the last :meth:`pack` prepared (once)."""
        pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("no data-plane segments were prepared for this snapshot")
        return pending

    def prepare(self, plane: DataPlane, user_metadata: Mapping[str, Any]) -> SegmentedWrite:
        """The segments and ``metadata.json`` of ``plane`` (a capture's copy)."""
        gone = self._check_gone() & set(self._records)
        if gone:
            log.warning("data segments gone from storage, their rows rewritten: %s", gone)
            self.missing_found |= gone
            self.forget(gone)  # their rows go into the new segment
        live: dict[str, int] = {}
        placement: Placement = {}
        fresh: dict[str, dict[str, Mapping[str, Any]]] = {}
        for partition in PARTITIONS:
            known, placed = self._placement.get(partition, {}), {}
            fresh[partition] = {}
            for key, row in plane.rows_of(partition).items():
                before = known.get(key)
                if before is not None and before[0] is row:
                    placed[key] = before
                    live[before[1]] = live.get(before[1], 0) + 1
                else:
                    fresh[partition][key] = row
            placement[partition] = placed
        compact = choose_compaction(live, self._records)
        compacted = 0
        for partition, placed in placement.items():
            for key in [k for k, (_, segment) in placed.items() if segment in compact]:
                row, _ = placed.pop(key)
                fresh[partition][key] = row
                compacted += 1
        referenced = {key: self._records[key] for key in live if key not in compact}
        new_segments: dict[str, bytes] = {}
        new_rows = sum(len(rows) for rows in fresh.values())
        if new_rows:
            data = pack_segment(fresh)
            digest = hashlib.sha256(data).hexdigest()
            record = SegmentRecord(data_segment_key(digest), digest, len(data), new_rows)
            new_segments[record.key] = data
            referenced[record.key] = record
            for partition, rows in fresh.items():
                for key, row in rows.items():
                    placement[partition][key] = (row, record.key)
        order = sorted(referenced)
        index = self._stage_index(placement, fresh, referenced, rewrite=bool(gone))
        metadata = chained_metadata(user_metadata, order, index.head())
        chain, self._staged_ledger, self._gone = self._staged_ledger, None, None
        return SegmentedWrite(
            files={DATA_PLANE_METADATA_FILE: metadata},
            new_segments=new_segments,
            referenced=referenced,
            placement=placement,
            new_rows=new_rows - compacted,
            compacted_rows=compacted,
            ledger_chain=chain,
            index_chain=index,
        )

    def _stage_index(
        self,
        placement: Placement,
        fresh: Mapping[str, Mapping[str, Any]],
        referenced: Mapping[str, SegmentRecord],
        *,
        rewrite: bool,
    ) -> ChainStage:
        """``metadata.json``'s row index as a chain: the rows placed in a new segment and the
        rows gone since the committed placement, not every row (``rewrite``: the committed
        index may name a segment that is gone, so write it whole)."""
        short = {key: json.dumps(segment_short_id(key)) for key in referenced}

        def everything() -> dict[str, str]:
            return {
                f"{partition}/{key}": short[segment]
                for partition, placed in placement.items()
                for key, (_, segment) in placed.items()
            }

        put = {
            f"{partition}/{key}": short[placement[partition][key][1]]
            for partition, rows in fresh.items()
            for key in rows
        }
        drop = [
            f"{partition}/{key}"
            for partition in PARTITIONS
            for key in self._placement.get(partition, {}).keys() - placement[partition].keys()
        ]
        live = _index_bytes(placement)
        return self.index_chain.stage_changes(
            put, sorted(drop), live, everything, rewrite=rewrite, gone=self._check_gone()
        )

    def commit(self, write: SegmentedWrite) -> None:
        """``write``'s manifest is published: the next snapshot builds on it."""
        self._placement = write.placement
        self._records = dict(write.referenced)
        if write.ledger_chain is not None:
            self.ledger_chain.commit(write.ledger_chain)
        if write.index_chain is not None:
            self.index_chain.commit(write.index_chain)
