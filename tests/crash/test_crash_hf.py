"""A deterministic run of a Hugging Face model, SIGKILLed at a named site and resumed, ends
with the weights of an uninterrupted run, bit for bit (as test_crash_runs.py proves for the
built-in model): the HF engine's batch-invariant decode, its refits and the trainer's
checkpoints of the wrapped model replay exactly."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from rolloutrun_runtime.chaos import run_chaos
from rolloutrun_runtime.policy.make_tiny_hf import write_model

from .conftest import INCARNATION_TIMEOUT_S, SINGLE_TURN, write_config


@pytest.mark.chaos
@pytest.mark.parametrize("site", ["inside_optimizer_commit:5"])
def test_deterministic_hf_run_killed_ends_bit_identical(site: str, tmp_path: Path) -> None:
    write_model(tmp_path / "model", "qwen2", seed=0)
    config = write_config(
        tmp_path / "hf.yaml",
        SINGLE_TURN,
        policy={"model": str(tmp_path / "model"), "maxSeqLen": 32},
        grpo={"learningRate": 0.01},
    )
    config_data = json.dumps(config.read_text())
    result = run_chaos(
        config,
        tmp_path / "run",
        incarnation_timeout_s=INCARNATION_TIMEOUT_S * 2,
        kills=1,
        site=site,
        compare=True,
        seed=1,
    )
    detail = json.dumps(result.to_json(), indent=1)[:4000] + config_data
    assert result.exit_codes == [-signal.SIGKILL, 0], detail
    assert (result.kills[0].how, result.kills[0].site) == ("site", site.split(":")[0]), detail
    assert result.kills[0].restored_from is not None, detail
    assert result.audit.get("ok") is True, detail
    assert result.weights_match is True, detail
