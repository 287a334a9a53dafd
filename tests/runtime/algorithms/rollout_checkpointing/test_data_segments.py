"""A snapshot writes only the data-plane rows new since the last published one (segments
shared between snapshots), restores exactly what its manifest names, and segment
collection never deletes one a retained manifest still lists."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.data_segments import (
    SegmentRecord,
    SegmentWriter,
    choose_compaction,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
    BOOTSTRAP_ANCHOR,
    ManifestError,
    ManifestStore,
)
from rolloutrun_runtime.contract.layout import (
    DATA_PLANE_METADATA_FILE,
    DATA_PLANE_PREFIX,
    DATA_SEGMENTS_PREFIX,
    MANIFEST_NAME,
    MANIFEST_SCHEMA_VERSION,
    snapshot_dir,
)
from rolloutrun_runtime.data_plane import DataPlane
from rolloutrun_runtime.data_plane.store import DataPlaneError
from rolloutrun_runtime.storage import CheckpointStorage, open_storage
from tests.support.rollout_checkpoints import tiny_config


def _row(value: int) -> dict:
    return {"ids": np.arange(value % 7 + 1, dtype=np.int64) + value, "reward": float(value)}


def _plane(train: range, staging: range = range(0)) -> DataPlane:
    plane = DataPlane()
    for i in train:
        plane.put("train", f"t{i}", _row(i))
    for i in staging:
        plane.put("staging", f"s{i}", {**_row(i), "who": f"gym-{i}"})
    return plane


def _restored(write, stored: dict[str, bytes]) -> DataPlane:
    plane, user = DataPlane.from_files(write.files, stored)
    assert user == {"note": "x"}
    return plane


def _same(a: DataPlane, b: DataPlane) -> None:
    for partition in ("train", "staging"):
        assert a.list(partition) == b.list(partition)
        for key in a.list(partition):
            left, right = a.get(partition, key), b.get(partition, key)
            assert left.keys() == right.keys()
            for field, value in left.items():
                assert np.array_equal(value, right[field]), (partition, key, field)


def test_the_next_snapshot_writes_only_new_and_replaced_rows() -> None:
    writer, stored = SegmentWriter(), {}
    plane = _plane(range(100), range(10))
    first = writer.prepare(plane.copy(), {"note": "x"})
    assert (first.new_rows, len(first.new_segments)) == (110, 1)
    stored.update(first.files_to_write())
    writer.commit(first)
    plane.put("train", "t100", _row(100))  # added
    plane.put("train", "t5", _row(500))  # replaced
    plane.clear("train", ["t6", "t7"])  # gone
    copy = plane.copy()
    second = writer.prepare(copy, {"note": "x"})
    assert second.new_rows == 2
    assert set(second.referenced) >= set(first.referenced)  # shared, not rewritten
    stored.update(second.files_to_write())
    _same(_restored(second, stored), copy)
    # the first snapshot still reads what it named, unchanged
    _same(_restored(first, stored), _plane(range(100), range(10)))


def test_an_unpublished_write_leaves_the_writer_as_the_last_published_one() -> None:
    writer = SegmentWriter()
    plane = _plane(range(10))
    writer.commit(writer.prepare(plane.copy(), {}))
    plane.put("train", "t10", _row(10))
    writer.prepare(plane.copy(), {})  # its manifest never published (killed, fenced)
    again = writer.prepare(plane.copy(), {})
    assert again.new_rows == 1


def test_mostly_dead_segments_are_compacted_into_the_new_one() -> None:
    writer, stored = SegmentWriter(), {}
    plane = _plane(range(100))
    first = writer.prepare(plane.copy(), {"note": "x"})
    writer.commit(first)
    stored.update(first.files_to_write())
    plane.clear("train", [f"t{i}" for i in range(60)])  # 40 of 100 left: below half
    copy = plane.copy()
    second = writer.prepare(copy, {"note": "x"})
    assert (second.new_rows, second.compacted_rows) == (0, 40)
    assert set(second.referenced).isdisjoint(first.referenced)
    stored.update(second.files_to_write())
    _same(_restored(second, stored), copy)


def test_choose_compaction_bounds_the_segments_a_snapshot_reads() -> None:
    records = {f"s{i}": SegmentRecord(f"s{i}", "0", 1, 10) for i in range(6)}
    live = {"s0": 10, "s1": 4, "s2": 9, "s3": 2, "s4": 10, "s5": 10}
    assert choose_compaction(live, records) == {"s1", "s3"}
    # at most 4 referenced (3 kept + the new one): the smallest kept ones go too
    assert choose_compaction(live, records, max_segments=4) == {"s1", "s3", "s2"}


def test_a_segment_must_be_named_and_present() -> None:
    writer = SegmentWriter()
    write = writer.prepare(_plane(range(3)).copy(), {})
    chain = {k: v for k, v in write.files_to_write().items() if k not in write.new_segments}
    with pytest.raises(DataPlaneError, match="lacks segments"):
        DataPlane.from_files(write.files, chain)
    with pytest.raises(DataPlaneError, match=r"index: chunk .*\.json is missing"):
        DataPlane.from_files(write.files, write.new_segments)
    key = next(iter(write.new_segments))
    with pytest.raises(DataPlaneError, match="malformed"):
        DataPlane.from_files(write.files, {**chain, key: b"not an npz"})


# ------------------------------------------------------------------ in storage
def _publish(store: ManifestStore, cfg, writer: SegmentWriter, plane: DataPlane, **kw):
    write = writer.prepare(plane.copy(), {"note": "x"})
    candidate = store.publish(
        config=cfg,
        anchor=BOOTSTRAP_ANCHOR,
        files={DATA_PLANE_PREFIX + name: data for name, data in write.files.items()},
        train_step=0,
        mutation_version=0,
        cut_time=0.0,
        segments=write.manifest_segments(),
        segment_files=write.files_to_write(),
        **kw,
    )
    writer.commit(write)
    return candidate, write


def _read_plane(store: ManifestStore, cfg, snapshot_id: int) -> DataPlane:
    candidate = store.verify(snapshot_id, config=cfg, anchor_is_durable=lambda a: True)
    metadata = candidate.verified[DATA_PLANE_PREFIX + DATA_PLANE_METADATA_FILE]
    files = {DATA_PLANE_METADATA_FILE: metadata}
    segments = {key: store.read_segment(candidate, key) for key in candidate.manifest.segments}
    return DataPlane.from_files(files, segments)[0]


def test_collection_keeps_every_segment_a_retained_manifest_lists(
    tmp_path: Path, storage: CheckpointStorage
) -> None:
    """On file:// and on gs:// (fake-gcs-server; the segments upload in parallel there)."""
    cfg = tiny_config(tmp_path)
    store = ManifestStore(storage, cfg.name)
    store.ensure_bootstrap_anchor(cfg)
    writer = SegmentWriter()
    plane = _plane(range(40))
    _, first = _publish(store, cfg, writer, plane, keep_latest=2)
    plane.put("train", "t40", _row(40))
    _, second = _publish(store, cfg, writer, plane, keep_latest=2)
    # a killed publisher's segment: written, its manifest never was
    orphan = f"{DATA_SEGMENTS_PREFIX}/{'0' * 64}.npz"
    store.storage.write_bytes(orphan, b"leftover")
    plane.clear("train", [f"t{i}" for i in range(40)])  # the first segment dies
    plane.put("train", "t41", _row(41))
    _, third = _publish(store, cfg, writer, plane, keep_latest=2)
    assert store.committed_ids() == [2, 3]
    left = set(store.storage.list(DATA_SEGMENTS_PREFIX))
    # snapshot 2 (retained) still reads the first segment; the orphan is young: kept
    assert set(second.referenced) <= left and set(third.referenced) <= left
    assert set(first.referenced) <= left and orphan in left
    later = time.time() + store.orphan_grace_s + 60
    assert store.collect_segments(now=later) == [orphan]  # past the grace: collected
    expected = _plane(range(40))
    expected.put("train", "t40", _row(40))
    _same(_read_plane(store, cfg, 2), expected)
    plane.put("train", "t42", _row(42))
    _publish(store, cfg, writer, plane, keep_latest=2)  # snapshot 2 retired: its rows go
    assert set(first.referenced) <= set(store.storage.list(DATA_SEGMENTS_PREFIX))  # young
    store.collect_segments(now=later)
    assert set(first.referenced).isdisjoint(store.storage.list(DATA_SEGMENTS_PREFIX))
    _same(_read_plane(store, cfg, 4), plane)


def test_an_unreadable_manifest_stops_collection(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    store = ManifestStore(open_storage(f"file://{tmp_path}/storage"), cfg.name)
    store.ensure_bootstrap_anchor(cfg)
    writer = SegmentWriter()
    _publish(store, cfg, writer, _plane(range(5)))
    orphan = f"{DATA_SEGMENTS_PREFIX}/{'1' * 64}.npz"
    store.storage.write_bytes(orphan, b"leftover")
    key = f"{snapshot_dir(1)}/{MANIFEST_NAME}"
    store.storage.write_bytes(key, b"{not json")
    assert ManifestStore(store.storage, cfg.name).collect_segments() == []
    assert orphan in store.storage.list(DATA_SEGMENTS_PREFIX)


def test_a_missing_or_altered_segment_refuses_the_snapshot(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    store = ManifestStore(open_storage(f"file://{tmp_path}/storage"), cfg.name)
    store.ensure_bootstrap_anchor(cfg)
    _, write = _publish(store, cfg, SegmentWriter(), _plane(range(5)))
    (key,) = write.referenced
    store.storage.write_bytes(key, b"altered")
    with pytest.raises(ManifestError, match="checksum mismatch"):
        store.verify(1, config=cfg, anchor_is_durable=lambda a: True)
    store.storage.delete(key)
    with pytest.raises(ManifestError, match="is missing"):
        store.verify(1, config=cfg, anchor_is_durable=lambda a: True)
    manifest = json.loads(store.storage.read_bytes(f"{snapshot_dir(1)}/{MANIFEST_NAME}"))
    assert manifest["schema_version"] == MANIFEST_SCHEMA_VERSION and key in manifest["segments"]
    assert list(manifest["segments"]) == list(write.manifest_segments())


async def test_a_controller_snapshot_writes_only_new_rows_and_restores_them(tmp_path) -> None:
    """Through the real snapshotter, stopped mid-run after step 1: a snapshot with no new
    rows writes none, one after a new row writes one, and a new incarnation restores the
    rows the snapshot references, identical."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import SnapshotOutcome
    from tests.support.rollout_checkpoints import (
        harness,
        run_until_stopped,
        snapshot_after_commits,
    )

    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 3}))
        controller = await h.controller(cfg)
        outcomes: list = []
        await run_until_stopped(controller, snapshot_after_commits(controller, {1}, outcomes, {1}))
        assert outcomes == [SnapshotOutcome.PUBLISHED]
        snapshots, plane = controller.rollout_snapshots, controller.data_plane
        assert await snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        assert isinstance(h.records[-1]["timing/rollout_checkpoint"]["cut_preempted"], int)
        assert await snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        assert h.records[-1]["data_plane_rows_written"] == 0
        async with controller.barrier.mutation("test"):
            plane.put("staging", "extra", _row(2))  # unreferenced: written, not restored
        assert await snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        assert h.records[-1]["data_plane_rows_written"] == 1
        storage = snapshots._manifests.storage
        for key in storage.list(DATA_SEGMENTS_PREFIX):
            storage.delete(key)  # as a collector without the orphan grace would
        assert await snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        # the writer found its segments gone and rewrote every row: self-sufficient
        assert h.records[-1]["data_plane_rows_written"] == len(plane)
        resumed = await h.controller(cfg)
        await resumed.restore()
        restored = resumed.data_plane
        assert len(restored) > 0 and not restored.contains("staging", "extra")
        for partition in ("train", "staging"):
            for key in restored.list(partition):
                got, want = restored.get(partition, key), plane.get(partition, key)
                assert got.keys() == want.keys()
                assert all(np.array_equal(got[f], want[f]) for f in got), (partition, key)


def test_a_seeded_writer_reuses_the_restored_segments(tmp_path: Path) -> None:
    """A new incarnation's writer, seeded from the snapshot it restored, writes only the rows
    that changed since: none when nothing did, the replaced one when one was."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.data_segments import (
        seed_from_snapshot,
    )

    writer, stored = SegmentWriter(), {}
    plane = _plane(range(40), range(5))
    first = writer.prepare(plane.copy(), {"note": "x"})
    stored.update(first.files_to_write())
    writer.commit(first)
    restored = _restored(first, stored)
    seed = seed_from_snapshot(
        restored, first.files[DATA_PLANE_METADATA_FILE], first.manifest_segments(), stored
    )
    assert seed is not None
    fresh = SegmentWriter(lambda keys: set(keys) - set(stored))
    fresh.seed(seed)
    again = fresh.prepare(restored.copy(), {"note": "x"})
    assert (again.new_rows, again.files_to_write()) == (0, {})  # nor an index chunk
    assert set(again.referenced) == set(first.referenced)
    restored.put("train", "t3", _row(300))
    changed = fresh.prepare(restored.copy(), {"note": "x"})
    assert changed.new_rows == 1
    assert changed.index_chain is not None and not changed.index_chain.rewritten
    assert changed.index_chain.put == 1  # the row index: the replaced row, not all 45
    stored.update(changed.files_to_write())
    _same(_restored(changed, stored), restored)


async def test_the_first_snapshot_after_a_resume_writes_no_existing_segment(tmp_path) -> None:
    """Through the real controller: a new incarnation restores a snapshot, and its first
    snapshot rewrites none of the rows that snapshot's segments already hold."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import SnapshotOutcome
    from tests.support.rollout_checkpoints import (
        harness,
        run_until_stopped,
        snapshot_after_commits,
    )

    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, grpo={"maxSteps": 3}))
        controller = await h.controller(cfg)
        outcomes: list = []
        await run_until_stopped(controller, snapshot_after_commits(controller, {1}, outcomes, {1}))
        assert outcomes == [SnapshotOutcome.PUBLISHED]
        storage = controller.rollout_snapshots._manifests.storage
        segments_before = set(storage.list(DATA_SEGMENTS_PREFIX))
        assert segments_before
        resumed = await h.controller(cfg)
        assert await resumed.restore() is not None
        assert len(resumed.data_plane) > 0
        assert await resumed.rollout_snapshots.attempt(force=True) is SnapshotOutcome.PUBLISHED
        assert h.records[-1]["data_plane_rows_written"] == 0
        assert set(storage.list(DATA_SEGMENTS_PREFIX)) == segments_before


def test_a_truncated_or_mislabeled_index_chain_is_refused_by_name() -> None:
    """metadata.json format 4: its row index is a chain of chunks; a truncated chunk, or an
    entry naming a segment the metadata does not list, is refused naming it."""
    write = SegmentWriter().prepare(_plane(range(3)).copy(), {})
    files = write.files_to_write()
    meta = json.loads(write.files[DATA_PLANE_METADATA_FILE])
    assert meta["format"] == 4 and "index" not in meta
    (chunk,) = [record["key"] for record in meta["index_chain"]]
    with pytest.raises(DataPlaneError, match=f"chunk {chunk} is truncated"):
        DataPlane.from_files(write.files, {**files, chunk: files[chunk][:-2]})
    meta["segments"] = [f"{DATA_SEGMENTS_PREFIX}/{'f' * 64}.npz"]
    with pytest.raises(DataPlaneError, match=r"names segment .* not one of its segments"):
        DataPlane.from_files({DATA_PLANE_METADATA_FILE: json.dumps(meta).encode()}, files)
