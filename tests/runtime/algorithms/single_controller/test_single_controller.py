"""The pumps' interplay with the real in-process backend: staleness bound, no group trained
twice, a step never closed over no groups, replay capacity never deadlocking, dispatch without the
ledger, trainer checkpoints and resume."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.restore import RestoreError
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import (
    batch_age_by_step,
    read_events,
)
from rolloutrun_runtime.algorithms.single_controller import LEDGER_FILE, ControllerError, OnStep
from rolloutrun_runtime.algorithms.trainer_checkpoint import (
    CheckpointIntegrityError,
    TrainerCheckpointer,
)
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.experience.rollout_recovery import GroupStatus, read_recovery_sidecar
from rolloutrun_runtime.metrics import REQUIRED_KEYS, read_metrics
from rolloutrun_runtime.storage import open_storage
from rolloutrun_runtime.trainer import run_trainer
from tests.support.run_configs import tiny_config

#: Generous bound on a whole tiny run: a deadlock fails the test instead of hanging it.
RUN_LIMIT_S = 150


async def _run(cfg, on_step=None, **kwargs):
    hooks = OnStep(on_step) if on_step is not None else None
    return await asyncio.wait_for(run_trainer(cfg, hooks=hooks, **kwargs), RUN_LIMIT_S)


@pytest.mark.parametrize("staleness", [0, 2])
async def test_staleness_bound_and_each_group_trained_once(tmp_path, gym_endpoints, staleness):
    cfg = await gym_endpoints(tiny_config(tmp_path, grpo={"maxStaleness": staleness}))
    controllers = []
    result = await _run(cfg, on_step=lambda record: controllers.append(record))
    history = result.history
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    for record in history:
        assert record["groups"] + record["shortfall"] == cfg.grpo.prompts_per_step
        assert 0.0 <= record["batch_age"] <= staleness
        assert record["max_token_age"] <= staleness
    if staleness == 0:
        assert all(r["batch_age"] == 0.0 for r in history)
    prompt_counts = Counter(result.trained_prompt_ids)
    assert prompt_counts and max(prompt_counts.values()) == 1
    lines = read_metrics(cfg.log_dir)
    assert len(lines) == 4 and all(set(REQUIRED_KEYS) <= set(line) for line in lines)
    digest = (tmp_path / "run" / "final_weights.sha256").read_text().strip()
    assert digest == result.final_weights_sha256 and len(digest) == 64


async def test_controller_state_is_consistent_after_a_run(tmp_path, gym_endpoints):
    from rolloutrun_runtime.algorithms.single_controller import SingleController
    from rolloutrun_runtime.policy.model import build_model
    from rolloutrun_runtime.policy.tokenizer import TOKENIZER
    from rolloutrun_runtime.workers import build_workers

    cfg = await gym_endpoints(tiny_config(tmp_path, grpo={"maxSteps": 3, "maxStaleness": 1}))
    model = build_model(cfg.policy, TOKENIZER.vocab_size, cfg.seed)
    import torch

    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.grpo.learning_rate)
    workers = build_workers(cfg, model.state_dict(), 0)
    await workers.start()
    try:
        controller = SingleController(
            cfg, model=model, optimizer=optimizer, workers=workers, gym_endpoints=cfg.gym.endpoints
        )
        await asyncio.wait_for(controller.run(), RUN_LIMIT_S)
    finally:
        await workers.stop()
    assert controller.trainer_version == 3
    assert len(set(controller.groups_trained)) == len(controller.groups_trained)
    ledger = controller.ledger
    assert ledger is not None
    trained = set(controller.groups_trained)
    assert not trained & {g.group_id for g in ledger.groups()}
    assert not ledger.with_status(GroupStatus.CLAIMED, GroupStatus.FINALIZING)
    # Every replay group is finalized in the ledger and has its rows; nothing else is there.
    replay = {g.group_id for g in controller.buffer.groups()}
    assert replay == {g.group_id for g in ledger.with_status(GroupStatus.FINALIZED)}
    expected_rows = sorted(k for g in controller.buffer.groups() for k in g.row_keys)
    assert controller.data_plane.list("train") == expected_rows
    parts = controller.rollout_parts()
    assert parts.runtime_state is controller.runtime_state
    assert parts.read_progress().trainer_version == 3
    assert not parts.read_progress().optimizer_commit_in_progress


async def test_replay_capacity_of_one_step_never_deadlocks(tmp_path, gym_endpoints):
    cfg = await gym_endpoints(
        tiny_config(
            tmp_path,
            grpo={"maxStaleness": 3, "maxSteps": 4},
            rollout={"replayCapacity": 3, "maxInFlightGroups": 1},
        )
    )
    result = await _run(cfg)
    assert result.steps == 4
    assert max(r["replay_groups"] for r in result.history) <= 3


async def test_a_step_whose_groups_all_failed_stops_the_run_unrecorded(tmp_path, gym_endpoints):
    cfg = tiny_config(
        tmp_path,
        grpo={"maxSteps": 2, "promptsPerStep": 2, "groupSize": 2},
        rollout={"rolloutTimeoutSeconds": 1, "maxAttempts": 1},
        gym={"replicas": 1},
    )
    slow = cfg.model_copy(update={"task": cfg.task.model_copy(update={"turn_delay_ms": 3000})})
    cfg = await gym_endpoints(cfg, configs=[slow])
    # Every episode runs past the timeout (a failed sample): groups are replaced, then given
    # up, and the step is never closed over nothing as reward 0 / loss 0.
    with pytest.raises(ControllerError, match="step 1 has no group to train: all 2 were given up"):
        await _run(cfg)
    assert read_metrics(cfg.log_dir) == []


async def test_dispatch_without_the_ledger_takes_no_reservation_slots(tmp_path, gym_endpoints):
    from rolloutrun_runtime.algorithms.single_controller import SingleController

    cfg = await gym_endpoints(
        tiny_config(
            tmp_path,
            grpo={"maxSteps": 2},
            rollout={"ledgerDispatch": False},
            checkpointing={"targetLevel": "none"},
        )
    )
    assert not cfg.uses_ledger
    seen = []
    result = await _run(cfg, on_step=seen.append)
    assert result.steps == 2
    waits = seen[-1]["barrier_waits"]
    assert "prompt_reservations" not in waits and "rollout_dispatch" not in waits
    assert "group_commits" in waits and "sample_clears" in waits
    assert SingleController  # the same controller class runs both modes


class _Crash(Exception):
    pass


async def test_trainer_checkpoints_retention_and_resume(tmp_path, gym_endpoints):
    cfg = await gym_endpoints(
        tiny_config(
            tmp_path,
            grpo={"maxSteps": 7, "maxStaleness": 1},
            # trainer checkpoints alone (snapshots would be preferred at equal steps)
            checkpointing={"savePeriod": 2, "keepLatest": 2, "snapshotIntervalSeconds": 0},
        )
    )
    trained: list[int] = []

    trained_groups = []

    def crash_after_step_5(record):
        trained_groups.append(record["groups"])
        if record["step"] == 5:
            raise _Crash("simulated crash: step 5 committed, never checkpointed")
        trained.extend(record["prompt_ids"])

    with pytest.raises(_Crash):
        await _run(cfg, on_step=crash_after_step_5)
    checkpointer = TrainerCheckpointer(open_storage(cfg.resolved_storage_uri()), keep_latest=2)
    assert checkpointer.committed_steps() == [2, 4]
    loaded = checkpointer.load(4, extra_names=(LEDGER_FILE,))
    assert loaded.trainer_state["trainer_version"] == 4
    assert loaded.trainer_state["dataloader"]["position"] > 0
    recovered = read_recovery_sidecar(
        loaded.files[LEDGER_FILE],
        expected_sha256=loaded.trainer_state["rollout_recovery"]["rollout_recovery_sha256"],
    )
    # Step 5 was admitted (staleness 1) before step 4 committed: its groups were in flight or
    # finalized at the checkpoint, and the resumed run must train exactly those prompts.
    pending = {g.prompt.prompt_id for g in recovered.ledger.groups() if g.target_step == 5}
    assert len(pending) == cfg.grpo.prompts_per_step

    second = await _run(cfg)
    assert second.resumed_from is not None and second.resumed_from.endswith("step_4")
    assert [r["step"] for r in second.history] == [5, 6, 7]
    assert checkpointer.committed_steps() == [6, 7]  # the run ends with a checkpoint
    step5 = second.history[0]
    assert step5["replacements"] or pending == set(step5["prompt_ids"]), (
        "an in-flight prompt was lost"
    )
    both = Counter(trained + second.trained_prompt_ids)
    assert max(both.values()) == 1, "a prompt was trained twice across the resume"
    steps = [json.loads(line)["step"] for line in (tmp_path / "run/metrics.jsonl").open()]
    assert steps == [1, 2, 3, 4, 5, 5, 6, 7]
    events = list(read_events(tmp_path / "run" / TRACE_FILE))
    runs = [e["run_id"] for e in events if e["event"] == "run_started"]
    assert len(runs) == 2
    trained_events = [e for e in events if e["event"] == "group_trained"]
    trained_groups.extend(r["groups"] for r in second.history)
    assert len(trained_events) == sum(trained_groups)
    assert batch_age_by_step(e for e in events if e["run_id"] == runs[1]).keys() == {5, 6, 7}


async def test_deferred_finalize_publishes_at_the_next_step_boundary(tmp_path, gym_endpoints):
    cfg = await gym_endpoints(
        tiny_config(
            tmp_path,
            grpo={"maxSteps": 3},
            checkpointing={"savePeriod": 2, "deferFinalize": True},
        )
    )
    result = await _run(cfg)
    assert result.steps == 3
    checkpointer = TrainerCheckpointer(open_storage(cfg.resolved_storage_uri()), keep_latest=3)
    assert checkpointer.committed_steps() == [2, 3]  # step 2 deferred, then the final one


async def test_a_corrupt_ledger_sidecar_refuses_the_resume(tmp_path, gym_endpoints):
    cfg = await gym_endpoints(
        tiny_config(
            tmp_path,
            grpo={"maxSteps": 2},
            checkpointing={"savePeriod": 2, "snapshotIntervalSeconds": 0},
        )
    )
    await _run(cfg)
    storage = open_storage(cfg.resolved_storage_uri())
    key = f"step_2/{LEDGER_FILE}"
    data = bytearray(storage.read_bytes(key))
    data[-2] ^= 1
    storage.write_bytes(key, bytes(data))
    longer = cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"max_steps": 3})})
    with pytest.raises(RestoreError, match="sha256") as refused:
        await _run(longer)
    # The marker's checksum refuses the changed file before the sidecar's own check reads it.
    assert isinstance(refused.value.__cause__, CheckpointIntegrityError)
    assert LEDGER_FILE in str(refused.value)
