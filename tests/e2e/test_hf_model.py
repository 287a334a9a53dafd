"""A Hugging Face model through the operator: the tiny Llama-style model of ``make_tiny_hf``
trains in pods, its trainer pod is deleted (a preemption), the next incarnation resumes from
the snapshot, the run ends at maxSteps with a clean audit and the final weights exported in
the Hugging Face layout to the run's storage.

The model lives under the checkout's ``.rolloutrun/`` (ignored by git): pods have a private
``/tmp`` but see the rest of the machine, as a user's model directory would be seen. Chaos-
marked: a few minutes on 2 shared cores (the fast tests of the path are in
tests/runtime/policy/test_hf_policy.py).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from rolloutrun_runtime.contract.layout import FINAL_MODEL_DIR
from rolloutrun_runtime.policy.make_tiny_hf import write_model

from .conftest import assert_recovered_cleanly, finish, tiny, wait_for_snapshot

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_dir() -> Iterator[Path]:
    directory = ROOT / ".rolloutrun" / "test-models" / uuid.uuid4().hex[:12]
    write_model(directory, "llama", seed=0)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.chaos
def test_an_hf_model_run_survives_a_deleted_trainer_and_exports(start_run, model_dir: Path):
    document = tiny()
    document["spec"]["run"]["policy"] = {"model": str(model_dir), "maxSeqLen": 32}
    run = start_run(document)
    wait_for_snapshot(run)
    run.delete_pod("tiny-i1-trainer")
    summary = finish(run)
    assert_recovered_cleanly(run, summary)
    assert summary["preemptions"] >= 1
    exported = run.storage_dir / FINAL_MODEL_DIR
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in exported.iterdir()
    }
