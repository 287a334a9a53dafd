"""A run's durable state as the audit reads it, written for the audit's tests: the prompt
permutations of a tiny dataset and one committed trainer-checkpoint entry with its Gym audit
file."""

from __future__ import annotations

import json
from pathlib import Path

from rolloutrun_runtime import audit as A
from rolloutrun_runtime.contract import layout
from rolloutrun_runtime.data_plane import DataPlane
from rolloutrun_runtime.storage import open_storage, publish_entry

DATA_PLANE_METADATA = layout.DATA_PLANE_PREFIX + layout.DATA_PLANE_METADATA_FILE
SIZE = 6
SEED = 11


def perm(epoch: int) -> list[int]:
    return A.permutations_for(SEED, SIZE, 1)[epoch]


def write_run(run_dir: Path, *, trained_prompts: list[int], position: int) -> None:
    storage = open_storage("file://" + str(run_dir / "checkpoints"))
    journal = {
        "schema": 1,
        "steps": [
            {
                "step": 1,
                "weight_version_before": 0,
                "groups": [
                    {"group_id": f"pg{i}", "prompt_id": pid, "epoch": 0, "target_step": 1}
                    for i, pid in enumerate(trained_prompts)
                ],
            }
        ],
    }
    sidecar = json.dumps(
        {
            "schema_version": 5,
            "groups": [],
            "batch_shortfall": {},
            "sampler_stamps_target_steps": True,
            "spare_prompts": [],
        }
    ).encode()
    state = {
        "format": 1,
        "step": 1,
        "dataloader": {"dataset_size": SIZE, "epoch": 0, "position": position},
        "replay": [],
    }
    files = {
        layout.TRAINER_STATE_FILE: json.dumps(state).encode(),
        layout.JOURNAL_FILE: json.dumps(journal).encode(),
        layout.LEDGER_FILE: sidecar,
        DATA_PLANE_METADATA: DataPlane().to_files({"replay": []})["metadata.json"],
    }
    publish_entry(storage, "step_1", files)
    (run_dir / "gym-0.audit.jsonl").write_text(
        json.dumps({"rollout_id": "pg0_g0_aA", "attempt": 0, "revision": 1, "turn": 0}) + "\n"
    )
