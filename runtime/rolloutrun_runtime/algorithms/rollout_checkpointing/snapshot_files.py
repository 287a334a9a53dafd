"""A snapshot's files in storage: what a publication writes, and each file read back checked.

Why apart from the store (:mod:`.manifest`): two layouts are read. Schemas 1-2 hold one
object per file name under the snapshot's folder; schema 3 holds one packed file whose
index is the manifest (each file record's ``offset``; :func:`.manifest_format.pack_files`).
A publication writes the pack (one write and one fsync on file://, not one per file and
folder). Every reader goes through :func:`read_snapshot_file` / :func:`read_listed`, so
restore, tools and tests take a file back the same way in either layout, checked against
its sha256; nothing read is unpickled.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest_format import (
    Candidate,
    ManifestError,
    check_file_record,
    file_record,
    pack_files,
    unpack_file,
)
from rolloutrun_runtime.contract.layout import DATA_SEGMENTS_PREFIX, PACK_FILE
from rolloutrun_runtime.storage import CheckpointStorage, ObjectNotFoundError, join_key

#: Storage reads in flight when a whole entry is read (each a round trip on ``gs://``).
READ_THREADS = 8


def publication_layout(
    files: Mapping[str, bytes | Path], pack: bool
) -> tuple[Mapping[str, bytes | Path], dict[str, dict[str, Any]], str]:
    """What a publication writes for ``files``: the objects, each file's manifest record and
    the pack's name ("" for one object per name: ``pack`` False, or a file given as a path)."""
    if pack and all(not isinstance(content, Path) for content in files.values()):
        parts, records = pack_files(files)  # type: ignore[arg-type]
        return {PACK_FILE: b"".join(parts)}, records, PACK_FILE
    return files, {name: file_record(content) for name, content in files.items()}, ""


def read_snapshot_file(storage: CheckpointStorage, candidate: Candidate, name: str) -> bytes:
    """A snapshot file's bytes (taken from ``candidate.verified`` when ``verify`` read it),
    checked against the manifest's record: its own object, or its slice of the pack."""
    if name in candidate.verified:
        return candidate.verified[name]
    expected = candidate.manifest.files.get(name)
    key = join_key(candidate.entry, name)
    if expected is None:
        raise ManifestError(f"{storage.uri_for(key)}: not listed in the manifest")
    if candidate.manifest.pack:
        return read_packed(storage, candidate, [name])[name]
    data = storage.read_bytes(key)
    check_file_record(storage.uri_for(key), data, expected)
    return data


def read_packed(
    storage: CheckpointStorage, candidate: Candidate, names: Collection[str]
) -> dict[str, bytes]:
    """Files ``names`` of a packed snapshot: the pack read once, each file its slice, checked."""
    key = join_key(candidate.entry, candidate.manifest.pack)
    try:
        pack = storage.read_bytes(key)
    except ObjectNotFoundError as error:
        raise ManifestError(
            f"{candidate.manifest_uri}: file {candidate.manifest.pack} is missing"
        ) from error
    uri, records = storage.uri_for(key), candidate.manifest.files
    return {name: unpack_file(uri, pack, name, records[name]) for name in names}


def read_segment(storage: CheckpointStorage, candidate: Candidate, key: str) -> bytes:
    """A data-plane segment's bytes, verified against the manifest's checksum."""
    if key in candidate.verified:
        return candidate.verified[key]
    expected = candidate.manifest.segments.get(key)
    if expected is None or not key.startswith(DATA_SEGMENTS_PREFIX + "/"):
        raise ManifestError(
            f"{candidate.manifest_uri}: segment {key} is not one of its data segments"
        )
    try:
        data = storage.read_bytes(key)
    except ObjectNotFoundError as error:
        raise ManifestError(f"{candidate.manifest_uri}: segment {key} is missing") from error
    check_file_record(storage.uri_for(key), data, expected)
    return data


def read_listed(storage: CheckpointStorage, candidate: Candidate) -> dict[str, bytes]:
    """Every file and data segment the manifest lists, read and checked concurrently (on
    ``gs://`` each is a round trip before the first redispatch; a packed snapshot's files
    are one read). Results are taken in the listed order, so a failure is the one a
    sequential read would have met first."""
    names = sorted(candidate.manifest.files)
    keys = sorted(candidate.manifest.segments)
    with ThreadPoolExecutor(READ_THREADS) as pool:
        if candidate.manifest.pack:
            packed = pool.submit(read_packed, storage, candidate, names)
        else:
            files = [pool.submit(_read_listed_file, storage, candidate, n) for n in names]
        segments = [pool.submit(read_segment, storage, candidate, key) for key in keys]
    if candidate.manifest.pack:
        read = packed.result()
    else:
        read = {name: future.result() for name, future in zip(names, files, strict=True)}
    read.update({key: future.result() for key, future in zip(keys, segments, strict=True)})
    return read


def _read_listed_file(storage: CheckpointStorage, candidate: Candidate, name: str) -> bytes:
    try:
        return read_snapshot_file(storage, candidate, name)
    except ObjectNotFoundError as error:
        raise ManifestError(f"{candidate.manifest_uri}: file {name} is missing") from error
