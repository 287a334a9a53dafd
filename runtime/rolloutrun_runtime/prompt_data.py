"""A user's prompt set: rows of a JSONL or Parquet file, read once and held by the trainer.

Why the trainer holds it and ``/run`` carries the row: the dataloader, the recovery ledger
and the snapshots keep only prompt ids (row numbers), as with the built-in tasks, so a
snapshot never carries prompt text and the epoch permutation, cursor, spare pool and audit
work unchanged. The environment server is the user's (docs/environment-contract.md) and
should not have to read the bucket itself: each ``POST /run`` carries the row's prompt,
answer and metadata (:class:`~rolloutrun_runtime.contract.wire.PromptPayload`).

The file is read through :mod:`rolloutrun_runtime.storage` (``gs://``, ``file://``, or a key
under the run's storage), so the same code runs against GCS and its emulator. Parquet is
read with ``pyarrow`` (imported only for a Parquet file); JSON is parsed by the standard
library. Nothing is unpickled. A bad file fails at start-up with the file, the row (1-based,
the line of a JSONL file) and the field named.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rolloutrun_runtime.contract.prompt_set import DatasetConfig, DatasetFormat
from rolloutrun_runtime.storage import StorageError, open_storage

#: The most rows a prompt set may hold (``task.datasetSize``'s bound).
MAX_ROWS = 10_000_000
_SUFFIXES = {".jsonl": DatasetFormat.JSONL, ".json": DatasetFormat.JSONL}
_SUFFIXES[".parquet"] = DatasetFormat.PARQUET


class PromptDataError(ValueError):
    """The prompt set cannot be read or a row does not fit the field mapping."""


@dataclass(frozen=True)
class PromptRow:
    """One row: the prompt text, its reference answer and the metadata passed on."""

    text: str
    answer: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def payload(self) -> dict[str, Any]:
        """The row as ``RunRequest.prompt`` carries it."""
        return {"text": self.text, "answer": self.answer, "metadata": dict(self.metadata)}


@dataclass(frozen=True)
class PromptSet:
    """The rows of one prompt file; row ``i`` is prompt id ``i``."""

    source: str
    rows: Sequence[PromptRow]

    def __len__(self) -> int:
        return len(self.rows)

    def payload(self, prompt_id: int) -> dict[str, Any]:
        if not 0 <= prompt_id < len(self.rows):
            raise PromptDataError(
                f"{self.source}: prompt id {prompt_id} is outside the set (0..{len(self.rows) - 1})"
            )
        return self.rows[prompt_id].payload()


def locate(uri: str, storage_uri: str) -> tuple[str, str]:
    """``(storage URI, key)`` of a prompt file: its directory and its name, or the run's
    storage and a relative key."""
    if uri.startswith("gs://"):
        head, _, name = uri.removeprefix("gs://").rstrip("/").rpartition("/")
        if not head or not name:
            raise PromptDataError(f"{uri}: names no object (expected gs://bucket/path/file)")
        return "gs://" + head, name
    if uri.startswith(("file://", "/")):
        head, _, name = uri.removeprefix("file://").rpartition("/")
        if not name:
            raise PromptDataError(f"{uri}: names a directory, not a file")
        return "file://" + (head or "/"), name
    return storage_uri, uri


def file_format(uri: str, declared: DatasetFormat) -> DatasetFormat:
    """The declared format, or the one the file name says (``auto``)."""
    if declared is not DatasetFormat.AUTO:
        return declared
    for suffix, fmt in _SUFFIXES.items():
        if uri.lower().endswith(suffix):
            return fmt
    raise PromptDataError(
        f"{uri}: cannot tell the format from the name (expected .jsonl, .json or .parquet); "
        "set task.dataset.format"
    )


def read_prompt_set(config: DatasetConfig, storage_uri: str, *, client: Any = None) -> PromptSet:
    """Read the prompt file ``config.uri`` (a key under ``storage_uri`` when relative)."""
    directory, key = locate(config.uri, storage_uri)
    source = config.uri if directory != storage_uri else f"{storage_uri.rstrip('/')}/{key}"
    fmt = file_format(config.uri, config.format)
    try:
        data = open_storage(directory, client=client).read_bytes(key)
    except StorageError as error:
        raise PromptDataError(f"{source}: cannot read the prompt file: {error}") from error
    records = (
        parse_jsonl(data, source) if fmt is DatasetFormat.JSONL else parse_parquet(data, source)
    )
    rows = [map_row(record, config, source, number) for number, record in records]
    if not rows:
        raise PromptDataError(f"{source}: the prompt file holds no rows")
    if len(rows) > MAX_ROWS:
        raise PromptDataError(f"{source}: {len(rows)} rows, more than {MAX_ROWS}")
    return PromptSet(source=source, rows=rows)


def parse_jsonl(data: bytes, source: str) -> list[tuple[int, Mapping[str, Any]]]:
    """``(line number, object)`` of each non-blank line (a JSON object, finite numbers)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise PromptDataError(f"{source}: not UTF-8 text ({error})") from error
    records: list[tuple[int, Mapping[str, Any]]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_constant=_refuse_constant)
        except ValueError as error:
            raise PromptDataError(f"{source}: row {number}: not valid JSON: {error}") from error
        if not isinstance(record, dict):
            raise PromptDataError(
                f"{source}: row {number}: expected a JSON object, got {type(record).__name__}"
            )
        records.append((number, record))
    return records


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_parquet(data: bytes, source: str) -> list[tuple[int, Mapping[str, Any]]]:
    """``(row number, record)`` of each row of a Parquet file (read once with pyarrow)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as error:
        raise PromptDataError(
            f"{source}: reading Parquet needs pyarrow, which is not installed"
        ) from error
    try:
        table = pq.read_table(io.BytesIO(data))
    except Exception as error:  # pyarrow raises its own ArrowInvalid / OSError kinds
        raise PromptDataError(f"{source}: not a readable Parquet file: {error}") from error
    return [(number, record) for number, record in enumerate(table.to_pylist(), start=1)]


def map_row(
    record: Mapping[str, Any], config: DatasetConfig, source: str, number: int
) -> PromptRow:
    """The row under the field mapping; a missing or ill-typed field is named."""
    where = f"{source}: row {number}"
    if config.prompt_field not in record:
        raise PromptDataError(
            f"{where}: no field {config.prompt_field!r} (task.dataset.promptField); "
            f"it has {', '.join(sorted(map(str, record))) or 'no fields'}"
        )
    text = record[config.prompt_field]
    if not isinstance(text, str) or not text:
        raise PromptDataError(
            f"{where}: field {config.prompt_field!r} must be a non-empty string, "
            f"got {type(text).__name__}"
        )
    answer = None
    if config.answer_field is not None:
        if config.answer_field not in record:
            raise PromptDataError(
                f"{where}: no field {config.answer_field!r} (task.dataset.answerField)"
            )
        answer = _json_value(record[config.answer_field], f"{where}: field {config.answer_field!r}")
    metadata: dict[str, Any] = {}
    for name in config.metadata_fields:
        if name not in record:
            raise PromptDataError(f"{where}: no field {name!r} (task.dataset.metadataFields)")
        metadata[name] = _json_value(record[name], f"{where}: field {name!r}")
    return PromptRow(text=text, answer=answer, metadata=metadata)


def _json_value(value: Any, where: str) -> Any:
    """``value`` if JSON can carry it exactly (finite numbers, str keys); else an error."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise PromptDataError(f"{where}: {value} is not a finite number")
        return value
    if isinstance(value, list):
        return [_json_value(item, where) for item in value]
    if isinstance(value, dict):
        return {str(key): _json_value(item, where) for key, item in value.items()}
    raise PromptDataError(f"{where}: a {type(value).__name__} cannot be sent as JSON")
