"""The publication primitive: files first, one small create-only marker last.

A checkpoint entry (a snapshot, a trainer checkpoint) is a set of files under one prefix. It
counts as published only once its marker exists, and the marker is written after every file
with a create-only write, so:

* a reader that trusts only marked entries (:func:`list_committed`) never sees an entry whose
  files are incomplete, whatever instant the writer was killed at;
* of two publishers of the same entry exactly one commits; the other gets
  :class:`ObjectExistsError`. A publisher that finds the marker already present fails
  before touching any file, so nothing already published changes. (Two publishers racing on
  the same *uncommitted* entry may interleave their file writes; the trainer lease fences
  that case off, see ARCHITECTURE.md.)
* deletion removes the marker first, durably, so a half-deleted entry is no longer
  committed; its files' deletes need not be durable (one a power loss undoes leaves a file
  of an uncommitted entry, garbage that retention removes again), so file:// fsyncs only
  the marker's folder;
* a publisher's ``before_commit`` check (the trainer's lease: is it still the newest
  incarnation?) runs after the last file and immediately before the marker, so a writer
  that lost its right while uploading commits nothing, however long the upload took.

On file:// every file and directory is fsynced before the marker's link, on gs:// the
marker's ``ifGenerationMatch=0`` upload is the commit point.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rolloutrun_runtime.contract.layout import COMMIT_MARKER

from .after_commit import AfterCommit
from .base import CheckpointStorage
from .errors import InvalidKeyError, ObjectExistsError, StorageError
from .keys import join_key, key_problem, normalize_prefix, validate_key
from .local import LocalStorage

log = logging.getLogger(__name__)


def _check_marker_name(where: str, marker_name: str) -> None:
    if "/" in marker_name or key_problem(marker_name) is not None:
        raise InvalidKeyError(where, f"marker name {marker_name!r} must be one plain path part")


def _marker_key(storage: CheckpointStorage, entry_prefix: str, marker_name: str) -> str:
    entry = validate_key(entry_prefix.rstrip("/"), base_uri=storage.base_uri)
    _check_marker_name(f"{storage.base_uri}/{entry}", marker_name)
    return join_key(entry, marker_name)


def publish_entry(
    storage: CheckpointStorage,
    entry_prefix: str,
    files: Mapping[str, bytes | Path],
    *,
    marker_name: str = COMMIT_MARKER,
    marker_payload: bytes = b"",
    before_commit: Callable[[], None] | None = None,
    shared: Mapping[str, bytes] | None = None,
    after_commit: AfterCommit | None = None,
) -> str:
    """Write ``files`` under ``entry_prefix/``, then commit with the marker; return its URI.

    ``files`` maps relative names (keys, may contain '/') to bytes or a local file to upload.
    ``shared`` maps full keys outside the entry (content-addressed data it references and
    other entries may share) to bytes: written, durable, in the same call as the entry's
    files (one request, not two, where the storage batches its writes).
    ``after_commit``: hints and entries' deletes run right after the commit, on file:// in
    the commit's own call of the writer process (:mod:`.after_commit`; its outcome is filled
    in; nothing of it runs if the commit fails).
    Raises :class:`ObjectExistsError` if the entry is already committed (nothing is written)
    or if a concurrent publisher committed it first. ``before_commit`` runs once every file
    is durable, immediately before the marker: whatever it raises propagates and nothing is
    committed (the files stay behind as an uncommitted leftover).
    """
    marker = _marker_key(storage, entry_prefix, marker_name)
    entry = marker.rsplit("/", 1)[0]
    keys: dict[str, bytes | Path] = {}
    for name, content in files.items():
        validate_key(name, base_uri=f"{storage.base_uri}/{entry}")
        if name == marker_name:
            raise InvalidKeyError(storage.uri_for(marker), "a file may not use the marker's name")
        if not isinstance(content, bytes | bytearray | memoryview | Path):
            raise TypeError(
                f"{storage.uri_for(join_key(entry, name))}: content must be bytes or a Path, "
                f"not {type(content).__name__}"
            )
        keys[join_key(entry, name)] = content
    if storage.exists(marker):
        raise ObjectExistsError(storage.uri_for(marker), "entry is already committed")
    for key in shared or {}:
        if key == entry or key.startswith(entry + "/"):
            raise InvalidKeyError(storage.uri_for(key), "a shared file may not be in the entry")
    # all durable before the marker; gs:// uploads each group in parallel
    written = {**(shared or {})}
    written.update((k, bytes(v)) for k, v in sorted(keys.items()) if not isinstance(v, Path))
    if isinstance(storage, LocalStorage):
        # file://: the marker's bytes go with the files (fsynced under a hidden name, by
        # the writer process where there is one); the commit point is the link, here
        staged = storage.stage(marker, marker_payload)
        storage.write_many(written, stage=staged)
        try:
            storage.upload_files({k: v for k, v in sorted(keys.items()) if isinstance(v, Path)})
            if before_commit is not None:
                before_commit()
        except BaseException:
            storage.drop_staged(staged)
            raise
        storage.commit_staged(staged, after_commit)
    else:
        storage.write_many(written)
        storage.upload_files({k: v for k, v in sorted(keys.items()) if isinstance(v, Path)})
        if before_commit is not None:
            before_commit()
        storage.write_bytes_if_absent(marker, marker_payload)
        if after_commit is not None:
            after_commit.run(
                lambda key, data: storage.write_bytes(key, data, durable=False),
                lambda marker: delete_entry(storage, *marker.rsplit("/", 1)),  # entry, name
            )
    uri = storage.uri_for(marker)
    log.info("published %d files and committed %s", len(keys), uri)
    return uri


def list_committed(
    storage: CheckpointStorage, prefix: str, marker_name: str = COMMIT_MARKER
) -> list[str]:
    """Entry prefixes (keys) strictly under ``prefix`` whose marker exists, sorted."""
    prefix = normalize_prefix(prefix, base_uri=storage.base_uri)
    _check_marker_name(f"{storage.base_uri}/{prefix}", marker_name)
    suffix = "/" + marker_name
    entries = [
        key[: -len(suffix)]
        for key in storage.list(prefix)
        if key.endswith(suffix) and key[: -len(suffix)] != prefix
    ]
    return sorted(entries)


def is_committed(
    storage: CheckpointStorage, entry_prefix: str, marker_name: str = COMMIT_MARKER
) -> bool:
    """Whether ``entry_prefix`` has its marker."""
    return storage.exists(_marker_key(storage, entry_prefix, marker_name))


def delete_entry(
    storage: CheckpointStorage, entry_prefix: str, marker_name: str = COMMIT_MARKER
) -> int:
    """Uncommit ``entry_prefix`` (marker first, durably), then delete its files (not
    durably: they are garbage once the marker is gone); return files deleted."""
    marker = _marker_key(storage, entry_prefix, marker_name)
    if isinstance(storage, LocalStorage):
        deleted = storage.delete_entry(marker)  # one call of its writer process, if any
    else:
        storage.delete(marker)
        deleted = storage.delete_prefix(marker.rsplit("/", 1)[0], durable=False)
    log.info("deleted entry %s (%d files)", storage.uri_for(marker.rsplit("/", 1)[0]), deleted)
    return deleted


def write_json(storage: CheckpointStorage, key: str, obj: Any, *, if_absent: bool = False) -> None:
    """Write ``obj`` as UTF-8 JSON (sorted keys); create-only when ``if_absent``."""
    data = json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False).encode("utf-8")
    if if_absent:
        storage.write_bytes_if_absent(key, data)
    else:
        storage.write_bytes(key, data)


def read_json(storage: CheckpointStorage, key: str) -> Any:
    """Read and decode a JSON object written by :func:`write_json`."""
    data = storage.read_bytes(key)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StorageError(storage.uri_for(key), f"not valid JSON: {exc}") from exc
