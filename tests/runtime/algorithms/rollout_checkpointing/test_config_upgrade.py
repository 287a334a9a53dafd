"""A run resumes after an operator upgrade that added a defaulted config field.

The "old release" is simulated by recording the config view without one defaulted field
(``rollout.spareLowWater``), exactly what a release that did not know the field wrote. Real
changes are still refused, naming the key and both values.
"""

from __future__ import annotations

from typing import Any

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing import manifest as manifest_module
from rolloutrun_runtime.algorithms.rollout_checkpointing.manifest import (
    BOOTSTRAP_ANCHOR,
    FingerprintMismatchError,
    ManifestStore,
    fingerprint_of,
    resume_config_differences,
    rollout_config_view,
)
from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import ResumeKind
from rolloutrun_runtime.contract.run_config import RunConfig, parse_run_config
from tests.support.rollout_checkpoints import (
    harness,
    republish_checkpoint,
    tiny_config,
    two_snapshots,
)

NEW_FIELD = "rollout.spareLowWater"


def old_release_view(config: RunConfig) -> dict[str, Any]:
    """The view a release without ``rollout.spareLowWater`` recorded."""
    view = rollout_config_view(config)
    view.pop(NEW_FIELD)
    return view


def config(**grpo: Any) -> RunConfig:
    return parse_run_config({"name": "alpha", "seed": 3, "grpo": grpo})


def publish_as_old_release(store: ManifestStore, monkeypatch: pytest.MonkeyPatch) -> None:
    with monkeypatch.context() as patch:
        patch.setattr(manifest_module, "rollout_config_view", old_release_view)
        store.ensure_bootstrap_anchor(config())
        store.publish(
            config=config(),
            anchor=BOOTSTRAP_ANCHOR,
            files={"ledger.json": b"{}"},
            train_step=0,
            mutation_version=0,
            cut_time=1.0,
        )


def test_a_snapshot_of_an_older_release_resumes_after_the_upgrade(storage, monkeypatch):
    store = ManifestStore(storage, "alpha")
    publish_as_old_release(store, monkeypatch)
    store.ensure_bootstrap_anchor(config())  # the new release's first incarnation
    report = store.select(config=config(), anchor_is_durable=lambda _anchor: True)
    assert report.chosen is not None and report.chosen.manifest.snapshot_id == 1


def test_a_real_change_after_the_upgrade_is_still_refused(storage, monkeypatch):
    store = ManifestStore(storage, "alpha")
    publish_as_old_release(store, monkeypatch)
    changed = config(groupSize=4)
    with pytest.raises(FingerprintMismatchError) as caught:
        store.select(config=changed, anchor_is_durable=lambda _anchor: True)
    message = str(caught.value)
    assert "grpo.groupSize (was 8, now 4)" in message and "refusing to restore" in message
    assert NEW_FIELD not in message  # the added field at its default is no difference
    with pytest.raises(FingerprintMismatchError, match=r"grpo\.groupSize \(was 8, now 4\)"):
        store.ensure_bootstrap_anchor(changed)


def test_the_added_field_set_away_from_its_default_is_refused():
    saved = old_release_view(config())
    moved = parse_run_config({"name": "alpha", "seed": 3, "rollout": {"spareLowWater": 5}})
    assert resume_config_differences(saved, moved) == [f"{NEW_FIELD} (was '<unset>', now 5)"]
    assert resume_config_differences(saved, config()) == []


def test_a_changed_default_is_refused():
    """The recorded view holds effective values: a release that changed a default (here the
    saved group size 8 is what the old release defaulted to, the new default differs) cannot
    slip through by both configs "setting nothing"."""
    saved = rollout_config_view(config())
    saved["grpo.groupSize"] = 16  # what an older release's default was
    assert resume_config_differences(saved, config()) == ["grpo.groupSize (was 16, now 8)"]


def test_a_field_the_new_release_dropped_is_refused():
    saved = rollout_config_view(config()) | {"grpo.entropyBonus": 0.1}
    assert resume_config_differences(saved, config()) == [
        "grpo.entropyBonus (was 0.1, now '<unset>')"
    ]


def _republish_as_old_release(cfg: RunConfig, step: int, view: dict[str, Any]) -> str:
    """``step_<step>``: the newest trainer checkpoint, as a release that recorded ``view``
    wrote it (its fingerprint is the hash of that view)."""
    return republish_checkpoint(
        cfg,
        step,
        lambda state: state.update(config_fingerprint=fingerprint_of(view), config_view=view),
    )


async def test_a_trainer_checkpoint_of_an_older_release_resumes_unless_a_value_changed(
    tmp_path,
) -> None:
    async with harness() as h:
        cfg = await h.start_gyms(
            tiny_config(tmp_path, grpo={"maxSteps": 2}, checkpointing={"savePeriod": 1})
        )
        await two_snapshots(h, cfg)
        _republish_as_old_release(cfg, 3, old_release_view(cfg))
        choice = (await h.controller(cfg)).rollout_restorer.plan()
        assert choice.kind is ResumeKind.TRAINER_CHECKPOINT and choice.trainer_step == 3
        assert choice.skipped == []

        changed = old_release_view(cfg) | {"grpo.clipEpsilon": 0.3}
        refused = _republish_as_old_release(cfg, 4, changed)
        choice = (await h.controller(cfg)).rollout_restorer.plan()
        assert choice.kind is ResumeKind.TRAINER_CHECKPOINT and choice.trainer_step == 3
        assert [uri for uri, _ in choice.skipped] == [refused]
        reason = choice.skipped[0][1]
        assert "grpo.clipEpsilon (was 0.3, now 0.2)" in reason and NEW_FIELD not in reason


def test_a_view_that_does_not_hash_to_its_fingerprint_is_not_trusted():
    """Only a fingerprint changed (an altered record): the view is not taken at its word."""
    view = rollout_config_view(config())
    assert resume_config_differences(view, config(), fingerprint_of(view)) == []
    refused = resume_config_differences(view, config(), "f" * 64)
    assert refused == [
        "the recorded config view does not match its fingerprint ffffffffffff… (altered, or "
        "written by another fingerprint rule)"
    ]


def at_level(level: str) -> RunConfig:
    task = {"name": "reach_target"}  # a multi-turn task: turn level needs one
    return parse_run_config(
        {"name": "alpha", "task": task, "checkpointing": {"targetLevel": level}}
    )


@pytest.mark.parametrize(("saved", "now"), [("sibling", "turn"), ("turn", "sibling")])
def test_turn_and_sibling_level_are_one_durable_level(saved, now):
    """A run asking for turn level records the level it settled on (sibling without a Gym
    control plane); its next incarnation plans before its Gyms answer, still at turn."""
    view = rollout_config_view(at_level(saved))
    assert resume_config_differences(view, at_level(now), fingerprint_of(view)) == []


@pytest.mark.parametrize(
    ("saved", "now"), [("prompt_group", "sibling"), ("turn", "prompt_group"), ("none", "turn")]
)
def test_a_level_with_another_ledger_is_still_refused(saved, now):
    view = rollout_config_view(at_level(saved))
    differing = resume_config_differences(view, at_level(now), fingerprint_of(view))
    assert differing == [f"checkpointing.targetLevel (was {saved!r}, now {now!r})"]
