"""Keyed JSON documents written as a chain of content-addressed chunks: only what changed.

Why: a snapshot's ledger sidecar held every group's JSON, written whole at each snapshot
(~55 ms of writer CPU at 10,000 groups, for groups that mostly did not change since the
last snapshot). A document that is an ordered map ``{id: JSON value}`` is written here as a
*chain*: chunk files, each ``{"format": "json-chain/1", "put": {id: value, ...}, "drop":
[id, ...]}``, that a reader applies in order starting from an empty map. A put of a known
id replaces its value in place, a new id goes to the end, a drop removes it: exactly how a
Python dict changes, so the reader rebuilds the writer's map in the writer's order.

A snapshot writes one new chunk with the entries put or dropped since the last *published*
snapshot (:meth:`ChainWriter.stage`, kept by :meth:`ChainWriter.commit` only once its
manifest is published, like the data-plane segments) and lists every chunk of the chain,
with its sha256 and size, in its own (small) head file. A chunk is content-addressed (the
name is the hash of its bytes), so chunks are shared by the snapshots that list them and
never change. The chain is rewritten as one chunk when it would hold more than
``REWRITE_FACTOR`` times the live entries' bytes or more than ``MAX_CHUNKS`` chunks, when
the order of the map is not the one the chain gives (an entry moved), or when a chunk the
chain needs is gone from storage.

The reader (:func:`read_chain`) checks each chunk against the head's checksum and size and
refuses a missing, truncated or malformed chunk with an error naming it. Nothing is
unpickled: chunks are JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

#: Format tag inside a chunk.
CHAIN_CHUNK_FORMAT = "json-chain/1"
#: The chain is rewritten whole once its chunks hold this many times the live bytes ...
REWRITE_FACTOR = 2.0
#: ... or once it has this many chunks (a reader reads each one).
MAX_CHUNKS = 32


class ChainError(ValueError):
    """A chain's head or one of its chunks is missing, truncated or malformed."""


@dataclasses.dataclass(frozen=True)
class ChunkRecord:
    """One chunk of a chain: its storage key, checksum and size."""

    key: str
    sha256: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "sha256": self.sha256, "bytes": self.size}

    @classmethod
    def from_json(cls, data: Any, where: str) -> ChunkRecord:
        if not isinstance(data, dict) or set(data) != {"key", "sha256", "bytes"}:
            raise ChainError(f"{where}: a chunk record is {{key, sha256, bytes}}, got {data!r}")
        key, sha, size = data["key"], data["sha256"], data["bytes"]
        if not (isinstance(key, str) and isinstance(sha, str) and type(size) is int):
            raise ChainError(f"{where}: malformed chunk record {data!r}")
        return cls(key, sha, size)


@dataclasses.dataclass
class ChainStage:
    """One snapshot's chain, ready to publish: its chunks (in order) and the new ones."""

    records: list[ChunkRecord]
    new_files: dict[str, bytes]
    entries: dict[str, str]
    chain_bytes: int
    live_bytes: int
    rewritten: bool
    put: int

    def head(self) -> list[dict[str, Any]]:
        """The chunk list a head document holds."""
        return [record.to_json() for record in self.records]


def encode_chunk(put: Mapping[str, str], drop: Collection[str]) -> bytes:
    """A chunk's bytes: ``put``'s values are JSON texts already, joined, not re-encoded."""
    body = ",".join(f"{json.dumps(key)}:{text}" for key, text in put.items())
    dropped = json.dumps(list(drop))
    return f'{{"drop":{dropped},"format":"{CHAIN_CHUNK_FORMAT}","put":{{{body}}}}}'.encode()


def _order_kept(
    previous: Mapping[str, str], current: Mapping[str, str], drop: list[str], new: list[str]
) -> bool:
    """Whether applying a delta to ``previous`` gives ``current``'s order: the surviving
    entries in their old order, then the new ones in theirs."""
    if drop:
        gone = set(drop)
        return [key for key in previous if key not in gone] + new == list(current)
    return [*previous, *new] == list(current)


class ChainWriter:
    """Remembers the chain the last published snapshot listed; stages the next one."""

    def __init__(self, key_of: Callable[[str], str]) -> None:
        """``key_of(sha256)``: the storage key of a chunk with that hash."""
        self._key_of = key_of
        self._entries: dict[str, str] = {}
        self._records: list[ChunkRecord] = []
        self._chain_bytes = 0
        self._live_bytes = 0

    @property
    def keys(self) -> list[str]:
        """The chunk keys of the committed chain."""
        return [record.key for record in self._records]

    def stage(
        self, current: Mapping[str, str], *, gone: Collection[str] = (), ordered: bool = True
    ) -> ChainStage:
        """The chain for ``current`` (id -> JSON text): the committed chain and one chunk of
        what changed, or one chunk of everything (see the module's rules). ``gone``: chunk
        keys storage no longer holds; ``ordered``: whether the map's order matters."""
        previous = self._entries
        # texts are shared, never changed in place: an entry changed is a new object
        put = {key: text for key, text in current.items() if previous.get(key) is not text}
        new = [key for key in put if key not in previous]
        drop = [] if len(previous) + len(new) == len(current) else _dropped(previous, current)
        live = self._live_bytes + sum(_size(key, text) for key, text in put.items())
        live -= sum(_size(key, previous[key]) for key in [*drop, *put] if key in previous)
        rewrite = (
            not self._records
            or any(record.key in gone for record in self._records)
            or len(self._records) + 1 > MAX_CHUNKS
            or (ordered and not _order_kept(previous, current, drop, new))
        )
        return self._finish(put, drop, live, rewrite, lambda: current, dict(current))

    def stage_changes(
        self,
        put: Mapping[str, str],
        drop: list[str],
        live: int,
        everything: Callable[[], Mapping[str, str]],
        *,
        rewrite: bool = False,
        gone: Collection[str] = (),
    ) -> ChainStage:
        """:meth:`stage` for a writer that knows what changed (``put``, ``drop``) without
        comparing every entry, and the map's ``live`` bytes; ``everything()`` is the whole
        map, called only for a rewrite. The order of such a map does not matter (its reader
        sorts), and the stage keeps no copy of it."""
        rewrite = (
            rewrite
            or not self._records
            or any(record.key in gone for record in self._records)
            or len(self._records) + 1 > MAX_CHUNKS
        )
        return self._finish(dict(put), drop, live, rewrite, everything, {})

    def _finish(
        self,
        put: dict[str, str],
        drop: list[str],
        live: int,
        rewrite: bool,
        everything: Callable[[], Mapping[str, str]],
        entries: dict[str, str],
    ) -> ChainStage:
        records = [] if rewrite else list(self._records)
        chain_bytes = 0 if rewrite else self._chain_bytes
        if not rewrite and (put or drop):
            data = encode_chunk(put, drop)
            if chain_bytes + len(data) > REWRITE_FACTOR * max(live, 1):
                rewrite, records, chain_bytes = True, [], 0
        if rewrite:
            put, drop = dict(everything()), []
            live = sum(_size(key, text) for key, text in put.items())
        new_files: dict[str, bytes] = {}
        if rewrite or put or drop:
            data = encode_chunk(put, drop)
            sha = hashlib.sha256(data).hexdigest()
            record = ChunkRecord(self._key_of(sha), sha, len(data))
            records.append(record)
            new_files[record.key] = data
            chain_bytes += len(data)
        return ChainStage(
            records=records,
            new_files=new_files,
            entries=entries,
            chain_bytes=chain_bytes,
            live_bytes=live,
            rewritten=rewrite,
            put=len(put),
        )

    def commit(self, stage: ChainStage) -> None:
        """``stage``'s snapshot is published: the next one builds on its chain."""
        self._entries = stage.entries
        self._records = list(stage.records)
        self._chain_bytes = stage.chain_bytes
        self._live_bytes = stage.live_bytes

    def seed(self, records: list[ChunkRecord], live_bytes: int) -> None:
        """Start from a chain a restored snapshot listed (for :meth:`stage_changes`, whose
        changes are then counted from that snapshot's map)."""
        self._entries, self._records = {}, list(records)
        self._chain_bytes, self._live_bytes = sum(r.size for r in records), live_bytes

    def forget(self) -> None:
        """Start over: the next stage writes the whole map."""
        self._entries, self._records, self._chain_bytes, self._live_bytes = {}, [], 0, 0


def _size(key: str, text: str) -> int:
    """An entry's bytes in a chunk, about (the key's quotes, colon and comma)."""
    return len(key) + len(text) + 4


def _dropped(previous: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    return [key for key in previous if key not in current]


def read_chain(records_json: Any, chunks: Mapping[str, bytes], where: str) -> dict[str, Any]:
    """The map a chain gives: its chunks (``chunks``: key -> bytes) applied in order, each
    checked against its record; ``ChainError`` naming ``where`` and the chunk otherwise."""
    if not isinstance(records_json, list):
        raise ChainError(f"{where}: the chunk list must be a list, got {records_json!r}")
    entries: dict[str, Any] = {}
    for index, record_json in enumerate(records_json):
        record = ChunkRecord.from_json(record_json, f"{where} chunk {index}")
        data = chunks.get(record.key)
        if data is None:
            raise ChainError(f"{where}: chunk {record.key} is missing")
        if len(data) != record.size or hashlib.sha256(data).hexdigest() != record.sha256:
            raise ChainError(
                f"{where}: chunk {record.key} is truncated or changed ({len(data)} bytes, "
                f"expected {record.size} with sha256 {record.sha256})"
            )
        _apply(entries, data, f"{where}: chunk {record.key}")
    return entries


def _apply(entries: dict[str, Any], data: bytes, where: str) -> None:
    try:
        chunk = json.loads(data)
    except ValueError as error:
        raise ChainError(f"{where} is not valid JSON: {error}") from error
    if not isinstance(chunk, dict) or set(chunk) != {"format", "put", "drop"}:
        raise ChainError(f"{where} is not a chain chunk (format, put, drop)")
    if chunk["format"] != CHAIN_CHUNK_FORMAT:
        raise ChainError(f"{where}: format {chunk['format']!r} is not {CHAIN_CHUNK_FORMAT!r}")
    put, drop = chunk["put"], chunk["drop"]
    if not isinstance(put, dict) or not isinstance(drop, list):
        raise ChainError(f"{where}: put must be an object and drop a list")
    for key in drop:
        if key not in entries:
            raise ChainError(f"{where} drops {key!r}, which the chain does not hold")
        del entries[key]
    entries.update(put)
