"""The ``CheckpointStorage`` contract and the URI dispatcher.

Snapshots, manifests and trainer checkpoints address storage only through ``str`` URIs and
this protocol (torchtitan's pattern), so the same code runs against a local directory in
local mode and a GCS bucket on a cluster. Keys are '/'-separated paths relative to the
storage's base URI and are validated identically on every backend (see :mod:`.keys`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable
from urllib.parse import urlsplit

from .errors import UnsupportedStorageError
from .keys import key_problem
from .retry import RetryPolicy


@runtime_checkable
class CheckpointStorage(Protocol):
    """Object storage under one base URI; every method names objects by relative key."""

    base_uri: str

    def uri_for(self, key: str) -> str:
        """The absolute URI of ``key`` (``<base_uri>/<key>``)."""
        ...

    def write_bytes(self, key: str, data: bytes, *, durable: bool = True) -> None:
        """Create or atomically replace ``key``: readers see the old or new content, whole.

        ``durable=False`` (hints only, such as a LATEST pointer that readers verify): the
        write may be lost, or the old content back, after a power loss (file:// skips its
        fsyncs); a process kill loses nothing either way."""
        ...

    def write_many(self, items: Mapping[str, bytes]) -> None:
        """:meth:`write_bytes` for several keys; all are durable when it returns.

        Each object appears whole or not at all; if it raises, some may have been written.
        Lets a backend batch its durability work (file:// syncs each directory once).
        """
        ...

    def write_bytes_if_absent(self, key: str, data: bytes) -> None:
        """Create ``key`` only if absent; otherwise raise ``ObjectExistsError``.

        Exactly one of several concurrent writers succeeds. This is the commit primitive for
        markers and manifests; keep the payload small (at most 8 MiB).
        """
        ...

    def read_bytes(self, key: str) -> bytes:
        """The content of ``key``; ``ObjectNotFoundError`` if it does not exist."""
        ...

    def upload_file(self, key: str, local_path: Path) -> None:
        """Like :meth:`write_bytes` from a local file, streamed (chunked on gs://)."""
        ...

    def upload_files(self, items: Mapping[str, Path]) -> None:
        """:meth:`upload_file` for several keys (concurrently on gs://); all durable on return.

        If it raises, some may have been written, but none is still being written."""
        ...

    def download_file(self, key: str, local_path: Path) -> None:
        """Copy ``key`` to ``local_path`` (replaced atomically); ``ObjectNotFoundError``."""
        ...

    def exists(self, key: str) -> bool:
        """Whether ``key`` exists."""
        ...

    def list(self, prefix: str = "") -> list[str]:
        """All keys strictly under ``prefix`` (a key or ``""``), recursive, sorted."""
        ...

    def list_entries(self, prefix: str, marker_name: str) -> dict[str, bool]:
        """Each folder directly under ``prefix`` that holds an object (at any depth) -> whether
        it holds ``marker_name`` directly: what :meth:`list` says of them
        (:func:`~.keys.entries_of`), without listing every object where the backend can
        (file:// reads the folders and checks each marker, not every file below them)."""
        ...

    def modified_times(self, prefix: str = "") -> dict[str, float]:
        """Each key under ``prefix`` (as :meth:`list`) -> when it was last written, in seconds
        since the epoch as the storage records it (file mtime; GCS ``updated``). Lets a
        collector spare objects too young to be garbage (a publication still in flight)."""
        ...

    def delete(self, key: str) -> None:
        """Delete ``key``; a missing key is not an error."""
        ...

    def delete_prefix(self, prefix: str, *, durable: bool = True) -> int:
        """Delete every key under ``prefix``; return how many were deleted.

        ``durable=False``: some deletes may be undone by a power loss (file:// skips its
        directory fsyncs), for files an already durable uncommit made garbage."""
        ...


def open_storage(
    uri: str, *, client: Any = None, retry: RetryPolicy | None = None
) -> CheckpointStorage:
    """Open the storage at ``uri``: ``file:///abs/dir``, ``/abs/dir`` or ``gs://bucket/prefix``.

    ``client`` is an optional ``google.cloud.storage.Client`` for gs:// (default: one built
    from the environment; see :mod:`.gcs`). ``retry`` tunes the transient-error retries of
    gs:// (default :class:`RetryPolicy`). Nothing is contacted here: errors such as a missing
    bucket surface on the first operation.
    """
    if not isinstance(uri, str) or not uri:
        raise UnsupportedStorageError(repr(uri), "storage URI must be a non-empty str")
    if uri.startswith("/"):
        from .local import LocalStorage

        return LocalStorage(Path(uri))
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise UnsupportedStorageError(
                uri, f"file:// URIs must not name a host ({parts.netloc!r}); use file:///abs/dir"
            )
        if not parts.path.startswith("/"):
            raise UnsupportedStorageError(uri, "file:// URI needs an absolute path")
        if parts.query or parts.fragment:
            raise UnsupportedStorageError(uri, "file:// URI must not have a query or fragment")
        from .local import LocalStorage

        return LocalStorage(Path(parts.path))
    if scheme == "gs":
        bucket, prefix = parse_gs_uri(uri)
        from .gcs import GcsStorage

        return GcsStorage(bucket, prefix, client=client, retry=retry)
    if not scheme:
        raise UnsupportedStorageError(
            uri, "relative paths are not accepted; use an absolute path, file:// or gs://"
        )
    raise UnsupportedStorageError(
        uri, f"unknown storage scheme {scheme!r} (supported: file://, gs://, absolute paths)"
    )


def parse_gs_uri(uri: str) -> tuple[str, str]:
    """Split ``gs://bucket/some/prefix`` into ``("bucket", "some/prefix")``, validated."""
    parts = urlsplit(uri)
    if parts.scheme.lower() != "gs":
        raise UnsupportedStorageError(uri, "not a gs:// URI")
    if parts.query or parts.fragment:
        raise UnsupportedStorageError(uri, "gs:// URI must not have a query or fragment")
    bucket = parts.netloc
    problem = bucket_name_problem(bucket)
    if problem is not None:
        raise UnsupportedStorageError(uri, problem)
    prefix = parts.path.strip("/")
    if prefix:
        key_issue = key_problem(prefix)
        if key_issue is not None:
            raise UnsupportedStorageError(uri, f"bad object prefix: {key_issue}")
    return bucket, prefix


def bucket_name_problem(bucket: str) -> str | None:
    """Why ``bucket`` is not a GCS bucket name, or ``None`` (a subset of GCS's rules)."""
    if not bucket:
        return "gs:// URI names no bucket (expected gs://bucket/prefix)"
    if not 3 <= len(bucket) <= 222:
        return f"bucket name {bucket!r} must be 3 to 222 characters"
    allowed = set("abcdefghijklmnopqrstuvwxyz0123456789-_.")
    if not set(bucket) <= allowed:
        return f"bucket name {bucket!r} may contain only a-z, 0-9, '-', '_' and '.'"
    if not (bucket[0].isalnum() and bucket[-1].isalnum()):
        return f"bucket name {bucket!r} must start and end with a letter or digit"
    return None


def with_writer_process(storage: CheckpointStorage) -> CheckpointStorage:
    """``storage`` with its bulk writes and deletes done by a child process where that
    helps (file://: :mod:`.writer_process`); gs:// (HTTP uploads in threads) as it is.
    Close it with :func:`close_storage`."""
    from .local import LocalStorage

    return storage.with_writer_process() if isinstance(storage, LocalStorage) else storage


def start_writer_process(storage: CheckpointStorage) -> None:
    """Start ``storage``'s writer process now rather than at its first bulk write (file://);
    nothing for the others."""
    from .local import LocalStorage

    if isinstance(storage, LocalStorage):
        storage.start_writer()


def close_storage(storage: CheckpointStorage) -> None:
    """End what ``storage`` started (a writer process); nothing for the others."""
    from .local import LocalStorage

    if isinstance(storage, LocalStorage):
        storage.close()
