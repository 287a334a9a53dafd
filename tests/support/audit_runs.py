"""A run's durable state as the audit reads it, written for the audit's tests: the prompt
permutations of a tiny dataset and one committed trainer-checkpoint entry with its Gym audit
file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def write_stored_run(storage: Any, scratch: Path) -> None:
    """The run of :func:`write_run` as a cluster trainer leaves it: everything in the run's
    storage (``storage``, any backend) and nothing in a log directory: the checkpoint, the
    Gym audit file under ``gym-audit/`` (file:// Gym pods write it there), the RunConfig the
    trainer kept, and the trace of two incarnations (one stop, one attempt thrown away)."""
    from rolloutrun_runtime.run_logs import LogShipper, write_config

    write_run(scratch, trained_prompts=perm(0)[:4], position=4)
    source = open_storage("file://" + str(scratch / "checkpoints"))
    for key in source.list():
        storage.write_bytes(key, source.read_bytes(key))
    audit_file = (scratch / "gym-0.audit.jsonl").read_bytes()
    storage.write_bytes(f"{layout.GYM_AUDIT_PREFIX}/gym-0.audit.jsonl", audit_file)
    write_config(
        storage,
        layout.log_segment(0, 1_000, "a0"),
        {"seed": SEED, "task": {"datasetSize": SIZE}, "grpo": {"maxSteps": 1}},
    )
    for incarnation, events in enumerate(TRACE):
        run_id = f"r{incarnation}"
        trace = scratch / f"trace-{incarnation}.jsonl"
        trace.write_text("")
        segment = layout.log_segment(incarnation, 1_000 + incarnation, run_id)
        shipper = LogShipper(storage, layout.TRACE_LOG, trace, segment)
        with trace.open("a") as handle:
            for event in events:
                handle.write(json.dumps({"run_id": run_id, **event}) + "\n")
        shipper.ship()


#: Two incarnations' trace events: attempt ``u1`` dispatched at t=10, the restore's cut at
#: t=12, the attempt abandoned on restart: 2 s thrown away.
TRACE: list[list[dict[str, object]]] = [
    [
        {"t": 1.0, "event": "run_started", "snapshot_id": None, "cut_time": None},
        {"t": 10.0, "event": "attempt_dispatched", "attempt_uuid": "u1", "prompt_id": 0},
    ],
    [
        {"t": 20.0, "event": "run_started", "snapshot_id": 1, "cut_time": 12.0},
        {"t": 20.5, "event": "attempt_abandoned", "attempt_uuid": "u1", "reason": "restart"},
    ],
]
