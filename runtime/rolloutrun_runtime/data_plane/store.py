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
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from rolloutrun_runtime.contract.layout import (
    DATA_PLANE_FORMAT,
    DATA_PLANE_METADATA_FILE,
    READABLE_DATA_PLANE_FORMATS,
    ROWS_FILE,
)

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
        self._rows: dict[str, dict[str, dict[str, RowValue]]] = {p: {} for p in PARTITIONS}

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

    def copy(self) -> DataPlane:
        """A copy-on-write view: new partition maps that share the row dicts. A row is
        replaced (``put`` stores a new dict), never mutated, so the copy cannot see a change
        made after it; it costs one map copy per partition, not one dict per row (the
        snapshot's cut takes it)."""
        clone = DataPlane()
        for partition, rows in self._rows.items():
            clone._rows[partition] = dict(rows)
        return clone

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
        buffer = io.BytesIO()
        np.savez(buffer, allow_pickle=False, **arrays)
        rows_bytes = buffer.getvalue()
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
    def from_files(cls, files: Mapping[str, bytes]) -> tuple[DataPlane, dict[str, Any]]:
        """Rebuild a data plane from ``to_files`` output; returns it and the user metadata."""
        try:
            rows_bytes, meta_bytes = files[ROWS_FILE], files[DATA_PLANE_METADATA_FILE]
        except KeyError as error:
            raise DataPlaneError(f"data-plane checkpoint lacks {error.args[0]}") from None
        try:
            meta = json.loads(meta_bytes)
        except ValueError as error:
            raise DataPlaneError(f"data-plane metadata is not valid JSON: {error}") from error
        if meta.get("format") not in READABLE_DATA_PLANE_FORMATS:
            raise DataPlaneError(
                f"data-plane checkpoint format {meta.get('format')!r} is not supported "
                f"(this runtime reads formats {', '.join(map(str, READABLE_DATA_PLANE_FORMATS))})"
            )
        if hashlib.sha256(rows_bytes).hexdigest() != meta.get("rows_sha256"):
            raise DataPlaneError("data-plane rows do not match the sha256 in their metadata")
        plane = cls()
        unpack = _unpack_partition if meta["format"] == 2 else _unpack_partition_v1
        try:
            with np.load(io.BytesIO(rows_bytes), allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
            for partition, packed in meta["index"].items():
                _check_partition(partition)
                plane._rows[partition] = unpack(packed, arrays)
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


def row_keys_in(metadata: Mapping[str, Any]) -> dict[str, list[str]]:
    """A data-plane checkpoint's row keys by partition, from ``metadata.json`` alone.

    For readers that check what a checkpoint holds without loading its rows (the audit).
    """
    if metadata.get("format") not in READABLE_DATA_PLANE_FORMATS:
        raise DataPlaneError(
            f"data-plane checkpoint format {metadata.get('format')!r} is not supported "
            f"(this runtime reads formats {', '.join(map(str, READABLE_DATA_PLANE_FORMATS))})"
        )
    index = metadata.get("index", {})
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
