"""The audit's checks: a clean state passes, each doctored state fails the check it breaks.

The pure checks run over hand-built ``DurableState``s; the loader runs over a committed
trainer-checkpoint entry written with the real storage publication, and the CLI over it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from rolloutrun_runtime import audit as A
from rolloutrun_runtime.contract import layout
from rolloutrun_runtime.storage import open_storage
from tests.support.audit_runs import DATA_PLANE_METADATA, SEED, SIZE, perm, write_run


def clean_state() -> A.DurableState:
    """Epoch 0 fully drawn, epoch 1 drawn to position 4: 6 + 2 trained, 1 spare, 1 in replay."""
    p0, p1 = perm(0), perm(1)
    trained = [(1 + i // 2, A.Prompt(pid, 0)) for i, pid in enumerate(p0)]
    trained += [(4, A.Prompt(p1[0], 1)), (4, A.Prompt(p1[1], 1))]
    replay_group = A.LedgerGroup(
        "pgR",
        A.Prompt(p1[2], 1),
        "finalized",
        "turn",
        (A.LedgerAttempt("pgR_g0_aX", "sealed", 1, "pgR_g0_aX-a1"),),
    )
    generating = A.LedgerGroup(
        "pgG",
        A.Prompt(p1[3], 1),
        "generating",
        "turn",
        (A.LedgerAttempt("pgG_g0_aY", "sealed", 0, "pgG_g0_aY"),),
    )
    effects = [
        A.SideEffect("gym-0.audit.jsonl", "pgR_g0_aX", 0, 1, 0),
        A.SideEffect("gym-0.audit.jsonl", "pgR_g0_aX", 1, 2, 1),
        A.SideEffect("gym-1.audit.jsonl", "pgG_g0_aY", 0, 1, 0),
    ]
    return A.DurableState(
        source="mem://step_4",
        step=4,
        dataset_size=SIZE,
        cursor_epoch=1,
        cursor_position=5,
        permutations=A.permutations_for(SEED, SIZE, 1),
        trained=trained,
        ledger=[replay_group, generating],
        spare=[A.Prompt(p1[4], 1)],
        replay=[{"group_id": "pgR", "prompt_id": p1[2], "row_keys": ["pgR_g0"]}],
        staging_keys=["pgG_g0_aY"],
        train_keys=["pgR_g0"],
        side_effects=effects,
    )


def test_clean_state_passes_every_check() -> None:
    report = A.audit(clean_state())
    assert report.ok, report.to_json()
    assert report.prompts.drawn == SIZE + 5
    assert report.prompts.trained == SIZE + 2
    assert report.gym_attempts.turn_restores == 1
    data = report.to_json()
    assert (data["lost"], data["duplicated"], data["ok"]) == (0, 0, True)


def _lose_a_trained(s: A.DurableState) -> None:
    s.trained.pop()


def _train_twice(s: A.DurableState) -> None:
    s.trained.append((5, s.trained[0][1]))


def _lose_the_spare(s: A.DurableState) -> None:
    s.spare.clear()


def _cursor_back(s: A.DurableState) -> None:
    s.cursor_position = 3


def _apply_twice(s: A.DurableState) -> None:
    s.side_effects.append(dataclasses.replace(s.side_effects[0], source="gym-1.audit.jsonl"))


def _zombie_attempt(s: A.DurableState) -> None:
    s.side_effects.append(dataclasses.replace(s.side_effects[1], attempt=0, revision=3))


def _ledger_behind(s: A.DurableState) -> None:
    group = s.ledger[0]
    s.ledger[0] = dataclasses.replace(
        group, attempts=(dataclasses.replace(group.attempts[0], gym_attempt=0),)
    )


def _restore_in_sibling_group(s: A.DurableState) -> None:
    s.ledger[0] = dataclasses.replace(s.ledger[0], restore_level="sibling")


def _orphan_staging(s: A.DurableState) -> None:
    s.staging_keys.append("pgZ_g0_aQ")


def _orphan_train(s: A.DurableState) -> None:
    s.train_keys.append("pgZ_g0")


def _replay_not_in_ledger(s: A.DurableState) -> None:
    s.ledger[0] = dataclasses.replace(s.ledger[0], status="generating")


def _finalized_missing_from_replay(s: A.DurableState) -> None:
    s.replay.clear()
    s.train_keys.clear()


DOCTORINGS: list[tuple[str, Callable[[A.DurableState], None], str, str]] = [
    ("a trained prompt is missing", _lose_a_trained, "prompts", "lost"),
    ("a prompt trained twice in an epoch", _train_twice, "prompts", "duplicated"),
    ("the spare pool is missing", _lose_the_spare, "prompts", "lost"),
    ("the cursor went backwards", _cursor_back, "prompts", "undrawn"),
    ("a side effect applied twice", _apply_twice, "side_effects", "duplicated"),
    ("an abandoned attempt applied an effect", _zombie_attempt, "gym_attempts", "violations"),
    ("the ledger is behind the environment", _ledger_behind, "gym_attempts", "violations"),
    ("a restore in a sibling-level group", _restore_in_sibling_group, "gym_attempts", "violations"),
    ("an orphaned staging row", _orphan_staging, "rows", "orphaned_staging"),
    ("an orphaned train row", _orphan_train, "rows", "orphaned_train"),
    (
        "a replay group the ledger has not finalized",
        _replay_not_in_ledger,
        "rows",
        "replay_not_finalized",
    ),
    (
        "a finalized group missing from replay",
        _finalized_missing_from_replay,
        "rows",
        "finalized_not_in_replay",
    ),
]


@pytest.mark.parametrize(
    ("doctor", "check", "counter"),
    [d[1:] for d in DOCTORINGS],
    ids=[d[0] for d in DOCTORINGS],
)
def test_each_doctored_state_fails_its_check(
    doctor: Callable[[A.DurableState], None], check: str, counter: str
) -> None:
    state = clean_state()
    doctor(state)
    report = A.audit(state)
    part = getattr(report, check)
    assert not report.ok
    assert not part.ok
    assert getattr(part, counter) >= 1
    others = {"prompts", "side_effects", "gym_attempts", "rows"} - {check}
    # A doctoring breaks its own check; the loss of a replay group also breaks prompts.
    if counter != "finalized_not_in_replay":
        assert all(getattr(report, other).ok for other in others), report.to_json()


def test_dropped_prompts_are_accounted_for() -> None:
    state = clean_state()
    dropped = state.spare.pop()
    assert A.audit(state).prompts.lost == 1
    state.dropped.append(dropped)
    assert A.audit(state).prompts.ok


def _runtime_state_holding(prompt: A.Prompt, *, used: bool, leftover: bool) -> dict:
    """A ``runtime_state.json`` whose only unadmitted reserve prompt is ``prompt``."""
    ref = {"prompt_id": prompt.prompt_id, "epoch": prompt.epoch, "index": 0}
    other = {"prompt_id": prompt.prompt_id, "epoch": prompt.epoch + 5, "index": 0}
    if leftover:
        return {"step_reserves": {}, "leftovers": [{"step": 3, "position": 0, "prompt": ref}]}
    record = {"prompts": [other], "reserve": [ref], "used": [used]}
    return {"step_reserves": {"5": record}, "leftovers": []}


@pytest.mark.parametrize(
    ("used", "leftover", "lost"), [(False, False, 0), (True, False, 1), (False, True, 0)]
)
def test_spare_reserves_count_as_pending_unless_used(used: bool, leftover: bool, lost: int) -> None:
    """Deterministic mode's reserve prompts (unused ones, and leftovers handed on) are
    drawn and pending; a used one became a ledger group, so it does not count again."""
    state = clean_state()
    prompt = state.spare.pop()
    state.reserved = A.parse_reserves(_runtime_state_holding(prompt, used=used, leftover=leftover))
    assert A.check_prompts(state).lost == lost


def test_a_reserve_without_its_used_flags_is_an_error() -> None:
    document = _runtime_state_holding(A.Prompt(1, 0), used=False, leftover=False)
    document["step_reserves"]["5"]["used"] = []
    with pytest.raises(A.AuditError, match="step 5's spare reserve has 1 prompts, 0 used flags"):
        A.parse_reserves(document)
    assert A.parse_reserves({}) == []  # a state written before reserves existed


def test_same_prompt_in_two_epochs_is_not_a_duplicate() -> None:
    state = clean_state()
    p1 = perm(1)
    assert A.Prompt(p1[0], 0) in {p for _, p in state.trained}
    assert A.check_prompts(state).duplicated == 0


def test_without_the_seed_counts_still_find_a_loss() -> None:
    state = clean_state()
    state.permutations = None
    assert A.check_prompts(state).ok
    state.trained.pop()
    report = A.check_prompts(state)
    assert (report.lost, report.drawn_from) == (1, "cursor")


def test_side_effect_lines_torn_are_counted_not_trusted() -> None:
    lines = [
        json.dumps({"rollout_id": "r", "attempt": 0, "revision": 1, "turn": 0}),
        '{"rollout_id": "r", "attem',
    ]
    effects, torn = A.parse_side_effects(lines, "gym-0.audit.jsonl")
    assert (len(effects), torn) == (1, 1)


@pytest.mark.parametrize(
    "journal",
    [
        {"schema": 2, "steps": []},
        {"schema": 1, "steps": [{"step": 2, "groups": []}, {"step": 1, "groups": []}]},
    ],
)
def test_journal_that_cannot_be_trusted_is_an_error(journal: dict) -> None:
    with pytest.raises(A.AuditError):
        A.parse_journal(journal, "journal")


# --------------------------------------------------------------------------- loader + CLI
def _cli(run_dir: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    parser = argparse.ArgumentParser()
    A.register(parser)
    args = parser.parse_args([str(run_dir), "--config", str(config), "--json"])
    rc = args.handler(args)
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"seed: {SEED}\ntask: {{datasetSize: {SIZE}}}\ngrpo: {{maxSteps: 1}}\n")
    return path


def test_cli_passes_a_complete_run(
    tmp_path: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, trained_prompts=perm(0)[:4], position=4)
    rc, report = _cli(run_dir, config_file, capsys)
    assert rc == 0, report
    assert report["prompts"]["drawn_from"] == "permutation"
    assert report["side_effects"]["applied"] == 1


def test_cli_fails_a_run_that_lost_a_prompt(
    tmp_path: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, trained_prompts=perm(0)[:3], position=4)
    rc, report = _cli(run_dir, config_file, capsys)
    assert (rc, report["lost"], report["prompts"]["lost_examples"]) == (
        1,
        1,
        [{"prompt_id": perm(0)[3], "epoch": 0}],
    )


def test_corrupt_sidecar_is_an_error_not_a_verdict(tmp_path: Path, config_file: Path) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, trained_prompts=perm(0)[:4], position=4)
    state_file = run_dir / "checkpoints" / "step_1" / layout.TRAINER_STATE_FILE
    state = json.loads(state_file.read_text())
    state["rollout_recovery"] = {"rollout_recovery_sha256": "0" * 64}
    state_file.write_text(json.dumps(state))
    with pytest.raises(A.AuditError, match="sha256"):
        A.run_audit(run_dir, config_file=config_file)


def test_no_checkpoint_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(A.AuditError, match="no committed trainer checkpoint"):
        A.run_audit(tmp_path)


def _write_snapshot(
    run_dir: Path, *, trained_prompts: list[int], damaged: bool, packed: bool
) -> None:
    import hashlib

    storage = open_storage("file://" + str(run_dir / "checkpoints"))
    step1 = run_dir / "checkpoints" / "step_1"
    files = {
        name: (step1 / name).read_bytes()
        for name in (layout.JOURNAL_FILE, layout.LEDGER_FILE, DATA_PLANE_METADATA)
    }
    journal = json.loads(files[layout.JOURNAL_FILE])
    journal["steps"].append(
        {
            "step": 2,
            "weight_version_before": 1,
            "groups": [
                {"group_id": f"pgS{i}", "prompt_id": pid, "epoch": 0, "target_step": 2}
                for i, pid in enumerate(trained_prompts)
            ],
        }
    )
    files[layout.JOURNAL_FILE] = json.dumps(journal).encode()
    state = json.loads((step1 / layout.TRAINER_STATE_FILE).read_text())
    state["dataloader"]["position"] = SIZE
    files[layout.CONTROLLER_STATE_FILE] = json.dumps(state).encode()
    manifest = {
        "train_step": 2,
        "files": {
            name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
            for name, data in files.items()
        },
    }
    if damaged:
        files[layout.JOURNAL_FILE] = files[layout.JOURNAL_FILE][:-1] + b" "
    entry = "rollout_snapshots/snapshot_000001"
    if packed:  # manifest schema 3: the files as one pack, the manifest its index
        offset = 0
        for name in sorted(files):
            manifest["files"][name]["offset"] = offset
            offset += len(files[name])
        manifest["pack"] = layout.PACK_FILE
        pack = b"".join(files[name] for name in sorted(files))
        storage.write_bytes(f"{entry}/{layout.PACK_FILE}", pack)
    else:
        for name, data in files.items():
            storage.write_bytes(f"{entry}/{name}", data)
    storage.write_bytes(f"{entry}/MANIFEST.json", json.dumps(manifest).encode())


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "one-file-per-name"])
@pytest.mark.parametrize("damaged", [False, True])
def test_a_newer_intact_snapshot_is_audited_a_damaged_one_passed_over(
    tmp_path: Path, config_file: Path, damaged: bool, packed: bool
) -> None:
    run_dir = tmp_path / "run"
    write_run(run_dir, trained_prompts=perm(0)[:4], position=4)
    _write_snapshot(run_dir, trained_prompts=perm(0)[4:], damaged=damaged, packed=packed)
    report = A.run_audit(run_dir, config_file=config_file)
    if damaged:
        assert (report.source.endswith("step_1"), report.step, report.ok) == (True, 1, True)
    else:
        assert report.source.endswith("snapshot_000001") and report.step == 2
        assert report.ok and report.prompts.trained == SIZE


def test_side_effect_files_and_storage_in_different_places(
    tmp_path: Path, config_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The cluster layout: Gym audit files under ``<storage>/gym-audit``, ``--storage``."""
    storage_dir = tmp_path / "storage"
    write_run(storage_dir, trained_prompts=perm(0)[:4], position=4)
    audit_dir = tmp_path / "gym-audit"
    audit_dir.mkdir()
    (storage_dir / "gym-0.audit.jsonl").rename(audit_dir / "gym-0.audit.jsonl")
    parser = argparse.ArgumentParser()
    A.register(parser)
    uri = "file://" + str(storage_dir / "checkpoints")
    args = parser.parse_args(
        [str(audit_dir), "--storage", uri, "--config", str(config_file), "--json"]
    )
    assert args.handler(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["source"] == uri + "/step_1"
    assert report["side_effects"]["applied"] == 1


class _NoObjects:
    def list(self, prefix: str = "") -> list[str]:
        return []


def _effect_line(revision: int) -> str:
    return json.dumps({"rollout_id": "r", "attempt": 0, "revision": revision, "turn": 0}) + "\n"


def test_a_torn_line_inside_an_audit_file_fails_naming_file_and_line(tmp_path: Path) -> None:
    """Issue 10, finding 10: a torn line may hide a duplicated effect, so it fails the audit
    (before, torn lines were counted and ignored)."""
    (tmp_path / "gym-0.audit.jsonl").write_text(
        _effect_line(1) + '{"rollout_id": "r", "rev' + "\n" + _effect_line(3)
    )
    effects, torn = A.load_side_effects(tmp_path, _NoObjects())
    report = A.check_side_effects(effects, torn)
    assert [e.revision for e in effects] == [1, 3]
    assert not report.ok and report.torn_lines == 1
    assert report.torn_examples == ["gym-0.audit.jsonl:2"]


def test_a_torn_tail_is_reported_and_tolerated(tmp_path: Path) -> None:
    """The last line cut short by a crash mid-append: its effect was never applied."""
    (tmp_path / "gym-1.audit.jsonl").write_text(_effect_line(1) + _effect_line(2)[:10])
    (tmp_path / "gym-0.audit.jsonl").write_text(_effect_line(2))
    effects, torn = A.load_side_effects(tmp_path, _NoObjects())
    report = A.check_side_effects(effects, torn)
    assert report.ok and report.applied == 2 and report.duplicated == 0
    assert (report.torn_lines, report.torn_tails) == (0, 1)
    assert report.torn_tail_examples == ["gym-1.audit.jsonl:2"]
