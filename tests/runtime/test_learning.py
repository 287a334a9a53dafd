"""``rolloutrun train`` on the shipped examples learns: the mean reward of the last five
steps is clearly above the first five.

The test trains each example in deterministic mode (``checkpointing.deterministic: true``):
the run is then a pure function of the config, so the margin below is the margin, not a
sample of a noisy one. Asynchronous runs of the examples as shipped vary with machine load
(tiny-grpo measured 0.31-0.32 alone and 0.17 on a machine busy with other runs).

Zero-variance drops are on (the default): deterministic mode keeps bit-identity with them
through the per-step spare reserves. Measured once each (2 shared CPU cores; a deterministic
run repeats itself): tiny-grpo 0.087 -> 0.369 (margin 0.282; 5 groups replaced over 30
steps, about 30 s of steps); tiny-multiturn 0.233 -> 0.464 (margin 0.231; no zero-variance
group at groupSize 8, about 85 s). A deterministic run repeats itself on one machine, not
across processors: the first five steps agree bit for bit, but the floating-point kernels
differ once training starts. On a Sapphire Rapids core (AVX-512, AMX) the same configs
measured 0.087 -> 0.336 (margin 0.249) and 0.233 -> 0.451 (margin 0.218), so the asserted
margins sit below the lowest measurement of each. These tiny
runs' margins move with incidental changes to which prompts a step trains and in what order
(tiny-multiturn measured 0.151 with the same prompts trained in slot order, and 0.235 before
the reserves changed which prompts the dataloader hands out), so a change that moves them is
a reason to look, and a lowered threshold needs its measurement.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from rolloutrun_runtime.metrics import FINAL_WEIGHTS_FILE, REQUIRED_KEYS, read_metrics
from tests.support.cli import train_command

ROOT = Path(__file__).resolve().parents[2]

MARGINS = {"tiny-grpo.yaml": 0.2, "tiny-multiturn.yaml": 0.18}


def deterministic_copy(example: Path, directory: Path) -> Path:
    """The example with deterministic mode on, written next to the run."""
    document = yaml.safe_load(example.read_text())
    run = document["spec"]["run"]
    run.setdefault("checkpointing", {})["deterministic"] = True
    path = directory / example.name
    path.write_text(yaml.safe_dump(document))
    return path


@pytest.mark.parametrize("example", sorted(MARGINS))
def test_example_learns(tmp_path: Path, example: str) -> None:
    log_dir = tmp_path / "run"
    completed = subprocess.run(
        train_command(deterministic_copy(ROOT / "examples" / example, tmp_path), log_dir),
        capture_output=True,
        text=True,
        timeout=280,
        cwd=tmp_path,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    records = read_metrics(log_dir)
    assert records, completed.stdout
    assert all(set(REQUIRED_KEYS) <= set(r) for r in records)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    assert "step    1/" in completed.stdout and "done: step" in completed.stdout
    first = sum(r["reward_mean"] for r in records[:5]) / 5
    last = sum(r["reward_mean"] for r in records[-5:]) / 5
    assert last - first >= MARGINS[example], f"first five {first:.3f}, last five {last:.3f}"
    assert len((log_dir / FINAL_WEIGHTS_FILE).read_text().strip()) == 64
    assert (log_dir / "gym-0.audit.jsonl").exists()
