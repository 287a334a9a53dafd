"""CUDA smoke test: train a few GRPO steps of a small Hugging Face model on a GPU.

    python -m bench.cuda_smoke [--model DIR] [--steps N] [--log-dir DIR]

Why a script and not a test: the project builds and passes its tests without a GPU (CI has
none); this is what an operator runs on a GPU machine to see the HF path work there: the
policy on ``cuda`` in bfloat16 (``dtype: auto``), the continuous-batching engine decoding
on the GPU, refits, trainer checkpoints, the final model exported in the HF layout.
Without ``--model`` it writes the tiny Llama-style model of ``make_tiny_hf`` (offline).
Without CUDA it says so and exits 0. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml


def smoke_config(model: str, steps: int) -> dict[str, Any]:
    """A bare RunConfig: the arithmetic task on the GPU, checkpoints every two steps."""
    return {
        "seed": 1,
        "policy": {"model": model, "device": "cuda", "dtype": "auto", "maxSeqLen": 32},
        "task": {"name": "arithmetic", "datasetSize": 64, "maxOperand": 9, "maxNewTokens": 4},
        "grpo": {"groupSize": 8, "promptsPerStep": 8, "maxSteps": steps, "learningRate": 0.01},
        "checkpointing": {"savePeriod": 2, "snapshotIntervalSeconds": 5},
        "gym": {"replicas": 1},
        "workers": {"backend": "inprocess"},
    }


def run_smoke(model: str | None, steps: int, log_dir: Path, tmp: Path) -> dict[str, Any]:
    """Train ``steps`` steps with ``rolloutrun train``; what came out of it."""
    import torch

    if model is None:
        from rolloutrun_runtime.policy.make_tiny_hf import write_model

        write_model(tmp / "model", "llama", seed=0)
        model = str(tmp / "model")
    config = tmp / "cuda-smoke.yaml"
    config.write_text(yaml.safe_dump(smoke_config(model, steps)))
    command = [sys.executable, "-m", "rolloutrun_runtime.cli", "train", str(config)]
    completed = subprocess.run([*command, "--log-dir", str(log_dir)], check=False)
    metrics = log_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    records = [json.loads(line) for line in lines]
    exported = (log_dir / "checkpoints" / "final_model" / "model.safetensors").exists()
    ok = completed.returncode == 0 and len(records) == steps and exported
    return {
        "cuda_smoke": "ok" if ok else "FAILED",
        "device": torch.cuda.get_device_name(0),
        "steps": len(records),
        "rewards": [round(r["reward_mean"], 3) for r in records],
        "generation_tokens_per_s": [round(r.get("tokens_per_s", 0.0), 1) for r in records],
        "exported": exported,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face model directory")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--log-dir", default=None)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("cuda_smoke: SKIPPED: no CUDA device here (torch.cuda.is_available() is false)")
        return 0
    with tempfile.TemporaryDirectory(prefix="rolloutrun-cuda-smoke-") as scratch:
        tmp = Path(scratch)
        log_dir = Path(args.log_dir) if args.log_dir else tmp / "run"
        report = run_smoke(args.model, args.steps, log_dir, tmp)
    print(json.dumps(report))
    return 0 if report["cuda_smoke"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
