"""file:// specifics: SIGKILL during publication, permissions, odd paths, temp files."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from pathlib import Path

import pytest

from rolloutrun_runtime.storage import (
    ObjectNotFoundError,
    StorageError,
    StoragePermissionError,
    list_committed,
    open_storage,
    publish_entry,
)
from rolloutrun_runtime.storage.local import COPY_CHUNK, LocalStorage
from tests.support.crash_publisher import (
    check_committed_whole,
    content,
    kill_after_commits,
    spawn,
)


def _wait_for(predicate: object, what: str, proc: subprocess.Popen[str]) -> None:
    """Poll until ``predicate()`` holds; fail (not time out silently) if the child dies."""
    assert callable(predicate)
    deadline = time.monotonic() + 60
    while not predicate():
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            pytest.fail(f"publisher exited early ({proc.returncode}): {err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"gave up waiting for {what}")
        time.sleep(0.01)


def test_sigkill_mid_file_leaves_nothing_committed(tmp_path: Path) -> None:
    """A publisher frozen inside a file copy and SIGKILLed commits nothing, and the visible
    files are whole; a later publisher of the same entry succeeds."""
    root = tmp_path / "store"
    fifo = tmp_path / "feed"
    os.mkfifo(fifo)
    proc = spawn(str(root), "fifo", str(fifo))
    entry_dir = root / "snaps" / "step_0"
    with open(fifo, "wb") as feed:  # blocks until the publisher opens it for reading
        # One full copy chunk (written to the temp file) and a bit of the next, which the
        # publisher then waits on for ever.
        feed.write(b"p" * (COPY_CHUNK + 10_000))
        feed.flush()
        _wait_for(
            lambda: any(
                p.name.startswith(".rr-tmp-b") and p.stat().st_size > 0
                for p in entry_dir.glob(".rr-tmp-*")
            ),
            "the publisher to be copying file b",
            proc,
        )
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    proc.stdout.close() if proc.stdout else None
    proc.stderr.close() if proc.stderr else None
    assert proc.returncode == -signal.SIGKILL

    storage = open_storage(str(root))
    assert list_committed(storage, "snaps") == []
    # in-memory contents go first, whole; the file being copied (b) only as a hidden temp
    assert storage.list() == ["snaps/step_0/a", "snaps/step_0/c"]
    assert storage.read_bytes("snaps/step_0/a") == content(0, 0)
    assert storage.read_bytes("snaps/step_0/c") == content(0, 2)
    assert any(p.name.startswith(".rr-tmp-b") for p in entry_dir.iterdir())

    publish_entry(storage, "snaps/step_0", {"a": b"A", "b": b"B", "c": b"C"})
    assert list_committed(storage, "snaps") == ["snaps/step_0"]
    assert storage.read_bytes("snaps/step_0/b") == b"B"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigkill_at_random_points_keeps_committed_entries_whole(tmp_path: Path, seed: int) -> None:
    """Kill a looping publisher after a random number of commits: every committed entry is
    complete, and the committed steps are exactly 0..n without gaps."""
    root = tmp_path / "store"
    wanted = random.Random(seed).randint(1, 6)
    kill_after_commits(str(root), wanted)
    assert len(check_committed_whole(open_storage(str(root)))) >= wanted


def test_temp_files_are_invisible(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".rr-tmp-x.123").write_bytes(b"half")
    storage.write_bytes("d/x", b"whole")
    assert storage.list() == ["d/x"]
    assert storage.delete_prefix("d") == 1


def test_remove_stale_temp_files(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    storage.write_bytes("d/x", b"1")
    old = tmp_path / "d" / ".rr-tmp-x.old"
    fresh = tmp_path / "d" / ".rr-tmp-x.fresh"
    old.write_bytes(b"left by a killed writer")
    fresh.write_bytes(b"a live writer's")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert storage.remove_stale_temp_files(older_than_s=3600) == 1
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [".rr-tmp-x.fresh", "x"]


def test_base_under_a_file_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"")
    storage = open_storage(f"file://{tmp_path}/plain/store")
    with pytest.raises(StorageError, match="not a directory") as info:
        storage.write_bytes("k", b"1")
    assert info.value.uri == storage.uri_for("k")
    with pytest.raises(ObjectNotFoundError):
        storage.read_bytes("k")
    assert storage.list() == []
    assert not storage.exists("k")


def test_key_naming_a_directory(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    storage.write_bytes("d/x", b"1")
    with pytest.raises(StorageError, match="directory"):
        storage.read_bytes("d")
    with pytest.raises(StorageError, match="directory"):
        storage.write_bytes("d", b"2")
    assert storage.list() == ["d/x"]


def _permission_denied_in(directory: Path) -> str:
    """Try to write into ``directory`` (mode 0555); return the error class name or 'ok'."""
    storage = LocalStorage(directory)
    try:
        storage.write_bytes("sub/k", b"1")
    except StoragePermissionError as exc:
        assert str(directory) in str(exc)
        assert "permission denied" in str(exc)
        return "StoragePermissionError"
    except Exception as exc:
        return type(exc).__name__
    return "ok"


def test_permission_denied(tmp_path: Path) -> None:
    """Writing into a read-only directory raises StoragePermissionError naming the URI.

    Root ignores directory modes, so as root the attempt runs in a forked child that first
    drops to uid/gid 65534 (nobody): a real EACCES from the kernel either way.
    """
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    tmp_path.chmod(0o755)
    try:
        if os.geteuid() != 0:
            assert _permission_denied_in(locked) == "StoragePermissionError"
            return
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: drop privileges, try, report, exit without cleanup
            try:
                os.close(read_end)
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                result = _permission_denied_in(locked)
            except BaseException as exc:  # report anything, never return into pytest
                result = f"child failed: {exc!r}"
            os.write(write_end, result.encode())
            os._exit(0)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as pipe:
            result = pipe.read().decode()
        os.waitpid(pid, 0)
        assert result == "StoragePermissionError"
    finally:
        locked.chmod(0o755)
    assert list((locked).iterdir()) == []


def test_unreadable_object(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads files regardless of mode; the write case covers EACCES as root")
    storage = open_storage(str(tmp_path))
    storage.write_bytes("k", b"1")
    (tmp_path / "k").chmod(0)
    try:
        with pytest.raises(StoragePermissionError, match="permission denied"):
            storage.read_bytes("k")
    finally:
        (tmp_path / "k").chmod(0o644)


def test_write_many_syncs_each_directory_once(tmp_path: Path, monkeypatch) -> None:
    from rolloutrun_runtime.storage import local

    storage = LocalStorage(tmp_path)
    storage.write_bytes("s/a", b"0")  # directories exist: only the batch's own syncs count
    storage.write_bytes("s/x/b", b"0")
    synced: list[Path] = []
    real = local._fsync_dir
    monkeypatch.setattr(local, "_fsync_dir", lambda path: (synced.append(Path(path)), real(path)))
    storage.write_many({"s/a": b"1", "s/c": b"2", "s/x/b": b"3", "s/x/d": b"4"})
    assert sorted(synced) == [tmp_path / "s", tmp_path / "s" / "x"]
    assert storage.read_bytes("s/x/d") == b"4"


def test_write_many_into_new_folders_syncs_each_directory_once(tmp_path: Path, monkeypatch) -> None:
    """A new entry with subfolders (a snapshot): each folder created and its parent are
    synced once, after the files, not once per folder created and again per write."""
    from rolloutrun_runtime.storage import local

    storage = LocalStorage(tmp_path)
    synced: list[Path] = []
    real = local._fsync_dir
    monkeypatch.setattr(local, "_fsync_dir", lambda path: (synced.append(Path(path)), real(path)))
    storage.write_many({"e/a": b"1", "e/x/b": b"2", "e/y/c": b"3", "e/y/d": b"4"})
    entry = tmp_path / "e"
    assert sorted(synced) == [tmp_path, entry, entry / "x", entry / "y"]
    assert storage.read_bytes("e/y/d") == b"4"


def test_hints_and_garbage_deletes_skip_the_fsyncs(tmp_path: Path, monkeypatch) -> None:
    """``durable=False`` writes and prefix deletes fsync nothing (a power loss may undo
    them); durable ones still sync; the effects are the same for readers."""
    from rolloutrun_runtime.storage import local

    storage = LocalStorage(tmp_path)
    storage.write_many({"p/a": b"1", "p/q/b": b"2"})
    synced: list[object] = []
    monkeypatch.setattr(local.os, "fsync", lambda fd: synced.append(fd))
    storage.write_bytes("LATEST", b"hint", durable=False)
    assert storage.delete_prefix("p", durable=False) == 2
    assert synced == []
    assert storage.read_bytes("LATEST") == b"hint" and storage.list("p") == []
    storage.write_bytes("LATEST", b"durable")
    assert len(synced) == 2  # the file and its folder


def test_a_forked_child_names_its_temporary_files_apart_from_its_parent(tmp_path: Path) -> None:
    """Temporary names are a per-process token and a counter (no syscall per write): a
    child forked mid-run draws its own token, so it never collides with its parent's."""
    from rolloutrun_runtime.storage import local

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report its token and leave at once
        os.write(write, local._tmp_token.encode())
        os._exit(0)
    os.close(write)
    child_token = os.read(read, 64).decode()
    os.close(read)
    os.waitpid(pid, 0)
    assert child_token and child_token != local._tmp_token


def test_list_entries_passes_over_folders_with_no_object(tmp_path: Path) -> None:
    """An empty folder, or one holding only a killed writer's temporary file, holds no key:
    ``list`` does not show it, so neither does ``list_entries``."""
    from rolloutrun_runtime.storage.keys import TMP_PREFIX

    storage = LocalStorage(tmp_path)
    storage.write_bytes("top/kept/MARK", b"")
    (tmp_path / "top" / "empty" / "inner").mkdir(parents=True)
    (tmp_path / "top" / "tmp-only").mkdir()
    (tmp_path / "top" / "tmp-only" / f"{TMP_PREFIX}x.1").write_bytes(b"half")
    assert storage.list_entries("top", "MARK") == {"kept": True}


def test_list_entries_stops_at_the_first_file_of_an_unmarked_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshots' folder holds the data segments' folder (thousands of files within the
    orphan grace): a publication's listing learns it holds a file from the first one, not
    from reading every entry."""
    storage = LocalStorage(tmp_path)
    storage.write_many({f"snaps/segments/{i:04d}.npz": b"x" for i in range(600)})
    storage.write_many({"snaps/s1/a": b"1", "snaps/s1/M": b"m", "snaps/s3/deep/er/f": b"1"})
    (tmp_path / "snaps/s2").mkdir()
    (tmp_path / "snaps/s2/.rr-tmp-x").write_bytes(b"")  # a killed writer's temporary file
    read: list[str] = []
    scandir = os.scandir

    class Counted:
        def __init__(self, path: str) -> None:
            self._entries = scandir(path)

        def __enter__(self) -> Counted:
            return self

        def __exit__(self, *exc: object) -> None:
            self._entries.close()

        def __iter__(self):
            for entry in self._entries:
                read.append(entry.name)
                yield entry

    monkeypatch.setattr(os, "scandir", Counted)
    assert storage.list_entries("snaps", "M") == {"s1": True, "s3": False, "segments": False}
    assert len(read) < 20, f"{len(read)} entries read"
