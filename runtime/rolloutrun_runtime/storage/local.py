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
import dataclasses
import errno
import itertools
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from .errors import (
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
)
from .keys import TMP_PREFIX, check_create_only_size, normalize_prefix, validate_key

if TYPE_CHECKING:
    from .after_commit import AfterCommit
    from .writer_process import WriterProcess

log = logging.getLogger(__name__)

COPY_CHUNK = 4 * 1024 * 1024

#: Temporary names: this process's random token and a counter, not a ``getrandom`` call per
#: write (each syscall on the writer thread is one more hand-over of the interpreter lock
#: the trainer waits on); a forked child draws its own token. ``O_EXCL`` guards anyway.
_tmp_token = os.urandom(8).hex()
_tmp_counter = itertools.count()


def _renew_tmp_token() -> None:
    global _tmp_token
    _tmp_token = os.urandom(8).hex()


os.register_at_fork(after_in_child=_renew_tmp_token)


def _tmp_path(path: str) -> str:
    """A fresh hidden temporary name beside ``path`` (this process's token and counter)."""
    head, name = os.path.split(path)
    return f"{head}/{TMP_PREFIX}{name}.{_tmp_token}{next(_tmp_counter):x}"


@dataclasses.dataclass(frozen=True)
class StagedCreate:
    """A create-only object written ahead under a hidden name (:meth:`LocalStorage.stage`):
    ``tmp`` is the temporary file's name in ``key``'s folder; linking it to ``key``
    (:meth:`LocalStorage.commit_staged`) is the create-only write."""

    key: str
    tmp: str
    data: bytes


class LocalStorage:
    """:class:`~.base.CheckpointStorage` over a local (or mounted) directory."""

    def __init__(self, root: Path, *, writer: WriterProcess | None = None) -> None:
        """``writer``: a child process that runs the writes, deletes and ``modified_times``
        (see :mod:`.writer_process`); the create-only writes and the reads run here."""
        if not root.is_absolute():
            raise StorageError(str(root), "file:// storage needs an absolute path")
        self.root = Path(os.path.normpath(root))
        self._root_str = str(self.root).rstrip("/")
        self.base_uri = "file://" + self.root.as_posix().rstrip("/")
        self._writer = writer

    def with_writer_process(self) -> LocalStorage:
        """The same directory, its writes (but the create-only ones) and deletes done by a
        child process started on first use (:meth:`close` ends it)."""
        from .writer_process import WriterProcess

        return LocalStorage(self.root, writer=WriterProcess(self.root))

    def start_writer(self) -> None:
        """Start the writer process now, if this storage has one (see :meth:`close`)."""
        if self._writer is not None:
            self._writer.start()

    def close(self) -> None:
        """End the writer process, if any (a later bulk write starts a new one)."""
        if self._writer is not None:
            self._writer.close()

    def __repr__(self) -> str:
        return f"LocalStorage({self.base_uri!r})"

    # -- addressing -------------------------------------------------------------------------

    def uri_for(self, key: str) -> str:
        return f"{self.base_uri}/{validate_key(key, base_uri=self.base_uri)}"

    def path_for(self, key: str) -> Path:
        """The local path of ``key``."""
        return self.root.joinpath(*validate_key(key, base_uri=self.base_uri).split("/"))

    def _path_str(self, key: str) -> str:
        """The local path of ``key`` as a string (no ``Path`` objects on the hot path)."""
        return f"{self._root_str}/{validate_key(key, base_uri=self.base_uri)}"

    # -- writes -----------------------------------------------------------------------------

    def write_bytes(self, key: str, data: bytes, *, durable: bool = True) -> None:
        if self._writer is not None:
            key = validate_key(key, base_uri=self.base_uri)
            self._writer.write_bytes(key, data, durable=durable)
            return
        self._write_atomic(key, data, exclusive=False, sync=durable)

    def write_many(
        self,
        items: Mapping[str, bytes],
        *,
        after_file: Callable[[], None] | None = None,
        stage: StagedCreate | None = None,
    ) -> None:
        """Each file whole (temporary file, fsync, rename), then each directory fsynced once:
        those written into and the parents of those created (a new snapshot's folder and
        its subfolders cost one fsync each, not one per folder created plus one per write).
        ``after_file`` runs after each file's rename (the writer process's crash site).
        ``stage``: a create-only object's bytes, written and fsynced under its hidden name
        in the same pass (:meth:`stage`; nothing of it is visible until it is linked).

        Paths are strings and each folder is checked once per call: a snapshot's publication
        runs on the trainer's writer thread, and every ``Path`` and ``stat`` there is time
        the trainer's event loop waits for the interpreter lock (with a writer process, the
        keys are checked here and the files written there)."""
        if self._writer is not None:
            for key in items:
                validate_key(key, base_uri=self.base_uri)
            self._writer.write_many(items, stage)
            return
        directories: set[str] = set()

        def folder_of(path: str) -> None:
            parent = os.path.dirname(path)
            if parent not in directories:
                directories.add(parent)
                directories.update(os.path.dirname(d) for d in _makedirs(parent))

        for key, data in items.items():
            path = self._path_str(key)
            with _translated(f"{self.base_uri}/{key}"):
                folder_of(path)
                _write_file(path, data, f"{self.base_uri}/{key}", exclusive=False)
            if after_file is not None:
                after_file()
        if stage is not None:
            path = self._path_str(stage.key)
            with _translated(f"{self.base_uri}/{stage.key}"):
                folder_of(path)
                _write_file(self._staged_path(stage), stage.data, "", exclusive=False, keep=True)
        root = str(self.root)
        for directory in sorted(directories, reverse=True):  # the deepest first
            inside = directory.startswith(root + "/")
            where = directory[len(root) + 1 :] if inside else ""
            with _translated(f"{self.base_uri}/{where}" if where else self.base_uri):
                _fsync_dir(directory)

    def write_bytes_if_absent(self, key: str, data: bytes) -> None:
        check_create_only_size(self.uri_for(key), len(data))
        self._write_atomic(key, data, exclusive=True)

    # -- a create-only write in two halves: the bytes ahead, the link at the commit point --

    def stage(self, key: str, data: bytes) -> StagedCreate:
        """A create-only write of ``key`` prepared (nothing written yet): pass it to
        :meth:`write_many` (the bytes go with the files, fsynced under a hidden name), then
        :meth:`commit_staged` (the link: the create-only write itself) or
        :meth:`drop_staged`. With a writer process the bytes and the fsyncs are the child's
        and the link stays here: a publication's commit point costs the trainer one
        ``link`` instead of a file's write and two fsyncs (~0.5 ms of its CPU)."""
        check_create_only_size(self.uri_for(key), len(data))
        return StagedCreate(key, os.path.basename(_tmp_path(self._path_str(key))), data)

    def commit_staged(self, staged: StagedCreate, after: AfterCommit | None = None) -> None:
        """Link the staged bytes to their key (``ObjectExistsError`` if it exists), then make
        the new name durable (the temporary name removed, the folder fsynced) before
        returning: by the writer process where there is one. ``after``: run once that is
        done, in the same call of the writer process (:mod:`.after_commit`)."""
        path, uri = self._path_str(staged.key), f"{self.base_uri}/{staged.key}"
        with _translated(uri):
            _link_exclusive(self._staged_path(staged), path, uri)
        if self._writer is not None:
            self._writer.settle(staged.key, staged.tmp, after)
            return
        self.settle(staged.key, staged.tmp)
        if after is not None:
            after.run(
                lambda key, data: self.write_bytes(key, data, durable=False), self.delete_entry
            )

    def settle(self, key: str, tmp: str) -> None:
        """After :meth:`commit_staged`'s link: the temporary name removed, the folder
        fsynced (the link durable)."""
        path = self._path_str(key)
        with _translated(f"{self.base_uri}/{key}"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._staged_path(StagedCreate(key, tmp, b"")))
            _fsync_dir(os.path.dirname(path))

    def drop_staged(self, staged: StagedCreate) -> None:
        """Remove staged bytes that will not be linked (best effort: a leftover is a hidden
        temporary file, as a killed writer's)."""
        with contextlib.suppress(OSError):
            os.unlink(self._staged_path(staged))

    def _staged_path(self, staged: StagedCreate) -> str:
        if "/" in staged.tmp or not staged.tmp.startswith(TMP_PREFIX):
            raise StorageError(self.uri_for(staged.key), f"not a temporary name: {staged.tmp!r}")
        return f"{os.path.dirname(self._path_str(staged.key))}/{staged.tmp}"

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
        fill: Callable[[BinaryIO], object] | bytes,
        *,
        exclusive: bool,
        sync_dir: bool = True,
        sync: bool = True,
    ) -> list[str]:
        """Write ``key`` whole (``fill``: its bytes, or what writes them); returns the
        directories it created (already fsynced into their parents unless ``sync_dir`` is
        False: then the caller fsyncs them and the key's directory). ``sync`` False: no
        fsync at all (a hint's write)."""
        path = self._path_str(key)  # validates the key: the URI needs no second check
        uri = f"{self.base_uri}/{key}"
        with _translated(uri):
            parent = os.path.dirname(path)
            created = _makedirs(parent)
            if sync_dir and sync:
                for directory in created:
                    _fsync_dir(os.path.dirname(directory))
            _write_file(path, fill, uri, exclusive=exclusive, sync=sync)
            if sync_dir and sync:
                _fsync_dir(parent)
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

    def list_entries(self, prefix: str, marker_name: str) -> dict[str, bool]:
        """One read of ``prefix``'s folder and a check of each subfolder's marker; only a
        subfolder without one is searched for a file (a snapshot's publication asks this of
        the snapshots' folder each time: not every file of every snapshot and segment)."""
        prefix = normalize_prefix(prefix, base_uri=self.base_uri)
        top = self._path_str(prefix) if prefix else self._root_str
        entries: dict[str, bool] = {}
        with _translated(f"{self.base_uri}/{prefix}" if prefix else self.base_uri):
            try:
                with os.scandir(top) as listed:
                    folders = [e.name for e in listed if e.is_dir() and not e.is_symlink()]
            except (FileNotFoundError, NotADirectoryError):
                return entries
            for name in folders:
                folder = f"{top}/{name}"
                if os.path.isfile(f"{folder}/{marker_name}"):
                    entries[name] = True
                elif _holds_file(folder):
                    entries[name] = False
        return entries

    def modified_times(self, prefix: str = "") -> dict[str, float]:
        if self._writer is not None:
            return self._writer.modified_times(normalize_prefix(prefix, base_uri=self.base_uri))
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
        and folders read with one ``scandir`` each (a snapshot's publication lists the
        snapshots' tree more than once: no ``Path`` and no ``stat`` per folder and file)."""
        cut = len(self._root_str) + 1
        for dirpath, filenames in _scan(str(top)):
            rel = dirpath[cut:]
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    continue
                yield (f"{rel}/{name}" if rel else name), f"{dirpath}/{name}"

    # -- deletes ----------------------------------------------------------------------------

    def delete(self, key: str) -> None:
        if self._writer is not None:
            self._writer.delete(validate_key(key, base_uri=self.base_uri))
            return
        path = self._path_str(key)
        with _translated(f"{self.base_uri}/{key}"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            _fsync_dir(os.path.dirname(path))

    def delete_entry(self, marker: str) -> int:
        """``publish.delete_entry`` in one call of the writer process where there is one:
        the marker deleted (durably) first, then its folder's files (not durably); returns
        the files deleted besides the marker."""
        entry = marker.rsplit("/", 1)[0]
        if self._writer is not None:
            return self._writer.delete_entry(validate_key(marker, base_uri=self.base_uri))
        self.delete(marker)
        return self.delete_prefix(entry, durable=False)

    def delete_prefix(self, prefix: str, *, durable: bool = True) -> int:
        prefix = normalize_prefix(prefix, base_uri=self.base_uri)
        if self._writer is not None:
            return self._writer.delete_prefix(prefix, durable=durable)
        top = self._path_str(prefix) if prefix else self._root_str
        with _translated(f"{self.base_uri}/{prefix}" if prefix else self.base_uri):
            scanned = list(_scan(top))
        listed = 0
        touched: set[str] = set()
        for dirpath, filenames in scanned:
            for name in filenames:
                if name.startswith(TMP_PREFIX):
                    continue
                listed += 1
                key = f"{dirpath[len(self._root_str) + 1 :]}/{name}"
                with _translated(f"{self.base_uri}/{key}"):
                    try:
                        os.unlink(f"{dirpath}/{name}")
                    except FileNotFoundError:
                        continue
                touched.add(dirpath)
        for directory in sorted(touched) if durable else ():  # once per directory, not object
            with _translated(f"{self.base_uri}/{prefix}"):
                _fsync_dir(directory)
        # the folders scanned, deepest first (a folder left non-empty stays), never the root
        for dirpath, _filenames in reversed(scanned):
            if dirpath != self._root_str:
                with contextlib.suppress(OSError):
                    os.rmdir(dirpath)
        log.debug("deleted %d objects under %s/%s", listed, self.base_uri, prefix)
        return listed

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


def _fsync_dir(path: Path | str) -> None:
    """Make a directory's entries (renames, links, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(
    path: str,
    content: Callable[[BinaryIO], object] | bytes,
    uri: str,
    *,
    exclusive: bool,
    sync: bool = True,
    keep: bool = False,
) -> None:
    """``path`` whole: a hidden temporary file beside it, written (``content``'s bytes, or
    what ``content`` writes), fsynced unless ``sync`` is False, then renamed over ``path``,
    or linked to it when ``exclusive`` (``ObjectExistsError`` if it exists). ``keep``:
    ``path`` is itself the temporary name, written and fsynced, nothing renamed (a staged
    create-only write). The caller fsyncs the directory."""
    tmp = path if keep else _tmp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        try:
            if callable(content):
                with os.fdopen(fd, "wb", closefd=False) as f:
                    content(f)
            else:
                view = memoryview(content)
                while view:
                    view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if keep:
            return
        if exclusive:
            _link_exclusive(tmp, path, uri)
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _link_exclusive(tmp: str, path: str, uri: str) -> None:
    """The create-only write: ``link(2)`` fails if ``path`` exists."""
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


def _makedirs(path: str) -> list[str]:
    """``mkdir -p``; returns the directories it created, outermost first (their parents'
    entries changed: the caller fsyncs them)."""
    if os.path.isdir(path):
        return []
    missing: list[str] = []
    cur = path
    while not os.path.exists(cur):
        missing.append(cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            break
        cur = parent
    created = []
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue
        created.append(d)
    return created


def _scan(top: str) -> Iterator[tuple[str, list[str]]]:
    """Each folder under and including ``top`` (parents before their children) with the
    names of the files in it, read one folder at a time. A missing or not-a-directory
    ``top`` (or a folder removed meanwhile) scans as empty; any other error is raised."""
    pending = [top]
    while pending:
        folder = pending.pop()
        try:
            with os.scandir(folder) as entries:
                files, subfolders = [], []
                for entry in entries:
                    if not entry.is_dir():
                        files.append(entry.name)
                    elif not entry.is_symlink():  # a link to a folder: neither (as os.walk)
                        subfolders.append(entry.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        yield folder, files
        pending.extend(f"{folder}/{name}" for name in sorted(subfolders, reverse=True))


def _holds_file(top: str) -> bool:
    """Whether a file (not a temporary one) lies under ``top``, found as :func:`_scan` finds
    files but stopping at the first: the snapshots' folder holds the data segments' folder,
    with every segment and chain chunk of the orphan grace (thousands at a snapshot a
    second), and each publication lists it."""
    pending = [top]
    while pending:
        try:
            with os.scandir(pending.pop()) as entries:
                for entry in entries:
                    if not entry.is_dir():
                        if not entry.name.startswith(TMP_PREFIX):
                            return True
                    elif not entry.is_symlink():
                        pending.append(entry.path)
        except (FileNotFoundError, NotADirectoryError):
            continue
    return False


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
