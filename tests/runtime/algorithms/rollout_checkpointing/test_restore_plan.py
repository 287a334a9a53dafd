"""Restore decides before it installs: every durable entry is a candidate, newest first; a
lagging operator hint decides nothing, a user's pin does; a refused candidate (incompatible
config, a manifest field of the wrong type, a ledger that cannot restart) is skipped with
its reason and nothing of it is installed; when every candidate is refused the trainer exits
``UNRESTORABLE_EXIT_CODE`` instead of crash-looping."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from rolloutrun_operator import builders
from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
    BOOTSTRAP_ANCHOR,
    ManifestError,
    ManifestStore,
    SnapshotManifest,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import (
    DurableEntry,
    RestoreError,
    ResumeKind,
    UnrestorableError,
    check_capacity,
    hint_note,
    newest_first,
)
from rolloutrun_runtime.contract.layout import (
    CONTROLLER_STATE_FILE,
    LEDGER_FILE,
    MANIFEST_NAME,
    PACK_FILE,
    snapshot_dir,
)
from rolloutrun_runtime.contract.run_config import UNRESTORABLE_EXIT_CODE, RunConfig
from rolloutrun_runtime.storage import open_storage
from tests.support.rollout_checkpoints import (
    harness,
    republish,
    republish_checkpoint,
    run_to_end,
    snapshot_file,
    tiny_config,
    two_snapshots,
    whole_ledger,
)
from tests.support.rolloutruns import make_run


def _cfg(tmp_path: Path) -> RunConfig:
    return tiny_config(tmp_path, grpo={"maxSteps": 2}, checkpointing={"savePeriod": 1})


def _with(cfg: RunConfig, **checkpointing: Any) -> RunConfig:
    return cfg.model_copy(
        update={"checkpointing": cfg.checkpointing.model_copy(update=checkpointing)}
    )


def _rendered(cfg: RunConfig, hint: str) -> RunConfig:
    """``cfg`` as the operator renders it for a run that wrote it as ``spec.run``."""
    run = make_run(
        storage={"uri": cfg.resolved_storage_uri(), "volumeClaimName": "demo-storage"},
        gym={"replicas": cfg.gym.replicas},
        run=cfg.settings_yaml_dict(),
    )
    rendered = builders.render_run_config(run, list(cfg.gym.endpoints), hint)
    assert rendered.checkpointing.resume_from == cfg.checkpointing.resume_from
    return rendered


def _manifest_uri(store: ManifestStore, snapshot_id: int) -> str:
    return store.storage.uri_for(f"{snapshot_dir(snapshot_id)}/{MANIFEST_NAME}")


def _publish_foreign_checkpoint(cfg: RunConfig, step: int) -> str:
    """``step_<step>``: a copy of the newest checkpoint, written under another config."""
    return republish_checkpoint(cfg, step, lambda state: state.update(config_fingerprint="f" * 64))


def _model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------- pure order
def test_candidates_are_tried_by_training_progress() -> None:
    snap_1 = DurableEntry(ResumeKind.SNAPSHOT, "s1", 1, 1)
    step_2 = DurableEntry(ResumeKind.TRAINER_CHECKPOINT, "c2", 2)
    snap_2 = DurableEntry(ResumeKind.SNAPSHOT, "s2", 2, 2)
    step_3 = DurableEntry(ResumeKind.TRAINER_CHECKPOINT, "c3", 3)
    ordered = newest_first([snap_1, step_2, snap_2, step_3])
    assert ordered == [step_3, snap_2, step_2, snap_1]
    assert hint_note(ordered, "c3") is None
    note = hint_note(ordered, "s1")
    assert note is not None and "lags" in note and "c3" in note
    check_capacity(2, 14, 16)
    with pytest.raises(RestoreError, match=r"rollout\.replayCapacity"):
        check_capacity(3, 14, 16)


def test_a_manifest_field_of_the_wrong_type_is_refused_by_name() -> None:
    good = SnapshotManifest(
        run_name="r",
        snapshot_id=1,
        anchor=BOOTSTRAP_ANCHOR,
        fingerprint="x",
        config_view={},
        train_step=1,
        mutation_version=0,
        files={},
        created_at=0.0,
        cut_time=0.0,
    )
    assert SnapshotManifest.from_bytes(good.to_bytes(), "m") == good
    for field, value in [("train_step", "1"), ("files", ["a"]), ("snapshot_id", True)]:
        data = json.loads(good.to_bytes())
        data[field] = value
        with pytest.raises(ManifestError, match=f"field {field} is "):
            SnapshotManifest.from_bytes(json.dumps(data).encode(), "m")


# ---------------------------------------------------------------------------- finding 5
async def test_a_lagging_hint_loses_to_newer_durable_entries(tmp_path) -> None:
    """The operator's hint names the older snapshot: the newer snapshot is restored, and
    without it the newer trainer checkpoint (not the hinted snapshot)."""
    async with harness() as h:
        cfg = await h.start_gyms(_cfg(tmp_path))
        store = await two_snapshots(h, cfg)
        oldest, newest = store.committed_ids()
        # the config exactly as the operator renders it from its (lagging) Lease annotation
        hinted = _rendered(cfg, _manifest_uri(store, oldest))

        choice = (await h.controller(hinted)).rollout_restorer.plan()
        assert choice.kind is ResumeKind.SNAPSHOT and not choice.pinned
        assert choice.candidate is not None and choice.candidate.manifest.snapshot_id == newest

        store.storage.delete(f"{snapshot_dir(newest)}/{MANIFEST_NAME}")
        controller = await h.controller(hinted)
        restored = await controller.restore()
        assert restored is not None and not restored.source.is_rollout_snapshot
        assert restored.source.path is not None and restored.source.path.endswith("step_2")
        assert controller.trainer_version == 2


async def test_a_user_pin_is_honoured_and_reported(tmp_path, caplog) -> None:
    """A ``resumeFrom`` the user wrote survives the operator's rendering and is restored
    even though newer entries exist; a pin may name a trainer checkpoint too."""
    caplog.set_level(logging.INFO)
    async with harness() as h:
        cfg = await h.start_gyms(_cfg(tmp_path))
        store = await two_snapshots(h, cfg)
        oldest, newest = store.committed_ids()
        pin = _manifest_uri(store, oldest)
        pinned = _rendered(_with(cfg, resume_from=pin), _manifest_uri(store, newest))

        controller = await h.controller(pinned)
        restored = await controller.restore()
        assert restored is not None and restored.source.path == pin
        assert controller.trainer_version == 1
        assert "as pinned by checkpointing.resumeFrom" in caplog.text

        step_1 = store.storage.uri_for("step_1")
        choice = (await h.controller(_with(cfg, resume_from=step_1))).rollout_restorer.plan()
        assert choice.pinned and choice.kind is ResumeKind.TRAINER_CHECKPOINT
        assert choice.trainer_step == 1

        # a pin that names nothing durable is not silently replaced by another entry
        with pytest.raises(UnrestorableError, match="pinned"):
            (await h.controller(_with(cfg, resume_from=pin + "x"))).rollout_restorer.plan()


# ---------------------------------------------------------------------------- finding 8
async def test_an_incompatible_trainer_checkpoint_is_refused_for_an_older_entry(
    tmp_path, caplog
) -> None:
    caplog.set_level(logging.WARNING)
    async with harness() as h:
        cfg = await h.start_gyms(_cfg(tmp_path))
        store = await two_snapshots(h, cfg)
        foreign = _publish_foreign_checkpoint(cfg, 3)
        choice = (await h.controller(cfg)).rollout_restorer.plan()
        assert choice.kind is ResumeKind.SNAPSHOT and choice.candidate is not None
        assert choice.candidate.manifest.snapshot_id == store.committed_ids()[-1]
        assert [uri for uri, _ in choice.skipped] == [foreign]
        assert "different rollout-relevant config" in choice.skipped[0][1]
        assert "passing over trainer checkpoint step_3: " in caplog.text


async def test_a_manifest_with_a_wrong_field_type_falls_back(tmp_path) -> None:
    async with harness() as h:
        cfg = await h.start_gyms(_cfg(tmp_path))
        store = await two_snapshots(h, cfg)
        newest = store.committed_ids()[-1]
        key = f"{snapshot_dir(newest)}/{MANIFEST_NAME}"
        document = json.loads(store.storage.read_bytes(key))
        document["train_step"] = str(document["train_step"])
        store.storage.write_bytes(key, json.dumps(document).encode())
        controller = await h.controller(cfg)
        restored = await controller.restore()
        assert restored is not None and restored.source.path is not None
        assert restored.source.path.endswith("step_2") and controller.trainer_version == 2
        choice = controller.rollout_restorer.plan()
        assert choice.skipped[0][0] == store.storage.uri_for(key)
        assert "field train_step is str, expected int" in choice.skipped[0][1]


async def test_a_snapshot_of_the_one_file_per_name_layout_still_restores(tmp_path) -> None:
    """A snapshot an older runtime wrote (manifest schema 2, each file its own object, no
    pack) is chosen, restored and trained on to the end."""
    async with harness() as h:
        cfg = await h.start_gyms(_cfg(tmp_path))
        store = await two_snapshots(h, cfg)
        newest = store.committed_ids()[-1]
        assert store.load_manifest(newest).pack == PACK_FILE
        old = republish(store, cfg, newest, pack=False)
        manifest = json.loads(store.storage.read_bytes(f"{old.entry}/{MANIFEST_NAME}"))
        assert manifest["schema_version"] == 2 and "pack" not in manifest
        stored = {k.removeprefix(old.entry + "/") for k in store.storage.list(old.entry)}
        assert stored == {MANIFEST_NAME, *manifest["files"]} and PACK_FILE not in stored

        controller = await h.controller(cfg)
        restored = await controller.restore()
        assert restored is not None and restored.snapshot_id == old.manifest.snapshot_id
        await run_to_end(controller)
        assert controller.trainer_version == cfg.grpo.max_steps


async def test_nothing_is_installed_before_the_decision(tmp_path) -> None:
    """The only candidates are a snapshot whose ledger cannot restart (a finalization of
    unknown outcome) and a checkpoint of another config: both refused, and the weights,
    optimizer, step and cursor are the ones the controller was built with."""
    async with harness() as h:
        cfg = await h.start_gyms(_cfg(tmp_path))
        store = await two_snapshots(h, cfg)
        oldest = store.committed_ids()[0]
        entry = snapshot_dir(oldest)
        ledger = whole_ledger(store.storage, entry)
        assert ledger["groups"], "the snapshot after step 1 holds unfinished groups"
        ledger["groups"][0]["status"] = "finalization_unknown"
        controller_state = json.loads(snapshot_file(store.storage, entry, CONTROLLER_STATE_FILE))
        controller_state.pop("rollout_recovery", None)
        stuck = republish(
            store,
            cfg,
            oldest,
            **{
                LEDGER_FILE: json.dumps(ledger).encode(),
                CONTROLLER_STATE_FILE: json.dumps(controller_state).encode(),
            },
        )
        for snapshot_id in store.committed_ids():
            if snapshot_id != stuck.manifest.snapshot_id:
                store.storage.delete(f"{snapshot_dir(snapshot_id)}/{MANIFEST_NAME}")
        foreign = _publish_foreign_checkpoint(cfg, 3)
        for step in (1, 2):
            store.storage.delete(f"step_{step}/COMMITTED")

        controller = await h.controller(cfg)
        weights = _model_state(controller.model)
        optimizer = json.dumps(controller.optimizer.state_dict(), default=str)
        cursor = controller.dataloader.state_dict()
        with pytest.raises(UnrestorableError) as refused:
            await controller.restore()
        reasons = dict(refused.value.refused)
        assert "finalization whose outcome is unknown" in reasons[stuck.manifest_uri]
        assert "different rollout-relevant config" in reasons[foreign]
        assert _same(weights, _model_state(controller.model))
        assert json.dumps(controller.optimizer.state_dict(), default=str) == optimizer
        assert controller.dataloader.state_dict() == cursor
        assert controller.trainer_version == 0 and controller.resume.fresh


def test_no_restorable_entry_exits_unrestorable(tmp_path, capsys) -> None:
    """Through the trainer's entry point: one committed snapshot, refused (a manifest field
    of the wrong type), is exit 78 with the reason, not an exception (a restart loop)."""
    from rolloutrun_runtime import trainer

    cfg = tiny_config(tmp_path, gym={"replicas": 1, "endpoints": ["http://127.0.0.1:9"]})
    store = ManifestStore(open_storage(cfg.resolved_storage_uri()), cfg.name)
    candidate = store.publish(
        config=cfg,
        anchor=BOOTSTRAP_ANCHOR,
        files={CONTROLLER_STATE_FILE: b"{}"},
        train_step=1,
        mutation_version=1,
        cut_time=0.0,
    )
    key = f"{candidate.entry}/{MANIFEST_NAME}"
    document = json.loads(store.storage.read_bytes(key))
    document["train_step"] = "1"
    store.storage.write_bytes(key, json.dumps(document).encode())
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.to_yaml_dict()))

    code = trainer.main(argparse.Namespace(config=str(config_file), log_dir=None))
    assert code == UNRESTORABLE_EXIT_CODE
    err = capsys.readouterr().err
    assert candidate.manifest_uri in err and "field train_step is str" in err


def test_another_runs_storage_is_refused_even_past_this_runs_max_steps(tmp_path, capsys) -> None:
    """A run given the storage of another (a copied manifest's ``storage.uri``) resumed from
    its newest checkpoint, and one past its own ``maxSteps`` exited 0 at once, calling that
    run's weights its own. The storage's bootstrap anchor names its run: exit 78, named."""
    from rolloutrun_runtime import trainer

    cfg = tiny_config(tmp_path, gym={"replicas": 1, "endpoints": ["http://127.0.0.1:9"]})
    assert cfg.name != "other-run"
    store = ManifestStore(open_storage(cfg.resolved_storage_uri()), "other-run")
    store.ensure_bootstrap_anchor(cfg)
    store.publish(
        config=cfg,
        anchor=BOOTSTRAP_ANCHOR,
        files={CONTROLLER_STATE_FILE: b"{}"},
        train_step=cfg.grpo.max_steps + 5,
        mutation_version=1,
        cut_time=0.0,
    )
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(cfg.to_yaml_dict()))

    code = trainer.main(argparse.Namespace(config=str(config_file), log_dir=None))
    assert code == UNRESTORABLE_EXIT_CODE
    err = capsys.readouterr().err
    assert f"storage belongs to run 'other-run', not {cfg.name!r}" in err
    assert "give this run its own storage.uri, or name it 'other-run'" in err
    # its own name resumes as before: the anchor is this run's
    assert ManifestStore(store.storage, "other-run").owner_problem() is None
