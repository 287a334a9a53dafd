"""Two trainer incarnations overlap on one storage until the Lease fences the old one: the
old one's segment clean-up must not delete what the new one wrote and is about to commit
(orphan grace), and a writer whose reused segments vanished anyway rewrites their rows
(so no published snapshot names a segment that is gone)."""

from __future__ import annotations

import time
from pathlib import Path

from rolloutrun_runtime.algorithms.rollout_checkpointing.data_segments import (
    ORPHAN_GRACE_FLOOR_S,
    SegmentWriter,
    orphan_grace_s,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import ManifestStore
from rolloutrun_runtime.contract.layout import DATA_SEGMENTS_PREFIX
from rolloutrun_runtime.contract.pod import (
    DEFAULT_LEASE_DURATION_S,
    ENV_LEASE_DURATION,
    lease_duration_from,
)
from rolloutrun_runtime.storage import CheckpointStorage, open_storage
from tests.runtime.algorithms.rollout_checkpointing.test_data_segments import (
    _plane,
    _publish,
    _read_plane,
    _row,
    _same,
)
from tests.support.rollout_checkpoints import tiny_config


def test_the_old_incarnations_clean_up_spares_the_new_ones_segments_in_flight(
    tmp_path: Path, storage: CheckpointStorage
) -> None:
    """The old trainer's collection runs between the new trainer's segment write and its
    manifest commit, twice; the new trainer's latest snapshot (and the one before) restore.
    On file:// and gs:// (fake-gcs-server: the grace reads GCS ``updated``)."""
    cfg = tiny_config(tmp_path)
    old = ManifestStore(storage, cfg.name)
    old.ensure_bootstrap_anchor(cfg)
    plane = _plane(range(30))
    _publish(old, cfg, SegmentWriter(old.missing_segments), plane, keep_latest=3)
    new = ManifestStore(storage, cfg.name)  # the new incarnation: its own store and memory
    writer = SegmentWriter(new.missing_segments)
    collected: list[str] = []

    def old_cleans_up() -> None:  # the new one's fence: its segments durable, no manifest yet
        collected.extend(old.collect_segments())

    plane.put("train", "t30", _row(30))
    _publish(new, cfg, writer, plane, keep_latest=3, fence=old_cleans_up)
    second = plane.copy()
    plane.put("train", "t31", _row(31))  # reuses the segment the old one could have taken
    _publish(new, cfg, writer, plane, keep_latest=3, fence=old_cleans_up)
    reader = ManifestStore(storage, cfg.name)
    assert reader.committed_ids() == [1, 2, 3]
    _same(_read_plane(reader, cfg, 3), plane)
    _same(_read_plane(reader, cfg, 2), second)
    assert collected == [] and writer.missing_found == set()


def test_a_reused_segment_found_missing_is_rewritten(tmp_path: Path) -> None:
    """A segment the last snapshot wrote is gone before the next one (deleted by a collector
    without the grace): the next snapshot rewrites its rows and restores; later ones build
    on the rewritten segment."""
    cfg = tiny_config(tmp_path)
    store = ManifestStore(open_storage(f"file://{tmp_path}/storage"), cfg.name)
    store.ensure_bootstrap_anchor(cfg)
    writer = SegmentWriter(store.missing_segments)
    plane = _plane(range(20), range(3))
    _, first = _publish(store, cfg, writer, plane)
    (gone,) = first.referenced
    store.storage.delete(gone)
    plane.put("train", "t20", _row(20))
    _, second = _publish(store, cfg, writer, plane)
    assert writer.missing_found == {gone} and gone not in second.referenced
    assert second.new_rows == 24  # every row again: the snapshot is self-sufficient
    _same(_read_plane(store, cfg, 2), plane)
    plane.put("train", "t21", _row(21))
    _, third = _publish(store, cfg, writer, plane)
    assert third.new_rows == 1 and set(second.referenced) <= set(third.referenced)
    _same(_read_plane(store, cfg, 3), plane)


def test_an_orphan_past_the_grace_is_collected(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path)
    store = ManifestStore(open_storage(f"file://{tmp_path}/storage"), cfg.name)
    store.ensure_bootstrap_anchor(cfg)
    _publish(store, cfg, SegmentWriter(), _plane(range(5)))
    orphan = f"{DATA_SEGMENTS_PREFIX}/{'2' * 64}.npz"
    store.storage.write_bytes(orphan, b"leftover")
    assert store.collect_segments() == []
    just_inside = time.time() + store.orphan_grace_s - 60
    assert store.collect_segments(now=just_inside) == []
    assert store.collect_segments(now=time.time() + store.orphan_grace_s + 1) == [orphan]


def test_the_grace_follows_the_snapshot_cadence_and_the_lease() -> None:
    assert orphan_grace_s(10, 25, 15) == ORPHAN_GRACE_FLOOR_S  # defaults: the floor
    assert orphan_grace_s(3600, 25, 15) == 4 * (3600 + 25 + 15)
    assert orphan_grace_s(10, 25, 600) > orphan_grace_s(10, 25, 15)


def test_a_longer_lease_lengthens_the_grace(tmp_path: Path) -> None:
    """The trainer's Lease duration (its pod environment) sizes the grace at publish."""
    assert lease_duration_from({}) == DEFAULT_LEASE_DURATION_S
    environ = {ENV_LEASE_DURATION: "3600"}
    cfg = tiny_config(tmp_path)
    store = ManifestStore(
        open_storage(f"file://{tmp_path}/storage"),
        cfg.name,
        lease_duration_s=lease_duration_from(environ),
    )
    store.ensure_bootstrap_anchor(cfg)
    _publish(store, cfg, SegmentWriter(), _plane(range(5)))
    settings = cfg.checkpointing
    grace = orphan_grace_s(
        settings.snapshot_interval_seconds, settings.preemption_grace_seconds, 3600
    )
    assert store.orphan_grace_s == grace > ORPHAN_GRACE_FLOOR_S
    orphan = f"{DATA_SEGMENTS_PREFIX}/{'3' * 64}.npz"
    store.storage.write_bytes(orphan, b"leftover")
    assert store.collect_segments(now=time.time() + ORPHAN_GRACE_FLOOR_S + 60) == []
    assert store.collect_segments(now=time.time() + grace + 1) == [orphan]
