"""``rolloutrun train`` on examples/tiny-hf.yaml learns: a tiny Llama-style model in the
Hugging Face layout, written offline by ``make_tiny_hf``, raises its reward as the built-in
model does (test_learning.py's measure: the mean reward of the last five steps against the
first five, in deterministic mode so the margin is the margin).

Measured once (2 shared CPU cores, another run beside it): 0.041 -> 0.353, margin 0.313
over 30 steps (about 2.5 minutes: a byte-level BPE over 295 tokens, random weights, the
tokenizer trained on the tasks' text). Long for the default suite, so ``chaos``-marked; the
fast tests of the same path are tests/runtime/policy/test_hf_policy.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from rolloutrun_runtime.contract.layout import FINAL_MODEL_DIR
from rolloutrun_runtime.metrics import FINAL_WEIGHTS_FILE, read_metrics
from rolloutrun_runtime.policy.make_tiny_hf import write_model
from tests.support.cli import train_command

ROOT = Path(__file__).resolve().parents[2]
MARGIN = 0.2


@pytest.mark.chaos
def test_tiny_hf_example_learns_and_exports_its_final_model(tmp_path: Path) -> None:
    write_model(tmp_path / "model", "llama", seed=0)
    document = yaml.safe_load((ROOT / "examples" / "tiny-hf.yaml").read_text())
    run = document["spec"]["run"]
    run["policy"]["model"] = str(tmp_path / "model")
    run["checkpointing"]["deterministic"] = True
    config = tmp_path / "tiny-hf.yaml"
    config.write_text(yaml.safe_dump(document))
    log_dir = tmp_path / "run"
    completed = subprocess.run(
        train_command(config, log_dir),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    records = read_metrics(log_dir)
    assert [r["step"] for r in records] == list(range(1, 31))
    first = sum(r["reward_mean"] for r in records[:5]) / 5
    last = sum(r["reward_mean"] for r in records[-5:]) / 5
    assert last - first >= MARGIN, f"first five {first:.3f}, last five {last:.3f}"
    assert len((log_dir / FINAL_WEIGHTS_FILE).read_text().strip()) == 64
    exported = log_dir / "checkpoints" / FINAL_MODEL_DIR
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in exported.iterdir()
    }
