"""A step trained after a restore reports the metrics of the uninterrupted run.

``reward_mean`` covers every rollout generated for a step, groups dropped for zero variance
included. It used to be counted in memory as each Gym call returned, so a step trained
after a restore counted only the rollouts that finished after the restore: the same loss,
another ``reward_mean``. The rewards are now recorded per step when a group is finalized or
dropped, inside the mutation that does it, and saved with the rollout state. A preemption
snapshot taken right after the first group of a step finalized splits its rollouts between
the two incarnations.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.single_controller.rollout_pump import RolloutPump
from rolloutrun_runtime.metrics import read_metrics
from rolloutrun_runtime.trainer import run_trainer
from tests.support.run_configs import tiny_config

#: Generous bound on a whole tiny run: a deadlock fails the test instead of hanging it.
RUN_LIMIT_S = 150
#: What a retrained step must report exactly as the reference does.
SAME_AS_REFERENCE = ("prompt_ids", "groups", "shortfall", "replacements", "loss")
SAME_REWARDS = ("reward_mean", "trained_reward_mean", "rollouts")


#: The step whose rollouts a preemption snapshot splits.
PREEMPTED_STEP = 5


def _config(tmp_path: Any) -> Any:
    # Rollouts slow enough (a simulated tool latency) that a step's groups finish apart.
    return tiny_config(
        tmp_path,
        seed=11,
        task={"turnDelayMs": 150},
        grpo={"maxSteps": 6, "maxStaleness": 1},
        checkpointing={
            "deterministic": True,
            "savePeriod": 3,
            "keepLatest": 3,
            "snapshotIntervalSeconds": 0,
        },
    )


async def _run(cfg: Any, **kwargs: Any) -> Any:
    return await asyncio.wait_for(run_trainer(cfg, **kwargs), RUN_LIMIT_S)


async def test_a_step_trained_after_a_restore_reports_the_reference_metrics(
    tmp_path, gym_endpoints, monkeypatch
):
    reference_cfg = await gym_endpoints(_config(tmp_path / "reference"))
    reference = await _run(reference_cfg)
    expected = {r["step"]: r for r in reference.history}

    # Preempt (forced snapshot, then stop) right after the first group of step 5 finalizes,
    # holding back every later finalization until the stop: the snapshot holds some of step
    # 5's rollouts, the resumed run generates the rest.
    preemption = asyncio.Event()
    finalize = RolloutPump._finalize_group
    finalized: list[int] = []

    async def finalize_then_preempt(self: RolloutPump, run: Any) -> None:
        if preemption.is_set():
            await asyncio.Event().wait()  # until the preemption cancels the run
        await finalize(self, run)
        finalized.append(run.target_step)
        if run.target_step == PREEMPTED_STEP:
            preemption.set()

    cfg = await gym_endpoints(_config(tmp_path / "preempted"))
    monkeypatch.setattr(RolloutPump, "_finalize_group", finalize_then_preempt)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(_run(cfg, preemption=preemption))
    monkeypatch.undo()
    assert finalized.count(PREEMPTED_STEP) == 1
    first = read_metrics(cfg.log_dir)
    assert [row["step"] for row in first] == list(range(1, PREEMPTED_STEP))

    resumed = await _run(cfg)
    assert resumed.resumed_from is not None and "rollout_snapshots" in resumed.resumed_from
    assert resumed.final_weights_sha256 == reference.final_weights_sha256
    rows = read_metrics(cfg.log_dir)
    assert [row["step"] for row in rows] == sorted(expected)
    for row in rows:
        want = expected[row["step"]]
        for key in SAME_AS_REFERENCE + SAME_REWARDS:
            assert row[key] == want[key], f"step {row['step']}: {key}"
