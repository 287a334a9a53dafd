"""``rolloutrun audit`` reads the Gym's side effects from ``gym-audit/`` storage objects too.

Gym replicas of gs:// runs record each effect as a create-only object
(``rolloutrun gym --audit-uri <storage>/gym-audit``); the audit must see them on file:// and
on a real fake-gcs-server, in the run-wide layout and the older per-replica one, fail on a
torn object as on a torn line inside a file, and catch one effect recorded twice.
"""

from __future__ import annotations

import argparse
import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime import audit as A
from rolloutrun_runtime.contract.layout import GYM_AUDIT_PREFIX
from rolloutrun_runtime.environments.gym.effects import effect_key, legacy_effect_key
from rolloutrun_runtime.storage import CheckpointStorage, open_storage
from tests.support.audit_runs import perm, write_run
from tests.support.gcs_emulator import FakeGcs
from tests.support.storage_params import BUCKET


def _entry(instance: str, rollout_id: str, revision: int, attempt: int = 0) -> dict[str, Any]:
    return {
        "t": 1.0,
        "instance_id": instance,
        "rollout_id": rollout_id,
        "attempt": attempt,
        "turn": revision - 1,
        "revision": revision,
        "effect": {"op": "add", "k": 1, "clean": True},
    }


def _put(
    storage: CheckpointStorage,
    entry: dict[str, Any],
    body: bytes | None = None,
    *,
    legacy: bool = True,
) -> str:
    """Write ``entry`` as an effect object: the older per-replica layout, or run-wide."""
    name = (
        legacy_effect_key(entry["instance_id"], entry["rollout_id"], entry["revision"])
        if legacy
        else effect_key(entry["rollout_id"], entry["revision"])
    )
    key = f"{GYM_AUDIT_PREFIX}/{name}"
    storage.write_bytes_if_absent(key, body if body is not None else json.dumps(entry).encode())
    return key


def test_effect_objects_are_loaded_with_the_audit_files(
    storage: CheckpointStorage, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "gym-0.audit.jsonl").write_text(json.dumps(_entry("gym-0", "local", 1)) + "\n")
    for revision in (1, 2):
        _put(storage, _entry("demo-gym-0", "pg1_g0_aA", revision))
    _put(storage, _entry("demo-gym-1", ".dotted", 1))
    _put(storage, _entry("demo-gym-1", "pg1_g1_aB", 1), legacy=False)
    # Neither effect objects nor audit lines: a file:// cluster run's audit files live here.
    storage.write_bytes(f"{GYM_AUDIT_PREFIX}/gym-0.audit.jsonl", b"not read as an object\n")
    storage.write_bytes("step_1/unrelated.json", b"{}")

    effects, torn = A.load_side_effects(run_dir, storage)
    assert torn == A.TornRecords()
    got = sorted((e.rollout_id, e.revision, e.source) for e in effects)
    assert got == [
        (".dotted", 1, "gym-audit/demo-gym-1/%2Edotted/000000001.json"),
        ("local", 1, "gym-0.audit.jsonl"),
        ("pg1_g0_aA", 1, "gym-audit/demo-gym-0/pg1_g0_aA/000000001.json"),
        ("pg1_g0_aA", 2, "gym-audit/demo-gym-0/pg1_g0_aA/000000002.json"),
        ("pg1_g1_aB", 1, "gym-audit/pg1_g1_aB/000000001.json"),
    ]
    assert A.check_side_effects(effects, torn).ok


def test_torn_and_mismatched_objects_fail_the_audit(
    storage: CheckpointStorage, tmp_path: Path
) -> None:
    _put(storage, _entry("demo-gym-0", "r", 1))
    _put(storage, _entry("demo-gym-0", "r", 2), body=b'{"rollout_id": "r", "rev')
    _put(storage, _entry("demo-gym-0", "r", 3), body=json.dumps(_entry("x", "r", 9)).encode())
    bad = _put(storage, _entry("demo-gym-0", "r", 4), body=b"\xff\xfe not json", legacy=False)
    effects, torn = A.load_side_effects(tmp_path, storage)
    assert [e.revision for e in effects] == [1]
    assert len(torn.places) == 3 and bad in torn.places and torn.tails == []
    report = A.check_side_effects(effects, torn)
    assert report.torn_lines == 3 and report.applied == 1
    assert not report.ok and bad in report.torn_examples


def test_one_effect_under_two_replicas_prefixes_is_a_duplicate(
    storage: CheckpointStorage, tmp_path: Path
) -> None:
    """Create-only objects rule out a repeat within one replica's prefix; the audit catches
    the same ``(rollout_id, revision)`` recorded by two replicas."""
    first = _put(storage, _entry("demo-gym-0", "r", 1))
    second = _put(storage, _entry("demo-gym-1", "r", 1, attempt=1))
    _put(storage, _entry("demo-gym-1", "r", 2, attempt=1))
    effects, torn = A.load_side_effects(tmp_path, storage)
    report = A.check_side_effects(effects, torn)
    assert not report.ok and report.duplicated == 1
    assert report.duplicated_examples == [
        {"rollout_id": "r", "revision": 1, "applied": 2, "files": [first, second]}
    ]
    # An older replica's object and the run-wide one of the same effect: also twice.
    third = _put(storage, _entry("demo-gym-0", "r", 2), legacy=False)
    effects, torn = A.load_side_effects(tmp_path, storage)
    report = A.check_side_effects(effects, torn)
    assert report.duplicated == 2
    assert report.duplicated_examples[1]["files"] == sorted(
        [third, f"{GYM_AUDIT_PREFIX}/" + legacy_effect_key("demo-gym-1", "r", 2)]
    )


def test_the_cli_audits_a_gcs_run_from_its_storage(
    tmp_path: Path,
    fake_gcs: FakeGcs,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A gs:// run: checkpoints and side-effect objects in the bucket, no local files."""
    local_dir = tmp_path / "written"
    write_run(local_dir, trained_prompts=perm(0)[:4], position=4)
    source = open_storage("file://" + str(local_dir / "checkpoints"))
    uri = f"gs://{BUCKET}/audit-{uuid.uuid4().hex[:12]}"
    bucket = open_storage(uri, client=fake_gcs.client())
    for key in source.list():
        bucket.write_bytes(key, source.read_bytes(key))
    _put(bucket, _entry("demo-gym-0", "pg0_g0_aA", 1))
    _put(bucket, _entry("demo-gym-0", "pg0_g0_aA", 2))
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", fake_gcs.url)
    config = tmp_path / "run.yaml"
    config.write_text("seed: 11\ntask: {datasetSize: 6}\ngrpo: {maxSteps: 1}\n")
    run_dir = tmp_path / "empty"
    run_dir.mkdir()

    def cli() -> tuple[int, dict[str, Any]]:
        parser = argparse.ArgumentParser()
        A.register(parser)
        args = parser.parse_args(
            [str(run_dir), "--storage", uri, "--config", str(config), "--json"]
        )
        rc = args.handler(args)
        return rc, json.loads(capsys.readouterr().out)

    rc, report = cli()
    assert rc == 0, report
    assert report["source"] == uri + "/step_1"
    assert report["side_effects"]["applied"] == 2
    _put(bucket, _entry("demo-gym-1", "pg0_g0_aA", 2))  # the same effect, another replica
    rc, report = cli()
    assert (rc, report["side_effects_duplicated"]) == (1, 1)
