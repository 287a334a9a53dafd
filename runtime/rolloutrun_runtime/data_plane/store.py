"""A partitioned, in-memory row store with checkpoint files: the seed's TQ stand-in.

Why a store at all: the rollout pump and the train pump never hand tensors to each other
directly. Finished rollouts land in ``staging`` (keyed by the episode's capture key) and a
sealed group's canonical training rows in ``train`` (keyed ``<group_id>_g<i>``); the train
pump reads them by key and clears them once its optimizer step is committed. Because every
row lives here, a checkpoint can save exactly the rows that the recovery ledger and the
replay metadata reference, and a restore can check the two against each other.

Rows are flat mappings of field name to a numpy array or a scalar (int, float, str, bool).
Saved checkpoints are one ``rows.npz`` (no pickle) plus ``metadata.json``; both are plain
bytes so the caller can publish them through any ``CheckpointStorage``.

Why columns (format 2): a rollout snapshot is taken every few seconds and writes every row
kept for replay, on the trainer's own interpreter. Format 1 stored one npz member per row
field (thousands of tiny members, ~125 ms of GIL-bound work for 144 rows, enough to cost a
tenth of the rollout throughput at one snapshot a second). Format 2 stores one column per
(partition, field, kind, dtype): arrays concatenated flat with their shapes beside them,
numeric scalars as one array, strings in the JSON index. Format 1 still reads.

Why segments (format 3, rollout snapshots only): at 10,000 buffered groups rewriting every
row each snapshot costs seconds. A snapshot's ``metadata.json`` instead names, for each row,
the segment that holds it: an npz of format-2 columns whose ``segment_index`` member is its
JSON column index (:func:`pack_segment`). Segments are written once and shared by the
snapshots that list them (the writer: ``algorithms/rollout_checkpointing/data_segments``).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from rolloutrun_runtime.contract.layout import (
    CHAINED_DATA_PLANE_FORMAT,
    DATA_PLANE_FORMAT,
    DATA_PLANE_METADATA_FILE,
    DATA_SEGMENT_FORMAT,
    READABLE_DATA_PLANE_FORMATS,
    ROWS_FILE,
    SEGMENTED_DATA_PLANE_FORMAT,
)
from rolloutrun_runtime.cow import CowMap, CowView
from rolloutrun_runtime.data_plane.npz import npz_bytes
from rolloutrun_runtime.json_chain import ChainError, read_chain

logger = logging.getLogger(__name__)

#: The partitions every data plane has: canonical training rows and staged rollout results.
PARTITIONS = ("train", "staging")


RowValue = np.ndarray | int | float | str | bool
Row = Mapping[str, RowValue]

_SCALAR_KINDS: dict[type, str] = {bool: "bool", int: "int", float: "float", str: "str"}


class DataPlaneError(RuntimeError):
    """The data plane was used wrongly, or a checkpoint of it cannot be read."""


class RowNotFoundError(DataPlaneError, KeyError):
    """A row key is not in the partition."""


def _check_partition(partition: str) -> None:
    if partition not in PARTITIONS:
        raise DataPlaneError(f"unknown partition {partition!r}; the data plane has {PARTITIONS}")


def _value_kind(key: str, field: str, value: Any) -> str:
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise DataPlaneError(f"row {key!r} field {field!r}: object arrays cannot be stored")
        return "array"
    kind = _SCALAR_KINDS.get(type(value))
    if kind is None:
        raise DataPlaneError(
            f"row {key!r} field {field!r}: {type(value).__name__} is not storable "
            "(use a numpy array, int, float, str or bool)"
        )
    return kind


class DataPlane:
    """Rows by partition and key; ``put``/``get``/``clear``/``list``, ``save``/``load``."""

    def __init__(self) -> None:
        # copy-on-write partitions: ``copy`` costs what changed since the previous copy
        self._rows: dict[str, dict[str, dict[str, RowValue]]] = {p: CowMap() for p in PARTITIONS}

    # ------------------------------------------------------------------ row access
    def put(self, partition: str, key: str, row: Row) -> None:
        """Store ``row`` under ``key`` (replacing any row with that key)."""
        _check_partition(partition)
        for field, value in row.items():
            _value_kind(key, field, value)
        self._rows[partition][key] = dict(row)

    def get(self, partition: str, key: str) -> dict[str, RowValue]:
        """The row under ``key``; raises ``RowNotFoundError`` if there is none."""
        _check_partition(partition)
        try:
            return self._rows[partition][key]
        except KeyError:
            raise RowNotFoundError(f"no row {key!r} in partition {partition!r}") from None

    def get_many(self, partition: str, keys: Iterable[str]) -> list[dict[str, RowValue]]:
        """The rows under ``keys``, in order; any missing key raises ``RowNotFoundError``."""
        return [self.get(partition, key) for key in keys]

    def contains(self, partition: str, key: str) -> bool:
        _check_partition(partition)
        return key in self._rows[partition]

    def clear(self, partition: str, keys: Iterable[str]) -> int:
        """Remove the rows under ``keys`` (missing keys are ignored); returns how many went."""
        _check_partition(partition)
        rows = self._rows[partition]
        removed = 0
        for key in keys:
            if rows.pop(key, None) is not None:
                removed += 1
        return removed

    def list(self, partition: str) -> list[str]:
        """The keys in ``partition``, sorted."""
        _check_partition(partition)
        return sorted(self._rows[partition])

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._rows.values())

    def rows_of(self, partition: str) -> Mapping[str, Mapping[str, RowValue]]:
        """A read-only view of ``partition``'s rows by key (a copy's, for its writer)."""
        _check_partition(partition)
        return MappingProxyType(self._rows[partition])

    def copy(self) -> DataPlaneCopy:
        """A read-only copy that shares the row dicts: a row is replaced (``put`` stores a
        new dict), never mutated, so the copy cannot see a change made after it. Taking it
        costs the partitions' changes since the previous copy (their copy-on-write logs,
        :mod:`rolloutrun_runtime.cow`), not one entry per row: the snapshot's cut takes it,
        and the copy builds its maps when first read, after the cut."""
        return DataPlaneCopy({p: _cow(rows).view() for p, rows in self._rows.items()})

    def prime_copies(self) -> None:
        """Ahead of a cut: make the next ``copy`` cost only what changes from now on (the
        first copy, or one after a long gap, copies the partitions whole here instead)."""
        for rows in self._rows.values():
            _cow(rows).prime()

    # ------------------------------------------------------------------ checkpoints
    def to_files(self, metadata: Mapping[str, Any]) -> dict[str, bytes]:
        """The checkpoint as ``{file name: bytes}``: ``rows.npz`` and ``metadata.json``.

        ``metadata`` is the caller's (JSON-serializable); the rows' sha256, format version
        and per-partition keys are added so ``from_files`` can check what it reads.
        """
        arrays: dict[str, np.ndarray] = {}
        index: dict[str, Any] = {}
        for partition, rows in self._rows.items():
            index[partition] = _pack_partition(partition, rows, arrays)
        rows_bytes = npz_bytes(arrays)
        full_metadata = {
            "user": dict(metadata),
            "format": DATA_PLANE_FORMAT,
            "rows_sha256": hashlib.sha256(rows_bytes).hexdigest(),
            "index": index,
        }
        try:
            meta_bytes = json.dumps(full_metadata, sort_keys=True).encode()
        except TypeError as error:
            raise DataPlaneError(f"checkpoint metadata is not JSON: {error}") from error
        return {ROWS_FILE: rows_bytes, DATA_PLANE_METADATA_FILE: meta_bytes}

    @classmethod
    def from_files(
        cls, files: Mapping[str, bytes], segments: Mapping[str, bytes] | None = None
    ) -> tuple[DataPlane, dict[str, Any]]:
        """Rebuild a data plane from ``to_files`` output (or a segmented ``metadata.json``
        and the ``segments`` it names, by key); returns it and the user metadata."""
        if DATA_PLANE_METADATA_FILE not in files:
            raise DataPlaneError(f"data-plane checkpoint lacks {DATA_PLANE_METADATA_FILE}")
        try:
            meta = json.loads(files[DATA_PLANE_METADATA_FILE])
        except ValueError as error:
            raise DataPlaneError(f"data-plane metadata is not valid JSON: {error}") from error
        if meta.get("format") not in READABLE_DATA_PLANE_FORMATS:
            raise DataPlaneError(
                f"data-plane checkpoint format {meta.get('format')!r} is not supported "
                f"(this runtime reads formats {', '.join(map(str, READABLE_DATA_PLANE_FORMATS))})"
            )
        if meta["format"] in (SEGMENTED_DATA_PLANE_FORMAT, CHAINED_DATA_PLANE_FORMAT):
            meta = expand_index(meta, segments or {})
            return _from_segments(cls(), meta, segments or {}), dict(meta["user"])
        if ROWS_FILE not in files:
            raise DataPlaneError(f"data-plane checkpoint lacks {ROWS_FILE}")
        rows_bytes = files[ROWS_FILE]
        if hashlib.sha256(rows_bytes).hexdigest() != meta.get("rows_sha256"):
            raise DataPlaneError("data-plane rows do not match the sha256 in their metadata")
        plane = cls()
        unpack = _unpack_partition if meta["format"] == 2 else _unpack_partition_v1
        try:
            with np.load(io.BytesIO(rows_bytes), allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
            for partition, packed in meta["index"].items():
                _check_partition(partition)
                plane._rows[partition] = CowMap(unpack(packed, arrays))
        except (KeyError, ValueError, TypeError, IndexError) as error:
            raise DataPlaneError(f"data-plane checkpoint is malformed: {error!r}") from error
        return plane, dict(meta["user"])

    def save_checkpoint(self, directory: str | Path, metadata: Mapping[str, Any]) -> None:
        """Write ``rows.npz`` and ``metadata.json`` into ``directory`` (created if needed)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name, data in self.to_files(metadata).items():
            (directory / name).write_bytes(data)

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        """Replace this store's rows with the checkpoint in ``directory``; returns its metadata."""
        directory = Path(directory)
        try:
            files = {
                name: (directory / name).read_bytes()
                for name in (ROWS_FILE, DATA_PLANE_METADATA_FILE)
            }
        except FileNotFoundError as error:
            raise DataPlaneError(f"no data-plane checkpoint in {directory}: {error}") from error
        loaded, metadata = self.from_files(files)
        self._rows = loaded._rows
        logger.info("loaded data plane from %s: %d rows", directory, len(self))
        return metadata


def _cow(rows: dict[str, dict[str, RowValue]]) -> CowMap[str, dict[str, RowValue]]:
    if not isinstance(rows, CowMap):
        raise DataPlaneError("a data-plane partition that is not copy-on-write cannot be copied")
    return rows


class DataPlaneCopy(DataPlane):
    """What ``DataPlane.copy`` returns: each partition's copy-on-write view, built into its
    map on first read (off the event loop, by whoever serializes the copy). Read-only:
    its maps are shared with the views the store's next copies build on."""

    def __init__(self, views: Mapping[str, CowView[str, dict[str, RowValue]]]) -> None:
        self._views = dict(views)
        self._built: dict[str, dict[str, dict[str, RowValue]]] | None = None

    @property
    def _rows(self) -> dict[str, dict[str, dict[str, RowValue]]]:
        if self._built is None:
            self._built = {p: view.mapping() for p, view in self._views.items()}
        return self._built

    @_rows.setter
    def _rows(self, rows: dict[str, dict[str, dict[str, RowValue]]]) -> None:
        self._built = rows

    def changed_rows(self) -> dict[str, int]:
        """Per partition, the rows taking this copy logged (changed since the previous
        copy; 0 for a partition copied whole)."""
        return {p: view.changed for p, view in self._views.items()}

    def put(self, partition: str, key: str, row: Row) -> None:
        raise DataPlaneError("a data-plane copy is read-only (it shares rows with its store)")

    def clear(self, partition: str, keys: Iterable[str]) -> int:
        raise DataPlaneError("a data-plane copy is read-only (it shares rows with its store)")

    def copy(self) -> DataPlaneCopy:
        return DataPlaneCopy({p: CowView(full=rows) for p, rows in self._rows.items()})

    def prime_copies(self) -> None:
        pass

    def load_checkpoint(self, directory: str | Path) -> dict[str, Any]:
        raise DataPlaneError("a data-plane copy is read-only (it shares rows with its store)")


def segmented_metadata(
    user: Mapping[str, Any], segment_keys: list[str], index: Mapping[str, Any]
) -> bytes:
    """A segmented (format 3) ``metadata.json``: per partition the sorted row keys and, for
    each, its segment's position in ``segment_keys``."""
    full = {
        "user": dict(user),
        "format": SEGMENTED_DATA_PLANE_FORMAT,
        "segments": list(segment_keys),
        "index": dict(index),
    }
    try:
        return json.dumps(full, sort_keys=True).encode()
    except TypeError as error:
        raise DataPlaneError(f"checkpoint metadata is not JSON: {error}") from error


def chained_metadata(
    user: Mapping[str, Any], segment_keys: list[str], chain: list[dict[str, Any]]
) -> bytes:
    """A format-4 ``metadata.json``: format 3 with its row index as a chain of chunks
    (:mod:`rolloutrun_runtime.json_chain`), each entry ``"<partition>/<row key>"`` to
    :func:`segment_short_id` of the segment holding the row."""
    full = {
        "user": dict(user),
        "format": CHAINED_DATA_PLANE_FORMAT,
        "segments": list(segment_keys),
        "index_chain": chain,
    }
    try:
        return json.dumps(full, sort_keys=True).encode()
    except TypeError as error:
        raise DataPlaneError(f"checkpoint metadata is not JSON: {error}") from error


def segment_short_id(segment_key: str) -> str:
    """How a chained index names a segment: its hash's first 16 hex digits (the name is the
    hash), stable while the list of segments changes around it."""
    return segment_key.rsplit("/", 1)[-1][:16]


def expand_index(meta: dict[str, Any], chunks: Mapping[str, bytes]) -> dict[str, Any]:
    """``meta`` with a format-4 index chain read from ``chunks`` (key -> bytes) into format
    3's index (per partition the sorted keys and their segments' positions); other formats
    as they are. ``DataPlaneError`` naming a missing or malformed chunk or entry."""
    if meta.get("format") != CHAINED_DATA_PLANE_FORMAT:
        return meta
    try:
        entries = read_chain(meta["index_chain"], chunks, "data-plane metadata.json index")
        position = {segment_short_id(key): at for at, key in enumerate(meta["segments"])}
        if len(position) != len(meta["segments"]):
            raise DataPlaneError("data-plane metadata.json: two segments share a short id")
        placed: dict[str, dict[str, int]] = {}
        for entry, short in entries.items():
            partition, _, key = entry.partition("/")
            _check_partition(partition)
            if short not in position:
                raise DataPlaneError(
                    f"data-plane metadata.json index: row {entry!r} names segment {short!r}, "
                    "not one of its segments"
                )
            placed.setdefault(partition, {})[key] = position[short]
    except ChainError as error:
        raise DataPlaneError(str(error)) from error
    except (KeyError, TypeError, AttributeError) as error:
        raise DataPlaneError(f"data-plane metadata.json is malformed: {error!r}") from error
    index = {
        partition: {"keys": sorted(rows), "segment": [rows[k] for k in sorted(rows)]}
        for partition, rows in placed.items()
    }
    return {**{k: v for k, v in meta.items() if k != "index_chain"}, "index": index}


#: The npz member of a segment that holds its JSON column index.
SEGMENT_INDEX_MEMBER = "segment_index"


def pack_segment(rows: Mapping[str, Mapping[str, Mapping[str, RowValue]]]) -> bytes:
    """Rows by partition and key as one segment: format-2 columns in an npz (no pickle)
    whose ``segment_index`` member is the JSON column index."""
    arrays: dict[str, np.ndarray] = {}
    index = {p: _pack_partition(p, r, arrays) for p, r in rows.items() if r}
    header = json.dumps({"format": DATA_SEGMENT_FORMAT, "index": index}, sort_keys=True)
    arrays[SEGMENT_INDEX_MEMBER] = np.frombuffer(header.encode(), dtype=np.uint8)
    return npz_bytes(arrays)  # np.savez's archive, without zipfile's per-member cost


def unpack_segment(data: bytes) -> dict[str, dict[str, dict[str, RowValue]]]:
    """A segment's rows by partition and key (``DataPlaneError`` if it is malformed)."""
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        header = json.loads(arrays.pop(SEGMENT_INDEX_MEMBER).tobytes())
        if header.get("format") != DATA_SEGMENT_FORMAT:
            raise ValueError(f"segment format {header.get('format')!r}")
        for partition in header["index"]:
            _check_partition(partition)
        return {p: _unpack_partition(packed, arrays) for p, packed in header["index"].items()}
    except (KeyError, ValueError, TypeError, IndexError, OSError) as error:
        raise DataPlaneError(f"data-plane segment is malformed: {error!r}") from error


def _from_segments(
    plane: DataPlane, meta: Mapping[str, Any], segments: Mapping[str, bytes]
) -> DataPlane:
    """Fill ``plane`` from a segmented ``metadata.json`` and the segments it names."""
    try:
        names: list[str] = list(meta["segments"])
        missing = [name for name in names if name not in segments]
        if missing:
            raise DataPlaneError(f"data-plane checkpoint lacks segments {missing}")
        unpacked = [unpack_segment(segments[name]) for name in names]
        for partition, packed in meta["index"].items():
            _check_partition(partition)
            keys, where = packed["keys"], packed["segment"]
            if len(keys) != len(where):
                raise DataPlaneError(f"partition {partition!r}: keys and segments differ")
            plane._rows[partition] = CowMap(
                {key: unpacked[at][partition][key] for key, at in zip(keys, where, strict=True)}
            )
    except (KeyError, IndexError, TypeError) as error:
        raise DataPlaneError(
            f"data-plane checkpoint names a row its segment lacks: {error!r}"
        ) from error
    return plane


def row_keys_in(
    metadata: Mapping[str, Any], chunks: Mapping[str, bytes] | None = None
) -> dict[str, list[str]]:
    """A data-plane checkpoint's row keys by partition, from ``metadata.json`` alone (and a
    format-4 index's ``chunks``).

    For readers that check what a checkpoint holds without loading its rows (the audit).
    """
    if metadata.get("format") not in READABLE_DATA_PLANE_FORMATS:
        raise DataPlaneError(
            f"data-plane checkpoint format {metadata.get('format')!r} is not supported "
            f"(this runtime reads formats {', '.join(map(str, READABLE_DATA_PLANE_FORMATS))})"
        )
    index = expand_index(dict(metadata), chunks or {}).get("index", {})
    if metadata["format"] == 1:
        return {partition: sorted(rows) for partition, rows in index.items()}
    return {partition: sorted(packed["keys"]) for partition, packed in index.items()}


#: numpy dtypes of the numeric scalar columns.
_SCALAR_DTYPES = {"bool": np.bool_, "int": np.int64, "float": np.float64}


def _pack_partition(
    partition: str, rows: Mapping[str, Mapping[str, RowValue]], arrays: dict[str, np.ndarray]
) -> dict[str, Any]:
    """One partition's rows as columns; adds the column arrays to ``arrays``, returns the index.

    A column holds one (field, kind, dtype, ndim) across the rows that have it, listed by
    their position in the sorted keys.
    """
    keys = sorted(rows)
    groups: dict[tuple[str, str, str, int], tuple[list[int], list[Any]]] = {}
    for position, key in enumerate(keys):
        for field, value in rows[key].items():
            kind = _value_kind(key, field, value)
            if kind == "array":
                assert isinstance(value, np.ndarray)
                column = (field, kind, value.dtype.str, value.ndim)
            else:
                column = (field, kind, "", 0)
            members = groups.setdefault(column, ([], []))
            members[0].append(position)
            members[1].append(value)
    columns: list[dict[str, Any]] = []
    for (field, kind, dtype, ndim), (positions, values) in sorted(groups.items()):
        name = f"{partition}.{len(columns)}"
        entry: dict[str, Any] = {"field": field, "kind": kind, "rows": positions}
        if kind == "array":
            entry.update(dtype=dtype, data=name, shapes=f"{name}.shapes")
            arrays[name] = np.concatenate([v.ravel() for v in values]).astype(dtype, copy=False)
            arrays[f"{name}.shapes"] = np.array([v.shape for v in values], np.int64).reshape(
                len(values), ndim
            )
        elif kind == "str":
            entry["values"] = values
        else:
            try:
                arrays[name] = np.array(values, dtype=_SCALAR_DTYPES[kind])
            except OverflowError as error:
                raise DataPlaneError(
                    f"partition {partition!r} field {field!r}: an int does not fit 64 bits"
                ) from error
            entry["data"] = name
        columns.append(entry)
    return {"keys": keys, "columns": columns}


def _unpack_partition(
    packed: Mapping[str, Any], arrays: Mapping[str, np.ndarray]
) -> dict[str, dict[str, RowValue]]:
    keys: list[str] = packed["keys"]
    rows: list[dict[str, RowValue]] = [{} for _ in keys]
    for column in packed["columns"]:
        field, kind, positions = column["field"], column["kind"], column["rows"]
        if kind == "array":
            flat, shapes = arrays[column["data"]], arrays[column["shapes"]]
            if flat.dtype.str != column["dtype"] or len(shapes) != len(positions):
                raise ValueError(f"column {column['data']} does not match its index")
            sizes = np.prod(shapes, axis=1, dtype=np.int64) if len(shapes) else shapes
            ends = np.cumsum(sizes)
            if len(ends) and ends[-1] != flat.size:
                raise ValueError(f"column {column['data']}: shapes do not cover its data")
            start = 0
            for position, shape, end in zip(positions, shapes.tolist(), ends.tolist(), strict=True):
                rows[position][field] = flat[start:end].reshape(shape)
                start = end
        elif kind == "str":
            for position, text in zip(positions, column["values"], strict=True):
                rows[position][field] = str(text)
        else:
            convert = {"bool": bool, "int": int, "float": float}[kind]
            values = arrays[column["data"]].tolist()
            for position, value in zip(positions, values, strict=True):
                rows[position][field] = convert(value)
    return dict(zip(keys, rows, strict=True))


def _unpack_partition_v1(
    packed: Mapping[str, Mapping[str, str]], arrays: Mapping[str, np.ndarray]
) -> dict[str, dict[str, RowValue]]:
    """Format 1: one npz member per row field, named in ``"<kind>:<member>"`` specs."""
    rows: dict[str, dict[str, RowValue]] = {}
    for key, kinds in packed.items():
        row: dict[str, RowValue] = {}
        for field, spec in kinds.items():
            kind, name = spec.split(":", 1)
            array = arrays[name]
            row[field] = array if kind == "array" else _scalar(kind, array)
        rows[key] = row
    return rows


def _scalar(kind: str, array: np.ndarray) -> RowValue:
    value = array.item()
    if kind == "bool":
        return bool(value)
    if kind == "int":
        return int(value)
    if kind == "float":
        return float(value)
    return str(value)
