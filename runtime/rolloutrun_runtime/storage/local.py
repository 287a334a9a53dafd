"""file:// backend: a directory tree made crash-safe with tmp file + fsync + rename.

Preemption is SIGKILL at an arbitrary instruction, so every write goes to a hidden temporary
file in the target directory, is fsynced, then renamed over the key (atomic on POSIX) and the
directory is fsynced so the rename itself survives a power loss. Create-only writes use
``link(2)`` instead of rename: it fails if the name exists, so exactly one writer wins, and
the winner's content is complete before its name appears. Newly created directories are
fsynced into their parents. Temporary files never show up in listings.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from .errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
)
from .keys import TMP_PREFIX, check_create_only_size, normalize_prefix, validate_key

log = logging.getLogger(__name__)

COPY_CHUNK = 4 * 1024 * 1024


class LocalStorage:
    """:class:`~.base.CheckpointStorage` over a local (or mounted) directory."""

    def __init__(self, root: Path) -> None:
        if not root.is_absolute():
            raise StorageError(str(root), "file:// storage needs an absolute path")
        self.root = Path(os.path.normpath(root))
        self.base_uri = "file://" + self.root.as_posix().rstrip("/")

    def __repr__(self) -> str:
        return f"LocalStorage({self.base_uri!r})"

    # -- addressing -------------------------------------------------------------------------

    def uri_for(self, key: str) -> str:
        return f"{self.base_uri}/{validate_key(key, base_uri=self.base_uri)}"

    def path_for(self, key: str) -> Path:
        """The local path of ``key``."""
        return self.root.joinpath(*validate_key(key, base_uri=self.base_uri).split("/"))

    # -- writes -----------------------------------------------------------------------------

    def write_bytes(self, key: str, data: bytes, *, durable: bool = True) -> None:
        if durable:
            self._write_atomic(key, lambda f: f.write(data), exclusive=False)
        else:
            self._write_atomic(key, lambda f: f.write(data), exclusive=False, sync=False)

    def write_many(self, items: Mapping[str, bytes]) -> None:
        """Each file whole (temporary file, fsync, rename), then each directory fsynced once:
        those written into and the parents of those created (a new snapshot's folder and
        its subfolders cost one fsync each, not one per folder created plus one per write)."""
        directories: set[Path] = set()
        for key, data in items.items():
            write = lambda f, data=data: f.write(data)  # noqa: E731 - binds this item's data
            created = self._write_atomic(key, write, exclusive=False, sync_dir=False)
            directories.add(self.path_for(key).parent)
            directories.update(path.parent for path in created)
        for directory in sorted(directories, reverse=True):  # the deepest first
            inside = directory.is_relative_to(self.root) and directory != self.root
            where = directory.relative_to(self.root).as_posix() if inside else ""
            with _translated(f"{self.base_uri}/{where}" if where else self.base_uri):
                _fsync_dir(directory)

    def write_bytes_if_absent(self, key: str, data: bytes) -> None:
        check_create_only_size(self.uri_for(key), len(data))
        self._write_atomic(key, lambda f: f.write(data), exclusive=True)

    def upload_file(self, key: str, local_path: Path) -> None:
        def copy(dst: BinaryIO) -> None:
            try:
                with open(local_path, "rb") as src:
                    shutil.copyfileobj(src, dst, COPY_CHUNK)
            except OSError as exc:
                raise StorageError(str(local_path), f"cannot read source file: {exc}") from exc

        self._write_atomic(key, copy, exclusive=False)

    def _write_atomic(
        self,
        key: str,
        fill: Callable[[BinaryIO], object],
        *,
        exclusive: bool,
        sync_dir: bool = True,
        sync: bool = True,
    ) -> list[Path]:
        """Write ``key`` whole; returns the directories it created (already fsynced into
        their parents unless ``sync_dir`` is False: then the caller fsyncs them and the
        key's directory). ``sync`` False: no fsync at all (a hint's write)."""
        path = self.path_for(key)  # validates the key: the URI needs no second check
        uri = f"{self.base_uri}/{key}"
        with _translated(uri):
            created = _makedirs(path.parent)
            if sync_dir and sync:
                for directory in created:
                    _fsync_dir(directory.parent)
            tmp = path.parent / f"{TMP_PREFIX}{path.name}.{uuid.uuid4().hex}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            try:
                with os.fdopen(fd, "wb") as f:
                    fill(f)
                    f.flush()
                    if sync:
                        os.fsync(f.fileno())
                if exclusive:
                    try:
                        os.link(tmp, path)
                    except FileExistsError as exc:
                        raise ObjectExistsError(uri, "object already exists") from exc
                    except OSError as exc:
                        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                            raise
                        raise StorageError(
                            uri,
                            "the filesystem does not support hard links, which create-only "
                            f"commits need ({exc.strerror})",
                        ) from exc
                    os.unlink(tmp)
                else:
                    os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            if sync_dir and sync:
                _fsync_dir(path.parent)
        return created

    # -- reads ------------------------------------------------------------------------------

    def read_bytes(self, key: str) -> bytes:
        path = self.path_for(key)
        uri = self.uri_for(key)
        try:
            return path.read_bytes()
        except NotADirectoryError as exc:
            raise ObjectNotFoundError(uri, "no such object (a parent is a file)") from exc
        except OSError as exc:
            raise _translate_os_error(exc, uri) from exc

    def upload_files(self, items: Mapping[str, Path]) -> None:
        for key, local_path in items.items():
            self.upload_file(key, local_path)

    def download_file(self, key: str, local_path: Path) -> None:
        src = self.path_for(key)
        uri = self.uri_for(key)
        local_path = Path(local_path)
        tmp = local_path.parent / f"{TMP_PREFIX}{local_path.name}.{uuid.uuid4().hex}"
        with _translated(uri):
            fsrc = open(src, "rb")  # noqa: SIM115 - closed below; opened first for ENOENT
        try:
            with fsrc, open(tmp, "wb") as fdst:
                shutil.copyfileobj(fsrc, fdst, COPY_CHUNK)
                fdst.flush()
                os.fsync(fdst.fileno())
            os.replace(tmp, local_path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise _translate_os_error(exc, str(local_path)) from exc

    def exists(self, key: str) -> bool:
        path = self.path_for(key)
        with _translated(self.uri_for(key)):
            return path.is_file()

    def list(self, prefix: str = "") -> list[str]:
        return sorted(key for key, _ in self._listed(prefix))

    def modified_times(self, prefix: str = "") -> dict[str, float]:
        times = {}
        for key, path in self._listed(prefix):
            try:
                times[key] = os.stat(path).st_mtime
            except FileNotFoundError:
                continue  # deleted since the listing
        return times

    def _listed(self, prefix: str) -> tuple[tuple[str, str], ...]:
        """Each key under ``prefix`` and its path."""
        prefix = normalize_prefix(prefix, base_uri=self.base_uri)
        top = self.path_for(prefix) if prefix else self.root
        with _translated(f"{self.base_uri}/{prefix}" if prefix else self.base_uri):
            return tuple(self._walk(top))

    def _walk(self, top: Path) -> Iterator[tuple[str, str]]:
        """Keys and paths under ``top``, temporary files left out. Paths are cut as strings
        (a snapshot's publication lists the snapshots' tree more than once: no ``Path`` per
        folder and file)."""

        def on_error(exc: OSError) -> None:
            # A missing or not-a-directory prefix lists as empty; anything else is real.
            if not isinstance(exc, FileNotFoundError | NotADirectoryError):
                raise exc

        cut = len(str(self.root).rstrip("/")) + 1
        for dirpath, _dirnames, filenames in os.walk(top, onerror=on_error):
            rel = dirpath[cut:]
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    continue
                yield (f"{rel}/{name}" if rel else name), os.path.join(dirpath, name)

    # -- deletes ----------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        path = self.path_for(key)
        with _translated(self.uri_for(key)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            _fsync_dir(path.parent)

    def delete_prefix(self, prefix: str, *, durable: bool = True) -> int:
        prefix = normalize_prefix(prefix, base_uri=self.base_uri)
        listed = self._listed(prefix)
        touched: set[str] = set()
        for key, path in listed:
            with _translated(f"{self.base_uri}/{key}"):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
            touched.add(os.path.dirname(path))
        for directory in sorted(touched) if durable else ():  # once per directory, not object
            with _translated(f"{self.base_uri}/{prefix}"):
                _fsync_dir(Path(directory))
        top = self.path_for(prefix) if prefix else self.root
        _prune_empty_dirs(top, keep=self.root)
        log.debug("deleted %d objects under %s/%s", len(listed), self.base_uri, prefix)
        return len(listed)

    def remove_stale_temp_files(self, older_than_s: float = 3600.0) -> int:
        """Delete temporary files left by killed writers, if older than ``older_than_s``.

        A SIGKILLed writer leaves its ``.rr-tmp-*`` file behind (never visible as a key, but
        it holds disk space). Files younger than the threshold may belong to a live writer
        and are kept. Returns how many were removed.
        """
        cutoff = time.time() - older_than_s
        removed = 0
        for dirpath, _dirnames, filenames in os.walk(self.root):
            for name in filenames:
                if not name.startswith(TMP_PREFIX):
                    continue
                path = Path(dirpath) / name
                with contextlib.suppress(FileNotFoundError):
                    if path.stat().st_mtime < cutoff:
                        path.unlink()
                        removed += 1
                        log.info("removed stale temporary file %s", path)
        return removed


# -- helpers ----------------------------------------------------------------------------------


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (renames, links, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _makedirs(path: Path) -> list[Path]:
    """``mkdir -p``; returns the directories it created, outermost first (their parents'
    entries changed: the caller fsyncs them)."""
    if path.is_dir():
        return []
    missing: list[Path] = []
    cur = path
    while not cur.exists():
        missing.append(cur)
        if cur.parent == cur:
            break
        cur = cur.parent
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        created.append(d)
    return created


def _prune_empty_dirs(top: Path, *, keep: Path) -> None:
    """Remove empty directories under and including ``top`` (never ``keep``), best effort."""
    if not top.is_dir():
        return
    for dirpath, _dirnames, _filenames in os.walk(top, topdown=False):
        d = Path(dirpath)
        if d == keep:
            continue
        with contextlib.suppress(OSError):
            os.rmdir(d)


def _translate_os_error(exc: OSError, uri: str) -> StorageError:
    """Map an ``OSError`` to the storage hierarchy, keeping the OS's words."""
    detail = exc.strerror or str(exc)
    if isinstance(exc, FileNotFoundError):
        return ObjectNotFoundError(uri, "no such object")
    if isinstance(exc, PermissionError) or exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return StoragePermissionError(uri, f"permission denied ({detail})")
    if isinstance(exc, NotADirectoryError):
        return StorageError(uri, f"a parent path is not a directory ({detail})")
    if isinstance(exc, IsADirectoryError):
        return StorageError(uri, f"the key names a directory, not an object ({detail})")
    return StorageError(uri, f"{type(exc).__name__}: {detail}")


@contextlib.contextmanager
def _translated(uri: str) -> Iterator[None]:
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        raise _translate_os_error(exc, uri) from exc
