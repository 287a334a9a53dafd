"""Checkpoint storage: one ``CheckpointStorage`` protocol over ``str`` URIs, two backends.

``open_storage("file:///dir")`` (or a bare absolute path) gives the crash-safe local backend,
``open_storage("gs://bucket/prefix")`` the Google Cloud Storage one. On top of either,
:func:`publish_entry` / :func:`list_committed` / :func:`delete_entry` implement "files
first, marker last" publication: readers trust only committed entries.

The gs:// backend imports ``google.cloud.storage`` only when opened, so file:// users and the
operator image never need the Google libraries. See ``docs/storage.md``.
"""

from .after_commit import AfterCommit
from .base import (
    CheckpointStorage,
    close_storage,
    open_storage,
    parse_gs_uri,
    start_writer_process,
    with_writer_process,
)
from .errors import (
    BucketNotFoundError,
    InvalidKeyError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
    TransientStorageError,
    UnsupportedStorageError,
)
from .keys import join_key, validate_key
from .publish import (
    delete_entry,
    is_committed,
    list_committed,
    publish_entry,
    read_json,
    write_json,
)
from .retry import RetryPolicy

__all__ = [
    "AfterCommit",
    "BucketNotFoundError",
    "CheckpointStorage",
    "InvalidKeyError",
    "ObjectExistsError",
    "ObjectNotFoundError",
    "RetryPolicy",
    "StorageError",
    "StoragePermissionError",
    "TransientStorageError",
    "UnsupportedStorageError",
    "close_storage",
    "delete_entry",
    "is_committed",
    "join_key",
    "list_committed",
    "open_storage",
    "parse_gs_uri",
    "publish_entry",
    "read_json",
    "start_writer_process",
    "validate_key",
    "with_writer_process",
    "write_json",
]
