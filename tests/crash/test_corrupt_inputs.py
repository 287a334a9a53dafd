"""A killed run whose newest snapshot is damaged resumes from an older entry, never partly.

One run is killed right after its third snapshot's manifest is written; each case copies it,
damages that snapshot (a truncated sidecar, a flipped byte, an unknown manifest schema,
another run's manifest, an anchor that is no longer committed), resumes the trainer on the
copy and checks: the damaged snapshot was passed over with its reason logged, the resume
came from an older entry, the run finished, the audit holds and the final weights equal an
uninterrupted run's (a partial restore would change them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import read_events
from rolloutrun_runtime.audit import run_audit
from rolloutrun_runtime.chaos.processes import _trainer_command, run_reference, write_chaos_config
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.crash import ENV_VAR
from rolloutrun_runtime.launcher import GymProcess, start_gym, stop_process

from .conftest import INCARNATION_TIMEOUT_S, SINGLE_TURN, write_config

KILL_AT = "after_manifest_write:3"


class KilledRun:
    def __init__(self, config: Path, run_dir: Path, gyms: list[GymProcess], reference: str):
        self.config, self.run_dir, self.gyms, self.reference = config, run_dir, gyms, reference

    @property
    def urls(self) -> list[str]:
        return [g.url for g in self.gyms]


def _trainer(run_config: Path, log: Path, crash_at: str | None) -> int:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    if crash_at:
        env[ENV_VAR] = crash_at
    with log.open("w") as out:
        return subprocess.run(
            _trainer_command(run_config),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=INCARNATION_TIMEOUT_S,
            start_new_session=True,
        ).returncode


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilledRun]:
    root = tmp_path_factory.mktemp("corrupt")
    config = write_config(root / "run.yaml", SINGLE_TURN)
    reference = run_reference(config, root / "ref", INCARNATION_TIMEOUT_S)
    run_dir = root / "killed"
    run_dir.mkdir()
    gyms = [start_gym(config, root, 0)]
    try:
        run_config = write_chaos_config(config, run_dir, [g.url for g in gyms])
        rc = _trainer(run_config, run_dir / "killed.log", KILL_AT)
        assert rc == -signal.SIGKILL, (run_dir / "killed.log").read_text()[-3000:]
        yield KilledRun(config, run_dir, gyms, reference)
    finally:
        for gym in gyms:
            stop_process(gym.process)
            gym.log.close()


def _newest_snapshot(run_dir: Path) -> Path:
    return sorted((run_dir / "checkpoints" / "rollout_snapshots").glob("snapshot_*"))[-1]


def _edit_manifest(snapshot: Path, **changes: object) -> None:
    path = snapshot / "MANIFEST.json"
    manifest = json.loads(path.read_text())
    manifest.update(changes)
    path.write_text(json.dumps(manifest))


def _in_pack(snapshot: Path, name: str) -> tuple[Path, int, int]:
    """Where file ``name`` of a packed snapshot lies: the pack, its offset and size."""
    manifest = json.loads((snapshot / "MANIFEST.json").read_text())
    record = manifest["files"][name]
    return snapshot / manifest["pack"], record["offset"], record["bytes"]


def _truncate_sidecar(snapshot: Path, run_dir: Path) -> None:
    pack, offset, size = _in_pack(snapshot, "rollout/rollout_recovery.json")
    data = pack.read_bytes()
    pack.write_bytes(data[: offset + size // 2] + data[offset + size :])


def _flip_a_byte(snapshot: Path, run_dir: Path) -> None:
    pack, offset, size = _in_pack(snapshot, "training_journal.json")
    data = bytearray(pack.read_bytes())
    data[offset + size // 2] ^= 0x01
    pack.write_bytes(bytes(data))


def _unknown_schema(snapshot: Path, run_dir: Path) -> None:
    _edit_manifest(snapshot, schema_version=99)


def _another_runs_manifest(snapshot: Path, run_dir: Path) -> None:
    _edit_manifest(snapshot, run_name="some-other-run")


def _missing_anchor(snapshot: Path, run_dir: Path) -> None:
    anchor = json.loads((snapshot / "MANIFEST.json").read_text())["anchor"]
    if anchor["kind"] == "bootstrap":
        (run_dir / "checkpoints" / "bootstrap" / "ANCHOR.json").unlink()
    else:
        (run_dir / "checkpoints" / f"step_{anchor['step']}" / "COMMITTED").unlink()


CASES: dict[str, Callable[[Path, Path], None]] = {
    "truncated_sidecar": _truncate_sidecar,
    "checksum_mismatch": _flip_a_byte,
    "unknown_schema": _unknown_schema,
    "another_runs_manifest": _another_runs_manifest,
    "missing_anchor": _missing_anchor,
}
DEFAULT_CASES = ("checksum_mismatch",)


def _resume_damaged(killed_run: KilledRun, tmp_path: Path, case: str) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(killed_run.run_dir, run_dir)
    damaged = _newest_snapshot(run_dir)
    damaged_id = int(damaged.name.split("_")[1])
    CASES[case](damaged, run_dir)
    run_config = write_chaos_config(killed_run.config, run_dir, killed_run.urls)
    log = run_dir / "resumed.log"
    rc = _trainer(run_config, log, None)
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert f"passing over snapshot rollout_snapshots/{damaged.name}" in text, text[-3000:]
    runs = [e for e in read_events(run_dir / TRACE_FILE) if e["event"] == "run_started"]
    resumed = runs[-1]
    assert resumed["resumed_from"], resumed
    assert resumed.get("snapshot_id") != damaged_id, resumed
    report = run_audit(run_dir, config_file=run_config)
    assert report.prompts.ok and report.rows.ok, report.to_json()
    final = (run_dir / "final_weights.sha256").read_text().strip()
    assert final == killed_run.reference


@pytest.mark.parametrize("case", DEFAULT_CASES)
def test_damaged_newest_snapshot_falls_back(
    case: str, killed_run: KilledRun, tmp_path: Path
) -> None:
    _resume_damaged(killed_run, tmp_path, case)


@pytest.mark.chaos
@pytest.mark.parametrize("case", [c for c in CASES if c not in DEFAULT_CASES])
def test_every_damage_falls_back(case: str, killed_run: KilledRun, tmp_path: Path) -> None:
    _resume_damaged(killed_run, tmp_path, case)
