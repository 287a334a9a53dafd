"""Snapshot manifests: anchors, fingerprints, publication, selection and retention.

Every test runs on file:// and on gs:// (the real fake-gcs-server; see tests/conftest.py).
"""

from __future__ import annotations

import json
import time

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
    BOOTSTRAP_ANCHOR,
    Anchor,
    FingerprintMismatchError,
    ManifestError,
    ManifestStore,
    PublicationFencedError,
)
from rolloutrun_runtime.contract.layout import LATEST_KEY, snapshot_dir
from rolloutrun_runtime.contract.run_config import RunConfig, parse_run_config
from rolloutrun_runtime.storage import join_key
from tests.support.rollout_checkpoints import tamper_snapshot_file


@pytest.fixture
def config():
    return parse_run_config({"name": "alpha", "seed": 3})


def always(_anchor):
    return True


def publish(store: ManifestStore, config: RunConfig, step: int = 0, pack: bool = True, **files):
    return store.publish(
        config=config,
        anchor=BOOTSTRAP_ANCHOR if step == 0 else Anchor("step", step, step),
        files={name: data.encode() for name, data in (files or {"ledger.json": "{}"}).items()},
        train_step=step,
        mutation_version=step,
        cut_time=1.0,
        pack=pack,
    )


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "one-file-per-name"])
def test_publish_then_select_round_trips(storage, config, pack):
    """Both layouts: the packed one (schema 3) and the one before it (schema 2), still read."""
    store = ManifestStore(storage, "alpha")
    files = {"ledger.json": '{"a": 1}', "state.json": "[]", "rollout/x.json": "{}"}
    published = publish(store, config, 0, pack=pack, **files)
    report = store.select(config=config, anchor_is_durable=always)
    assert report.chosen is not None and report.skipped == []
    assert report.chosen.manifest == published.manifest
    assert store.read_file(report.chosen, "ledger.json") == b'{"a": 1}'
    assert store.read_committed_file(1, "rollout/x.json") == b"{}"
    latest = json.loads(storage.read_bytes(LATEST_KEY))
    assert latest["manifest_uri"] == published.manifest_uri
    stored = sorted(k.removeprefix(published.entry + "/") for k in storage.list(published.entry))
    manifest = json.loads(storage.read_bytes(join_key(published.entry, "MANIFEST.json")))
    if pack:
        assert stored == ["MANIFEST.json", "files.pack"] and manifest["schema_version"] == 3
    else:  # exactly the layout and manifest of schema 2, as an older runtime wrote them
        assert stored == ["MANIFEST.json", "ledger.json", "rollout/x.json", "state.json"]
        assert manifest["schema_version"] == 2 and "pack" not in manifest


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "one-file-per-name"])
def test_a_restore_reads_each_verified_file_once(storage, config, monkeypatch, pack):
    store = ManifestStore(storage, "alpha")
    publish(store, config, 0, pack=pack, **{"ledger.json": '{"a": 1}', "state.json": "[]"})
    reads: list[str] = []
    read_bytes = storage.read_bytes

    def counting(key: str) -> bytes:
        reads.append(key.rsplit("/", 1)[-1])
        return read_bytes(key)

    monkeypatch.setattr(storage, "read_bytes", counting)
    chosen = store.select(config=config, anchor_is_durable=always).chosen
    assert chosen is not None
    files = {name: store.read_file(chosen, name) for name in chosen.manifest.files}
    assert files == {"ledger.json": b'{"a": 1}', "state.json": b"[]"}
    if pack:  # one read of the pack for both files
        assert [r for r in reads if r in files or r == "files.pack"] == ["files.pack"]
    else:
        assert sorted(r for r in reads if r in files) == ["ledger.json", "state.json"]


def test_newest_first_and_ids_increase(storage, config):
    store = ManifestStore(storage, "alpha")
    ids = [publish(store, config, step).manifest.snapshot_id for step in (0, 5, 5)]
    assert ids == [1, 2, 3]
    assert store.select(config=config, anchor_is_durable=always).chosen.manifest.snapshot_id == 3


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "one-file-per-name"])
def test_corrupt_file_falls_back_to_the_previous_snapshot(storage, config, pack):
    store = ManifestStore(storage, "alpha")
    publish(store, config, 0, pack=pack)
    newest = publish(store, config, 5, pack=pack, **{"a.json": "[1]", "ledger.json": "{}"})
    tamper_snapshot_file(storage, newest.entry, "ledger.json", b"[]")
    report = store.select(config=config, anchor_is_durable=always)
    assert report.chosen.manifest.snapshot_id == 1
    assert "checksum mismatch" in report.skipped[0][1] and "ledger.json" in report.skipped[0][1]


def test_a_truncated_or_missing_pack_falls_back_to_the_previous_snapshot(storage, config):
    store = ManifestStore(storage, "alpha")
    publish(store, config, 0)
    truncated = publish(store, config, 5, **{"a.json": "[1]", "ledger.json": "{}"})
    key = join_key(truncated.entry, "files.pack")
    storage.write_bytes(key, storage.read_bytes(key)[:-1])
    missing = publish(store, config, 6)
    storage.delete(join_key(missing.entry, "files.pack"))
    report = store.select(config=config, anchor_is_durable=always)
    assert report.chosen.manifest.snapshot_id == 1
    assert "files.pack is missing" in report.skipped[0][1]
    assert "checksum mismatch" in report.skipped[1][1] and "ledger.json" in report.skipped[1][1]


def test_a_packed_manifest_without_offsets_is_refused(storage, config):
    store = ManifestStore(storage, "alpha")
    publish(store, config, 0)
    bad = publish(store, config, 5)
    key = join_key(bad.entry, "MANIFEST.json")
    manifest = json.loads(storage.read_bytes(key))
    del manifest["files"]["ledger.json"]["offset"]
    storage.write_bytes(key, json.dumps(manifest).encode())
    report = store.select(config=config, anchor_is_durable=always)
    assert report.chosen.manifest.snapshot_id == 1
    assert "has no offset into the pack" in report.skipped[0][1]


def test_uncommitted_snapshot_is_never_read(storage, config):
    store = ManifestStore(storage, "alpha")
    publish(store, config, 0)
    storage.write_bytes(join_key(snapshot_dir(2), "ledger.json"), b"partial")
    report = store.select(config=config, anchor_is_durable=always)
    assert report.chosen.manifest.snapshot_id == 1 and report.skipped == []
    assert store.next_snapshot_id() == 3


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda m: {**m, "schema_version": 99}, "unknown manifest schema version 99"),
        (lambda m: {**m, "run_name": "beta"}, "manifest of another run"),
        (lambda m: {**m, "surprise": 1}, "unknown fields: ['surprise']"),
        (lambda m: {k: v for k, v in m.items() if k != "anchor"}, "missing fields: ['anchor']"),
    ],
)
def test_bad_manifests_are_passed_over_with_the_reason(storage, config, mutate, reason):
    store = ManifestStore(storage, "alpha")
    publish(store, config, 0)
    bad = publish(store, config, 5)
    key = join_key(bad.entry, "MANIFEST.json")
    storage.write_bytes(key, json.dumps(mutate(json.loads(storage.read_bytes(key)))).encode())
    report = store.select(config=config, anchor_is_durable=always)
    assert report.chosen.manifest.snapshot_id == 1
    assert reason in report.skipped[0][1]


def test_truncated_manifest_is_passed_over(storage, config):
    store = ManifestStore(storage, "alpha")
    publish(store, config, 0)
    bad = publish(store, config, 5)
    key = join_key(bad.entry, "MANIFEST.json")
    storage.write_bytes(key, storage.read_bytes(key)[:20])
    report = store.select(config=config, anchor_is_durable=always)
    assert report.chosen.manifest.snapshot_id == 1
    assert "not valid JSON" in report.skipped[0][1]


def test_snapshot_with_a_missing_anchor_is_passed_over(storage, config):
    store = ManifestStore(storage, "alpha")
    publish(store, config, 0)
    publish(store, config, 5)
    report = store.select(config=config, anchor_is_durable=lambda a: a.kind == "bootstrap")
    assert report.chosen.manifest.snapshot_id == 1
    assert "anchor step_5 is not durable" in report.skipped[0][1]


def test_changed_fingerprint_refuses_naming_the_keys(storage, config):
    store = ManifestStore(storage, "alpha")
    publish(store, config, 0)
    changed = parse_run_config({"name": "alpha", "seed": 3, "grpo": {"groupSize": 4}})
    with pytest.raises(FingerprintMismatchError) as caught:
        store.select(config=changed, anchor_is_durable=always)
    assert "grpo.groupSize (was 8, now 4)" in str(caught.value)


def test_operational_keys_do_not_change_the_fingerprint(storage, config):
    store = ManifestStore(storage, "alpha")
    publish(store, config, 0)
    moved = parse_run_config(
        {"name": "alpha", "seed": 3, "logDir": "elsewhere", "grpo": {"maxSteps": 500}}
    )
    assert store.select(config=moved, anchor_is_durable=always).chosen is not None


def test_preferred_uri_wins_when_valid(storage, config):
    store = ManifestStore(storage, "alpha")
    first = publish(store, config, 0)
    publish(store, config, 5)
    report = store.select(config=config, anchor_is_durable=always, preferred_uri=first.manifest_uri)
    assert report.chosen.manifest.snapshot_id == 1


def test_fence_failure_commits_nothing(storage, config):
    store = ManifestStore(storage, "alpha")

    def fenced():
        raise RuntimeError("lease held by incarnation 4")

    with pytest.raises(RuntimeError, match="incarnation 4"):
        store.publish(
            config=config,
            anchor=BOOTSTRAP_ANCHOR,
            files={"a": b"1"},
            train_step=0,
            mutation_version=0,
            cut_time=0.0,
            fence=fenced,
        )
    assert store.committed_ids() == []


class _LeaseLostDuringUpload:
    """A storage whose first file write hands the lease to a newer incarnation."""

    def __init__(self, storage) -> None:
        self._storage = storage
        self.lease_lost = False

    def __getattr__(self, name):
        return getattr(self._storage, name)

    def write_many(self, items) -> None:
        self._storage.write_many(items)
        self.lease_lost = True

    def upload_file(self, key, local_path) -> None:
        self._storage.upload_file(key, local_path)
        self.lease_lost = True


def test_a_fence_lost_during_the_upload_commits_nothing(storage, config):
    # The fence passes when the publication starts; a newer incarnation takes the lease
    # while the files upload: the check at the commit point must see it.
    flaky = _LeaseLostDuringUpload(storage)
    store = ManifestStore(flaky, "alpha")

    def fence():
        if flaky.lease_lost:
            raise RuntimeError("lease held by incarnation 4")

    with pytest.raises(RuntimeError, match="incarnation 4"):
        store.publish(
            config=config,
            anchor=BOOTSTRAP_ANCHOR,
            files={"a": b"1", "b": b"2"},
            train_step=0,
            mutation_version=0,
            cut_time=0.0,
            fence=fence,
        )
    assert flaky.lease_lost and ManifestStore(storage, "alpha").committed_ids() == []


def test_losing_the_create_only_race_is_a_fencing_error(storage, config):
    store = ManifestStore(storage, "alpha")
    stale = ManifestStore(storage, "alpha")
    stale._listed_ids = lambda: ([], [])  # a stale trainer that listed before the winner wrote
    publish(store, config, 0)
    with pytest.raises(PublicationFencedError, match="another publisher"):
        publish(stale, config, 0)
    assert store.load_manifest(1).train_step == 0


def test_retention_keeps_latest_and_never_the_only_valid(storage, config):
    store = ManifestStore(storage, "alpha")
    for step in range(5):
        publish(store, config, step)
    # The two newest are corrupt: the window keeps them, and the newest valid (3) survives too.
    deleted = store.apply_retention(2, is_valid=lambda sid: sid < 4)
    assert deleted == [1, 2]
    assert store.committed_ids() == [3, 4, 5]


def test_retention_removes_leftovers_of_killed_publishers(storage, config):
    store = ManifestStore(storage, "alpha")
    storage.write_bytes(join_key(snapshot_dir(1), "ledger.json"), b"partial")
    publish(store, config, 0)
    later = time.time() + store.orphan_grace_s + 60
    assert store.apply_retention(3, now=later) == [1]
    assert store.snapshot_ids() == [2]


def test_retention_spares_a_live_publishers_folder_below_a_higher_commit(storage, config):
    """An old trainer that was not fenced in time commits a higher id while the live one
    is still writing its snapshot's files: the old trainer's retention leaves that young
    folder alone (deleted only once past the orphan grace), so the live one commits it."""
    live, old = ManifestStore(storage, "alpha"), ManifestStore(storage, "alpha")
    publish(live, config, 0)  # snapshot 1

    def old_commits_meanwhile() -> None:  # the live publisher's files are written (id 2)
        publish(old, config, 0)  # id 3, with retention, as an unfenced old trainer does
        assert old.apply_retention(1) == [1]
        assert old.snapshot_ids() == [2, 3]

    live.publish(
        config=config,
        anchor=BOOTSTRAP_ANCHOR,
        files={"ledger.json": b"{}", "state.json": b"[]"},
        train_step=0,
        mutation_version=0,
        cut_time=1.0,
        fence=old_commits_meanwhile,
    )
    assert live.committed_ids() == [2, 3]
    assert live.read_file(live.verify(2, config=config, anchor_is_durable=always), "state.json")


def test_bootstrap_anchor_is_written_once_and_checked(storage, config):
    store = ManifestStore(storage, "alpha")
    store.ensure_bootstrap_anchor(config)
    store.ensure_bootstrap_anchor(config)
    with pytest.raises(FingerprintMismatchError, match="seed"):
        store.ensure_bootstrap_anchor(parse_run_config({"name": "alpha", "seed": 4}))
    with pytest.raises(ManifestError, match="belongs to run 'alpha'"):
        ManifestStore(storage, "beta").ensure_bootstrap_anchor(config)


def test_segment_collection_runs_every_few_publications(storage, config, monkeypatch):
    """Collection (a listing and a date per segment) runs after the first publication and
    every COLLECT_EVERY-th after it, not after each one: what it may delete is older than
    the orphan grace anyway."""
    from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import COLLECT_EVERY

    store = ManifestStore(storage, "alpha")
    passes: list[int] = []
    monkeypatch.setattr(
        store, "collect_segments", lambda: passes.append(len(store.committed_ids()))
    )
    for step in range(2 * COLLECT_EVERY + 1):
        publish_kept(store, config, step)
    assert len(passes) == 3


def test_a_leftover_written_again_since_it_was_dated_is_spared(tmp_path, config):
    """Retention dates a folder without a manifest once and skips it while that date is
    young; once the date is past the grace it lists the folder again before deleting, so a
    publisher that wrote there since keeps its files."""
    import os

    from rolloutrun_runtime.storage import open_storage

    storage = open_storage(f"file://{tmp_path}/storage")
    store = ManifestStore(storage, "alpha")
    old = time.time() - 2 * store.orphan_grace_s
    storage.write_bytes(join_key(snapshot_dir(1), "ledger.json"), b"partial")
    os.utime(storage.path_for(join_key(snapshot_dir(1), "ledger.json")), (old, old))
    publish(store, config, 0)
    assert store.apply_retention(3, now=old + store.orphan_grace_s - 1) == []  # young then
    storage.write_bytes(join_key(snapshot_dir(1), "state.json"), b"written since")
    assert store.apply_retention(3) == []  # the old date is past the grace: listed again
    assert store.snapshot_ids() == [1, 2]
    assert store.apply_retention(3, now=time.time() + store.orphan_grace_s + 1) == [1]


def publish_kept(store: ManifestStore, config: RunConfig, step: int):
    """A publication with retention (``keep_latest`` 2), as the snapshotter publishes."""
    return store.publish(
        config=config,
        anchor=BOOTSTRAP_ANCHOR if step == 0 else Anchor("step", step, step),
        files={"ledger.json": b"{}"},
        train_step=step,
        mutation_version=step,
        cut_time=1.0,
        keep_latest=2,
    )


def test_latest_and_retention_go_with_the_commit_in_one_writer_call(tmp_path, config, monkeypatch):
    """On file:// with a writer process, a publication is two calls of the child (the files,
    then the commit's settle with LATEST and retention's deletes), not one per piece, and
    what is left is what separate calls left: the newest two, LATEST on the newest."""
    from rolloutrun_runtime.storage import close_storage, open_storage, with_writer_process
    from rolloutrun_runtime.storage.writer_process import WriterProcess

    storage = with_writer_process(open_storage(f"file://{tmp_path}/storage"))
    store = ManifestStore(storage, "alpha")
    monkeypatch.setattr(store, "collect_segments", lambda: [])
    calls: list[str] = []
    call = WriterProcess._call
    monkeypatch.setattr(
        WriterProcess, "_call", lambda self, op, *a: (calls.append(op), call(self, op, *a))[1]
    )
    try:
        for step in range(4):
            calls.clear()
            published = publish_kept(store, config, step)
            assert calls == ["write_many", "settle"]
        assert store.committed_ids() == [3, 4]
        assert json.loads(storage.read_bytes(LATEST_KEY))["manifest_uri"] == published.manifest_uri
        assert storage.list(snapshot_dir(1)) == [] == storage.list(snapshot_dir(2))
    finally:
        close_storage(storage)


def test_a_retention_delete_that_fails_is_retried_at_the_next_publication(
    tmp_path, config, monkeypatch, caplog
):
    """A delete that fails after the commit is logged, the publication stands, and the next
    publication's retention deletes that snapshot."""
    from rolloutrun_runtime.storage import StorageError, open_storage
    from rolloutrun_runtime.storage.local import LocalStorage

    storage = open_storage(f"file://{tmp_path}/storage")
    store = ManifestStore(storage, "alpha")
    for step in range(2):
        publish_kept(store, config, step)
    delete = LocalStorage.delete_entry
    failing = {"times": 1}

    def flaky(self, marker):
        if failing["times"]:
            failing["times"] -= 1
            raise StorageError(self.uri_for(marker), "injected")
        return delete(self, marker)

    monkeypatch.setattr(LocalStorage, "delete_entry", flaky)
    publish_kept(store, config, 2)
    assert store.committed_ids() == [1, 2, 3] and "injected" in caplog.text
    publish_kept(store, config, 3)
    assert store.committed_ids() == [3, 4]
