"""file:// writes done by the writer process: same files, same errors, and the crash rules
(a child killed mid-write commits nothing and the next call starts a new child; a trainer
killed while the child writes takes the child with it and commits nothing)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from rolloutrun_runtime.crash import ENV_VAR
from rolloutrun_runtime.storage import (
    AfterCommit,
    InvalidKeyError,
    ObjectExistsError,
    StorageError,
    close_storage,
    delete_entry,
    list_committed,
    open_storage,
    publish_entry,
    start_writer_process,
    with_writer_process,
)
from rolloutrun_runtime.storage.local import LocalStorage
from rolloutrun_runtime.storage.writer_process import (
    IOV_MAX,
    WriterProcess,
    WriterProcessError,
    error_reply,
    request_parts,
    value_of,
    write_all,
)

FILES = {"a.json": b'{"a": 1}', "data_plane/rows.bin": bytes(range(256)) * 400, "empty": b""}


@pytest.fixture
def offloaded(tmp_path: Path):
    storage = with_writer_process(open_storage(str(tmp_path / "store")))
    assert isinstance(storage, LocalStorage)
    yield storage
    close_storage(storage)


def _gone(pid: int) -> bool:
    """No such process, or a zombie (dead, not yet reaped by its new parent)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_wire_carries_blobs_and_errors_without_pickle() -> None:
    request = b"".join(request_parts("write_many", {"keys": ["x", "y"]}, [b"1\n2", b""]))
    header, rest = request.split(b"\n", 1)
    assert rest == b"1\n2"
    assert b'"sizes": [3, 0]' in header
    with pytest.raises(ObjectExistsError, match="file:///r/k: taken"):
        value_of(error_reply(ObjectExistsError("file:///r/k", "taken")))
    with pytest.raises(StorageError, match="ValueError: odd"):
        value_of(error_reply(ValueError("odd")))
    assert value_of({"value": 3}) == 3


def test_a_publication_through_the_child_is_whole_and_committed(offloaded: LocalStorage) -> None:
    publish_entry(offloaded, "snaps/1", FILES, marker_name="M", marker_payload=b"m")
    assert offloaded._writer is not None and offloaded._writer.started == 1
    assert offloaded._writer.pid != os.getpid()
    assert list_committed(offloaded, "snaps", "M") == ["snaps/1"]
    for name, data in FILES.items():
        assert offloaded.read_bytes(f"snaps/1/{name}") == data
    assert not [p for p in offloaded.root.rglob("*") if p.name.startswith(".rr-tmp-")]
    assert offloaded.delete_prefix("snaps/1", durable=False) == len(FILES) + 1
    assert offloaded.list("snaps") == []


def test_writes_deletes_and_dates_run_in_the_child_as_in_process(offloaded: LocalStorage) -> None:
    plain = LocalStorage(offloaded.root)  # no child: the reference
    offloaded.write_bytes("LATEST", b"1", durable=False)
    offloaded.write_bytes("LATEST", b"2")
    offloaded.write_many({"seg/a": b"a", "seg/b": b"b"})
    assert plain.read_bytes("LATEST") == b"2"
    assert offloaded.modified_times("seg") == plain.modified_times("seg")
    assert set(offloaded.modified_times("seg")) == {"seg/a", "seg/b"}
    offloaded.delete("seg/a")
    offloaded.delete("seg/missing")  # missing is fine, as in process
    assert plain.list("seg") == ["seg/b"]
    assert offloaded._writer is not None and offloaded._writer.started == 1


def test_the_childs_errors_are_raised_as_their_class(offloaded: LocalStorage) -> None:
    offloaded.write_bytes("blocker", b"a file")
    with pytest.raises(StorageError) as raised:
        offloaded.write_many({"blocker/under": b"x"})
    assert type(raised.value) is StorageError
    assert raised.value.uri == f"{offloaded.base_uri}/blocker/under"
    # keys are checked in the trainer, before anything is sent
    with pytest.raises(ValueError, match="path part"):
        offloaded.write_many({"../out": b"x"})
    offloaded.write_many({"fine": b"ok"})  # the child still serves
    assert offloaded._writer is not None and offloaded._writer.started == 1


def test_a_requests_blobs_are_sent_as_they_are_not_joined_into_one_buffer(
    offloaded: LocalStorage,
) -> None:
    """The trainer sends a write's bytes with ``writev``, past the pipe's capacity and over
    more buffers than one call takes: no copy of them is made first (a snapshot's bytes
    are on the trainer's CPU once, in the kernel's copy into the pipe)."""
    big = os.urandom(1 << 21)
    small = {f"seg/{i:04d}": bytes([i % 256]) * (i % 7) for i in range(IOV_MAX + 40)}
    offloaded.write_many(small)  # the child is started, its buffers warm
    tracemalloc.start()
    try:
        offloaded.write_many({"big": big, **small})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(big) // 2, f"{peak} bytes allocated sending {len(big)}"
    assert offloaded.read_bytes("big") == big
    assert all(offloaded.read_bytes(key) == data for key, data in small.items())


def counted_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The writer child's calls from now on, by operation, in order."""
    calls: list[str] = []
    call = WriterProcess._call

    def counted(self: WriterProcess, op: str, *args: object) -> object:
        calls.append(op)
        return call(self, op, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(WriterProcess, "_call", counted)
    return calls


def test_an_entry_and_the_shared_files_it_references_are_one_request(
    offloaded: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot's new data segments (outside its folder) go with its files: one call of
    the child, durable before the marker; a shared key inside the entry is refused."""
    writer = offloaded._writer
    assert writer is not None
    calls = counted_calls(monkeypatch)
    shared = {"segs/abc.npz": b"rows", "segs/def.json": b"{}"}
    publish_entry(offloaded, "snaps/1", FILES, marker_name="M", shared=shared)
    assert calls == ["write_many", "settle"]  # the marker: staged with the files, linked
    assert list_committed(offloaded, "snaps", "M") == ["snaps/1"]
    assert {key: offloaded.read_bytes(key) for key in shared} == shared
    with pytest.raises(InvalidKeyError, match="shared file"):
        publish_entry(offloaded, "snaps/2", FILES, marker_name="M", shared={"snaps/2/x": b""})
    assert offloaded.list("snaps/2") == []


def test_deleting_an_entry_is_one_request(
    offloaded: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Retention's delete of a snapshot (its marker durably first, then its files) is one
    call of the child, not two."""
    publish_entry(offloaded, "snaps/1", FILES, marker_name="M")
    calls = counted_calls(monkeypatch)
    assert delete_entry(offloaded, "snaps/1", marker_name="M") == len(FILES)
    assert calls == ["delete_entry"]
    assert list_committed(offloaded, "snaps", "M") == [] and offloaded.list("snaps") == []


def test_the_trainers_commit_is_a_link_the_child_writes_and_fsyncs_the_marker(
    offloaded: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The marker's bytes are written and fsynced by the child with the files; the
    trainer's part of the commit is the create-only link (no write, no fsync of its own),
    and the link is durable (folder fsynced by the child) before ``publish_entry`` returns."""
    offloaded.write_many({"warm": b"1"})
    fsyncs: list[int] = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), fsync(fd))[1])
    publish_entry(offloaded, "snaps/1", FILES, marker_name="M", marker_payload=b"manifest")
    monkeypatch.undo()
    assert fsyncs == []
    assert offloaded.read_bytes("snaps/1/M") == b"manifest"
    assert not [p for p in offloaded.root.rglob("*") if p.name.startswith(".rr-tmp-")]
    with pytest.raises(ObjectExistsError):  # create-only still: committed once
        publish_entry(offloaded, "snaps/1", FILES, marker_name="M")


def test_a_failed_fence_commits_nothing_and_leaves_no_staged_marker(
    offloaded: LocalStorage,
) -> None:
    def fenced() -> None:
        raise RuntimeError("lease lost")

    with pytest.raises(RuntimeError, match="lease lost"):
        publish_entry(offloaded, "snaps/1", FILES, marker_name="M", before_commit=fenced)
    assert list_committed(offloaded, "snaps", "M") == []
    assert not [p for p in offloaded.root.rglob("*") if p.name.startswith(".rr-tmp-")]
    publish_entry(offloaded, "snaps/1", FILES, marker_name="M")  # the id is still free
    assert list_committed(offloaded, "snaps", "M") == ["snaps/1"]


def test_a_child_killed_before_it_settles_a_linked_marker(
    offloaded: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL of the child at its named site after the trainer linked the marker, before
    the child made the link durable: the publication raises (its caller does not count
    it), but the entry is committed and whole, and the next publication goes on with a
    new child."""
    monkeypatch.setenv(ENV_VAR, "helper_before_settle:1")  # read by the next child only
    with pytest.raises(WriterProcessError, match="died"):
        publish_entry(offloaded, "snaps/1", FILES, marker_name="M", marker_payload=b"m")
    monkeypatch.delenv(ENV_VAR)
    assert list_committed(offloaded, "snaps", "M") == ["snaps/1"]
    assert offloaded.read_bytes("snaps/1/M") == b"m"
    for name, data in FILES.items():
        assert offloaded.read_bytes(f"snaps/1/{name}") == data
    publish_entry(offloaded, "snaps/2", FILES, marker_name="M")
    assert offloaded._writer is not None and offloaded._writer.started == 2
    assert list_committed(offloaded, "snaps", "M") == ["snaps/1", "snaps/2"]


def test_write_all_goes_on_after_partial_writes() -> None:
    read_end, write_end = os.pipe()
    parts = [b"head\n", b"", os.urandom(300_000), b"x" * 5, os.urandom(70_000)]
    got = bytearray()

    def drain() -> None:
        while chunk := os.read(read_end, 8192):
            got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        write_all(write_end, parts)  # the pipe holds 64 KiB: several partial writes
    finally:
        os.close(write_end)
        reader.join(10)
        os.close(read_end)
    assert bytes(got) == b"".join(parts)


def test_a_child_killed_mid_write_commits_nothing_and_the_next_publication_does(
    offloaded: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL of the child at its named site after one file of a snapshot's write: the
    publication raises and commits nothing, what was published before stays, and the next
    publication starts a new child and commits."""
    publish_entry(offloaded, "snaps/1", FILES, marker_name="M")
    offloaded.close()
    monkeypatch.setenv(ENV_VAR, "helper_mid_write:1")  # read by the next child only
    with pytest.raises(WriterProcessError, match="died"):
        publish_entry(offloaded, "snaps/2", FILES, marker_name="M")
    monkeypatch.delenv(ENV_VAR)
    assert offloaded._writer is not None and offloaded._writer.pid is None
    assert list_committed(offloaded, "snaps", "M") == ["snaps/1"]
    assert offloaded.list("snaps/2") == ["snaps/2/a.json"]  # the one file before the kill
    publish_entry(offloaded, "snaps/3", FILES, marker_name="M")
    assert offloaded._writer.started == 3
    assert list_committed(offloaded, "snaps", "M") == ["snaps/1", "snaps/3"]
    assert offloaded.read_bytes("snaps/1/data_plane/rows.bin") == FILES["data_plane/rows.bin"]


def test_a_child_that_exited_is_replaced_at_the_next_call(offloaded: LocalStorage) -> None:
    offloaded.write_many({"x": b"1"})
    writer = offloaded._writer
    assert writer is not None and writer.pid is not None
    os.kill(writer.pid, signal.SIGKILL)
    time.sleep(0.05)
    offloaded.write_many({"y": b"2"})  # a dead child found before the call: a new one
    assert writer.started == 2 and offloaded.read_bytes("y") == b"2"


def test_a_started_writer_is_the_one_the_first_publication_uses(offloaded: LocalStorage) -> None:
    """The trainer starts the child once its run starts, so a preemption's first snapshot
    does not wait for an interpreter to start; a call then uses that same child."""
    writer = offloaded._writer
    assert writer is not None and writer.pid is None
    start_writer_process(offloaded)
    pid = writer.pid
    assert pid is not None and not _gone(pid)
    start_writer_process(offloaded)  # already running: the same child
    publish_entry(offloaded, "snaps/1", FILES)
    assert writer.pid == pid and writer.started == 1
    start_writer_process(open_storage(str(offloaded.root)))  # no writer: nothing to start


def test_a_process_group_sigterm_leaves_the_child_for_the_preemption_snapshot(
    offloaded: LocalStorage,
) -> None:
    """The local kubelet SIGTERMs a pod's whole process group, and the trainer's
    preemption snapshot is written after it: the child must still answer."""
    offloaded.write_many({"x": b"1"})
    writer = offloaded._writer
    assert writer is not None and writer.pid is not None
    for sig in (signal.SIGTERM, signal.SIGINT):
        os.kill(writer.pid, sig)
    time.sleep(0.2)
    offloaded.write_many({"y": b"2"})
    assert writer.started == 1 and offloaded.read_bytes("y") == b"2"


TRAINER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from rolloutrun_runtime.storage import publish_entry
    from rolloutrun_runtime.storage.local import LocalStorage
    storage = LocalStorage(Path(sys.argv[1])).with_writer_process()
    publish_entry(storage, "snaps/1", {"a": b"1", "b": b"2"}, marker_name="M")
    print(storage._writer.pid, flush=True)
    publish_entry(storage, "snaps/2", {"a": b"1", "b": b"2"}, marker_name="M")
    print("not killed", flush=True)
    """
)


def test_a_trainer_killed_while_the_child_writes_takes_it_along(tmp_path: Path) -> None:
    """SIGKILL of the trainer at its named site, its request sent: the child dies with it
    (parent-death signal), nothing of the second publication is committed."""
    root = tmp_path / "store"
    # the first publication is two calls (its files, then the link made durable)
    env = {**os.environ, ENV_VAR: "trainer_while_helper_writes:3"}
    done = subprocess.run(
        [sys.executable, "-c", TRAINER, str(root)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    child = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _gone(child)
    storage = LocalStorage(root)
    assert list_committed(storage, "snaps", "M") == ["snaps/1"]


def test_a_writer_process_is_only_for_file_storage(tmp_path: Path) -> None:
    class Other:
        base_uri = "gs://b"

    other = Other()
    assert with_writer_process(other) is other  # type: ignore[arg-type]
    close_storage(other)  # type: ignore[arg-type]
    writer = WriterProcess(tmp_path)
    writer.close()  # never started: nothing to end
    assert writer.pid is None


def test_after_commit_runs_in_the_commits_own_call(
    offloaded: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A publication's hint (LATEST) and its entries' deletes (retention) travel with the
    commit's settle: one call of the child, not one each; a delete that fails is recorded,
    the others and the commit stand."""
    publish_entry(offloaded, "snaps/1", FILES, marker_name="M")
    calls = counted_calls(monkeypatch)
    after = AfterCommit(hints={"LATEST": b"2"}, delete_markers=["../M", "snaps/1/M"])
    publish_entry(offloaded, "snaps/2", FILES, marker_name="M", after_commit=after)
    assert calls == ["write_many", "settle"]
    assert list_committed(offloaded, "snaps", "M") == ["snaps/2"]
    assert offloaded.list("snaps/1") == [] and offloaded.read_bytes("LATEST") == b"2"
    assert after.deleted == {"snaps/1/M": len(FILES)}
    assert list(after.failed) == ["../M"] and "../M" in after.failed["../M"]


def test_after_commit_matches_the_in_process_storage(tmp_path: Path) -> None:
    """The child runs an ``AfterCommit`` as the in-process storage does: same files left,
    same outcome."""
    outcomes = []
    for storage in (
        open_storage(str(tmp_path / "here")),
        with_writer_process(open_storage(str(tmp_path / "child"))),
    ):
        publish_entry(storage, "snaps/1", FILES, marker_name="M")
        after = AfterCommit(hints={"L": b"x"}, delete_markers=["snaps/1/M", "snaps/7/M", "/M"])
        publish_entry(storage, "snaps/2", FILES, marker_name="M", after_commit=after)
        outcomes.append((sorted(storage.list("")), after.deleted, sorted(after.failed)))
        close_storage(storage)
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][1] == {"snaps/1/M": len(FILES), "snaps/7/M": 0}  # none there: 0
    assert outcomes[0][2] == ["/M"]


def test_nothing_after_a_commit_runs_when_its_settle_fails(
    offloaded: LocalStorage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child killed before it settles the linked marker answers nothing: the publication
    raises, and neither the hint nor the delete that came with it ran."""
    publish_entry(offloaded, "snaps/1", FILES, marker_name="M")
    after = AfterCommit(hints={"LATEST": b"2"}, delete_markers=["snaps/1/M"])
    monkeypatch.setenv(ENV_VAR, "helper_before_settle:1")
    offloaded.close()  # the next call starts a child that reads the crash site
    with pytest.raises(WriterProcessError, match="died"):
        publish_entry(offloaded, "snaps/2", FILES, marker_name="M", after_commit=after)
    monkeypatch.delenv(ENV_VAR)
    assert list_committed(offloaded, "snaps", "M") == ["snaps/1", "snaps/2"]
    assert not offloaded.exists("LATEST") and after.deleted == {} == after.failed
