"""A Gym lost while the trainer starts is replaced, not the run (issue 14).

A real trainer over two in-process Gym replicas, Gym 1's pod lost before the trainer opens
its Gym client (its address refuses connections); after the first step trained on the
survivor alone, Gym 1's replacement (the next member generation, a new address, announced
as the operator announces it) starts serving. The run finishes on this one trainer and the
durable-state audit is clean. Before, the client's open raised at Gym 1 ("is unhealthy:
Connect call failed"), the trainer ended, and the operator counted a restart.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import read_events
from rolloutrun_runtime.algorithms.single_controller import OnStep
from rolloutrun_runtime.audit import audit, load_durable_state
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.trainer import run_trainer
from tests.support.data_plane import TOKEN
from tests.support.elastic_gyms import ElasticGyms
from tests.support.run_configs import tiny_config

#: Generous bound on a whole tiny run: a deadlock fails the test instead of hanging it.
RUN_LIMIT_S = 150
MAX_STEPS = 3


async def test_a_gym_lost_before_the_trainer_opens_is_replaced_and_the_run_finishes(tmp_path):
    cfg = tiny_config(
        tmp_path,
        seed=7,
        grpo={"maxSteps": MAX_STEPS},
        rollout={"maxAttempts": 3, "gymUnreachableSeconds": 60},
        gym={"replicas": 2},
        checkpointing={"snapshotIntervalSeconds": 0},
    )
    gyms = ElasticGyms(cfg, TOKEN)
    await gyms.start()
    config = gyms.config()  # names Gym 1's first address, lost below
    await gyms.lose(1)
    back: list[asyncio.Task[None]] = []

    def gym_1_comes_back_after_step_1(record: dict[str, Any]) -> None:
        if not back:
            back.append(asyncio.get_running_loop().create_task(gyms.come_back(1)))

    try:
        run = run_trainer(
            config, hooks=OnStep(gym_1_comes_back_after_step_1), gym_members=gyms.endpoints
        )
        result = await asyncio.wait_for(run, RUN_LIMIT_S)
        await asyncio.gather(*back)
    finally:
        await gyms.stop()

    assert back, "no step was trained on the survivor"
    assert [r["step"] for r in result.history] == list(range(1, MAX_STEPS + 1))
    assert gyms.runs.get((0, 0), 0) > 0 and gyms.runs.get((1, 0), 0) == 0
    events = list(read_events(Path(cfg.log_dir) / TRACE_FILE))
    assert not [e for e in events if e["event"] == "attempt_failed"]  # never a failed sample
    state = load_durable_state(Path(cfg.log_dir), seed=cfg.seed, max_steps=MAX_STEPS)
    report = audit(state)
    assert report.ok, report
    assert (report.prompts.lost, report.prompts.duplicated) == (0, 0)
