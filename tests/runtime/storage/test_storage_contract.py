"""The CheckpointStorage contract, run identically against file:// and gs:// (emulator)."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest

from rolloutrun_runtime.storage import (
    CheckpointStorage,
    InvalidKeyError,
    ObjectExistsError,
    ObjectNotFoundError,
    StorageError,
    delete_entry,
    is_committed,
    list_committed,
    publish_entry,
    read_json,
    write_json,
)

BAD_KEYS = ["", "/abs", "a//b", "a/", "a/../b", "..", "./a", "a/./b", "a/\nb", ".rr-tmp-x"]


def test_is_a_checkpoint_storage(storage: CheckpointStorage) -> None:
    assert isinstance(storage, CheckpointStorage)
    assert storage.uri_for("a/b.bin") == storage.base_uri + "/a/b.bin"
    assert storage.base_uri.startswith(("file:///", "gs://"))


def test_write_read_overwrite(storage: CheckpointStorage) -> None:
    storage.write_bytes("dir/obj", b"\x00first")
    assert storage.read_bytes("dir/obj") == b"\x00first"
    storage.write_bytes("dir/obj", b"second")
    assert storage.read_bytes("dir/obj") == b"second"
    storage.write_bytes("empty", b"")
    assert storage.read_bytes("empty") == b""


def test_write_many_writes_every_object_whole(storage: CheckpointStorage) -> None:
    storage.write_bytes("e/a", b"old")
    items = {"e/a": b"new", "e/sub/b": b"\x00" * 1000, "top": b"", "e/sub/deeper/c": b"c"}
    storage.write_many(items)
    assert {key: storage.read_bytes(key) for key in items} == items
    assert storage.list("e") == ["e/a", "e/sub/b", "e/sub/deeper/c"]  # no temporary files
    storage.write_many({})
    with pytest.raises(InvalidKeyError):
        storage.write_many({"ok": b"1", "a/../b": b"2"})


def test_read_missing_names_uri(storage: CheckpointStorage) -> None:
    with pytest.raises(ObjectNotFoundError) as info:
        storage.read_bytes("no/such/key")
    assert storage.uri_for("no/such/key") in str(info.value)
    assert info.value.uri == storage.uri_for("no/such/key")


def test_exists(storage: CheckpointStorage) -> None:
    assert not storage.exists("x/y")
    storage.write_bytes("x/y", b"1")
    assert storage.exists("x/y")
    assert not storage.exists("x")  # a "directory" is not an object


def test_modified_times_lists_when_each_object_was_written(storage: CheckpointStorage) -> None:
    """Segment collection spares young orphans by these times (file mtime, GCS ``updated``)."""
    before = time.time()
    storage.write_many({"seg/a": b"1", "seg/sub/b": b"2", "other/c": b"3"})
    after = time.time()
    times = storage.modified_times("seg")
    assert list(times) == storage.list("seg") == ["seg/a", "seg/sub/b"]
    # the backend's clock (the emulator's, the filesystem's), to its timestamp granularity
    assert all(before - 2 <= t <= after + 2 for t in times.values()), (before, times, after)
    assert storage.modified_times("nothing") == {}
    storage.write_bytes("seg/a", b"rewritten")
    assert storage.modified_times("seg")["seg/a"] >= times["seg/a"]


def test_create_only(storage: CheckpointStorage) -> None:
    storage.write_bytes_if_absent("m/COMMITTED", b"winner")
    with pytest.raises(ObjectExistsError) as info:
        storage.write_bytes_if_absent("m/COMMITTED", b"loser")
    assert storage.uri_for("m/COMMITTED") in str(info.value)
    assert storage.read_bytes("m/COMMITTED") == b"winner"


def test_create_only_payload_is_bounded(storage: CheckpointStorage) -> None:
    with pytest.raises(ValueError, match="create-only payload"):
        storage.write_bytes_if_absent("big", b"x" * (8 * 1024 * 1024 + 1))
    assert not storage.exists("big")


def test_create_only_race_has_one_winner(storage: CheckpointStorage) -> None:
    writers = 6
    barrier = threading.Barrier(writers)
    outcomes: dict[int, str] = {}

    def write(i: int) -> None:
        barrier.wait()
        try:
            storage.write_bytes_if_absent("race/MARKER", f"writer-{i}".encode())
            outcomes[i] = "won"
        except ObjectExistsError:
            outcomes[i] = "lost"

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, o in outcomes.items() if o == "won"]
    assert len(outcomes) == writers
    assert len(winners) == 1
    assert storage.read_bytes("race/MARKER") == f"writer-{winners[0]}".encode()


def test_upload_download_roundtrip(storage: CheckpointStorage, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(bytes(range(256)) * 1000)
    storage.upload_file("files/src.bin", src)
    dst = tmp_path / "out" / "dst.bin"
    dst.parent.mkdir()
    storage.download_file("files/src.bin", dst)
    assert dst.read_bytes() == src.read_bytes()
    assert sorted(p.name for p in dst.parent.iterdir()) == ["dst.bin"]  # no temp files left


def test_download_missing_leaves_local_file(storage: CheckpointStorage, tmp_path: Path) -> None:
    dst = tmp_path / "keep.bin"
    dst.write_bytes(b"old")
    with pytest.raises(ObjectNotFoundError):
        storage.download_file("missing", dst)
    assert dst.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["keep.bin"]


def test_upload_missing_source(storage: CheckpointStorage, tmp_path: Path) -> None:
    with pytest.raises(StorageError, match=r"nope\.bin"):
        storage.upload_file("k", tmp_path / "nope.bin")
    assert not storage.exists("k")


def test_list_is_recursive_sorted_and_prefix_is_a_path(storage: CheckpointStorage) -> None:
    for key in ["b/2", "a/x/1", "a/0", "ab/3", "c"]:
        storage.write_bytes(key, b".")
    assert storage.list() == ["a/0", "a/x/1", "ab/3", "b/2", "c"]
    assert storage.list("a") == ["a/0", "a/x/1"]
    assert storage.list("a/") == ["a/0", "a/x/1"]
    assert storage.list("a/x") == ["a/x/1"]
    assert storage.list("nothing") == []
    assert storage.list("c") == []  # an object is not a prefix of itself


def test_delete_and_delete_prefix(storage: CheckpointStorage) -> None:
    for key in ["p/1", "p/q/2", "p/q/3", "pp/4", "other"]:
        storage.write_bytes(key, b".")
    storage.delete("other")
    storage.delete("other")  # missing is fine
    assert not storage.exists("other")
    assert storage.delete_prefix("p") == 3
    assert storage.list() == ["pp/4"]
    assert storage.delete_prefix("p") == 0


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_keys_are_rejected_everywhere(storage: CheckpointStorage, key: str) -> None:
    for call in (
        lambda: storage.write_bytes(key, b""),
        lambda: storage.write_bytes_if_absent(key, b""),
        lambda: storage.read_bytes(key),
        lambda: storage.exists(key),
        lambda: storage.delete(key),
        lambda: storage.uri_for(key),
    ):
        with pytest.raises(InvalidKeyError) as info:
            call()
        assert storage.base_uri in str(info.value)
    if key not in ("", "a/"):  # "" lists everything; one trailing "/" is tolerated
        with pytest.raises(InvalidKeyError):
            storage.list(key)
    assert storage.list() == []


# -- publication ------------------------------------------------------------------------------


def test_publish_list_delete(storage: CheckpointStorage, tmp_path: Path) -> None:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 10_000)
    uri = publish_entry(
        storage,
        "snapshots/step_10",
        {"manifest.json": b"{}", "shards/0.bin": weights},
        marker_payload=b"meta",
    )
    assert uri == storage.uri_for("snapshots/step_10/COMMITTED")
    storage.write_bytes("snapshots/step_20/manifest.json", b"{}")  # files, no marker yet
    assert list_committed(storage, "snapshots") == ["snapshots/step_10"]
    assert is_committed(storage, "snapshots/step_10")
    assert not is_committed(storage, "snapshots/step_20")
    assert storage.read_bytes("snapshots/step_10/shards/0.bin") == weights.read_bytes()
    assert storage.read_bytes("snapshots/step_10/COMMITTED") == b"meta"
    assert delete_entry(storage, "snapshots/step_10") == 2
    assert list_committed(storage, "snapshots") == []
    assert storage.list() == ["snapshots/step_20/manifest.json"]


def test_republish_loses_and_changes_nothing(storage: CheckpointStorage) -> None:
    publish_entry(storage, "e/1", {"a": b"first"})
    with pytest.raises(ObjectExistsError, match="already committed"):
        publish_entry(storage, "e/1", {"a": b"second", "b": b"new"})
    assert storage.list("e") == ["e/1/COMMITTED", "e/1/a"]
    assert storage.read_bytes("e/1/a") == b"first"


def test_before_commit_runs_after_every_file_and_can_refuse(
    storage: CheckpointStorage, tmp_path: Path
) -> None:
    """The commit-point check sees every file durable, and a refusal commits nothing."""
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"w" * 1000)
    seen: list[list[str]] = []

    def refuse() -> None:
        seen.append(storage.list("e"))
        raise PermissionError("lease taken over by incarnation 9")

    with pytest.raises(PermissionError, match="incarnation 9"):
        publish_entry(storage, "e/1", {"a": b"A", "b/c": weights}, before_commit=refuse)
    assert seen == [["e/1/a", "e/1/b/c"]]
    assert not is_committed(storage, "e/1") and list_committed(storage, "e") == []
    publish_entry(storage, "e/1", {"a": b"A2"}, before_commit=lambda: None)
    assert storage.read_bytes("e/1/a") == b"A2" and is_committed(storage, "e/1")


def test_custom_marker_and_nested_entries(storage: CheckpointStorage) -> None:
    publish_entry(storage, "r/x/a", {"f": b"1"}, marker_name="DONE")
    publish_entry(storage, "r/y", {"f": b"2"}, marker_name="DONE")
    publish_entry(storage, "r/z", {"f": b"3"})
    assert list_committed(storage, "r", marker_name="DONE") == ["r/x/a", "r/y"]
    assert list_committed(storage, "r") == ["r/z"]
    assert list_committed(storage, "") == ["r/z"]


@pytest.mark.parametrize("marker", ["", "a/b", "..", ".rr-tmp-m"])
def test_bad_marker_names(storage: CheckpointStorage, marker: str) -> None:
    with pytest.raises(InvalidKeyError):
        publish_entry(storage, "e", {"f": b"1"}, marker_name=marker)
    with pytest.raises(InvalidKeyError):
        list_committed(storage, "", marker_name=marker)
    assert storage.list() == []


def test_file_named_like_marker_is_refused(storage: CheckpointStorage) -> None:
    with pytest.raises(InvalidKeyError, match="marker"):
        publish_entry(storage, "e", {"COMMITTED": b"1"})
    assert storage.list() == []


def test_reader_never_sees_an_incomplete_entry(storage: CheckpointStorage) -> None:
    """A reader polling list_committed while a writer publishes finds every entry whole."""
    entries = 6
    files = 4

    def content(entry: int, f: int) -> bytes:
        return hashlib.sha256(f"{entry}/{f}".encode()).digest() * 64

    done = threading.Event()
    checked: set[str] = set()
    problems: list[str] = []

    def reader() -> None:
        while True:
            finished = done.is_set()
            for entry in list_committed(storage, "snaps"):
                n = int(entry.rsplit("_", 1)[1])
                for f in range(files):
                    try:
                        data = storage.read_bytes(f"{entry}/f{f}")
                    except ObjectNotFoundError:
                        problems.append(f"{entry}/f{f} missing")
                        continue
                    if data != content(n, f):
                        problems.append(f"{entry}/f{f} incomplete")
                checked.add(entry)
            if finished:
                return

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for n in range(entries):
            publish_entry(
                storage, f"snaps/step_{n}", {f"f{f}": content(n, f) for f in range(files)}
            )
    finally:
        done.set()
        thread.join()
    assert problems == []
    assert checked == {f"snaps/step_{n}" for n in range(entries)}


def test_json_helpers(storage: CheckpointStorage) -> None:
    write_json(storage, "cfg/run.json", {"b": [1, 2], "a": "é"})
    assert read_json(storage, "cfg/run.json") == {"a": "é", "b": [1, 2]}
    assert json.loads(storage.read_bytes("cfg/run.json")) == {"a": "é", "b": [1, 2]}
    write_json(storage, "cfg/once.json", 1, if_absent=True)
    with pytest.raises(ObjectExistsError):
        write_json(storage, "cfg/once.json", 2, if_absent=True)
    storage.write_bytes("cfg/bad.json", b"{not json")
    with pytest.raises(StorageError, match=r"cfg/bad\.json: not valid JSON"):
        read_json(storage, "cfg/bad.json")


def test_list_entries_names_the_folders_holding_objects_and_which_are_marked(
    storage: CheckpointStorage,
) -> None:
    """Each folder directly under the prefix holding an object at any depth, and whether its
    marker lies directly in it: what a full listing says, on every backend."""
    from rolloutrun_runtime.storage.keys import entries_of

    storage.write_bytes("top/a/MARK", b"")
    storage.write_bytes("top/a/x/y", b"1")
    storage.write_bytes("top/b/deep/z", b"2")  # no marker
    storage.write_bytes("top/c/x/MARK", b"")  # a marker, but not directly in c
    storage.write_bytes("top/file", b"3")  # an object, not a folder
    storage.write_bytes("other/d/MARK", b"")
    expected = {"a": True, "b": False, "c": False}
    assert storage.list_entries("top", "MARK") == expected
    assert storage.list_entries("top/", "MARK") == expected
    assert entries_of(storage.list("top"), "top", "MARK") == expected
    assert storage.list_entries("", "MARK") == {"top": False, "other": False}
    assert storage.list_entries("missing", "MARK") == {}
