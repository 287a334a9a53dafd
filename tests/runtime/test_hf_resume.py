"""A resumed Hugging Face trainer never reads ``policy.model``'s weight files: it plans its
restore first and builds the model (and its generation workers) around the anchor's weights,
which replace the model's own at once. Proven by spoiling the model's weight files between
two ``rolloutrun train`` runs of one storage (they are still there, so the entry point's
check of the directory passes, but no reader could parse them): the second run resumes,
trains on and exports, where it used to fail reading ``*.safetensors`` before its restore."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import yaml

from rolloutrun_runtime.contract.layout import FINAL_MODEL_DIR, TRACE_FILE
from rolloutrun_runtime.metrics import read_metrics
from rolloutrun_runtime.policy.make_tiny_hf import write_model
from tests.support.cli import train_command

ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, model: Path, max_steps: int) -> Path:
    document = yaml.safe_load((ROOT / "examples" / "tiny-hf.yaml").read_text())
    run = document["spec"]["run"]
    run["policy"]["model"] = str(model)
    run["grpo"].update(groupSize=4, promptsPerStep=2, maxSteps=max_steps)
    run["rollout"]["maxInFlightGroups"] = 4
    run["checkpointing"].update(savePeriod=1, snapshotIntervalSeconds=600)
    config = tmp_path / f"tiny-hf-{max_steps}.yaml"
    config.write_text(yaml.safe_dump(document))
    return config


def _trace(log_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_dir / TRACE_FILE).read_text().splitlines()]


def storage_uri(log_dir: Path, entry: str) -> str:
    return f"file://{log_dir / 'checkpoints' / entry}"


def _train(config: Path, log_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        train_command(config, log_dir), capture_output=True, text=True, timeout=300
    )


def test_a_resumed_hf_trainer_reads_no_weight_file_of_its_model(tmp_path: Path) -> None:
    model = tmp_path / "model"
    write_model(model, "llama", seed=0)
    log_dir = tmp_path / "run"  # its checkpoints/ is the storage of both runs
    first = _train(_config(tmp_path, model, max_steps=2), log_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    weight_files = sorted(model.glob("*.safetensors"))
    assert weight_files
    for path in weight_files:
        path.write_bytes(b"not weights: a resumed trainer must never read this file")

    second = _train(_config(tmp_path, model, max_steps=3), log_dir)

    assert second.returncode == 0, second.stderr[-3000:]
    assert [r["step"] for r in read_metrics(log_dir)] == [1, 2, 3]
    started = [e for e in _trace(log_dir) if e["event"] == "run_started"]
    # From step_2, or from a rollout snapshot the first run published after it (timing):
    # either way the model is built on a trainer checkpoint's weights, not the model's files.
    first_from, second_from = (e["resumed_from"] for e in started)
    assert first_from is None and second_from.startswith(storage_uri(log_dir, ""))
    exported = log_dir / "checkpoints" / FINAL_MODEL_DIR
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in exported.iterdir()
    }
