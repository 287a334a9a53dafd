"""A replaced Gym is re-admitted: once its replacement answers ``/healthz``, it gets work.

A real trainer over two in-process Gym replicas; after the first step, replica 1's server is
stopped and its replacement (the next member generation, a new address) starts. The
survivor alone could carry the run, so the only way the replacement ever serves a ``/run``
is the trainer's re-admission (a lost replica leaves the rotation until its ``/healthz``
answers as the same instance). The run is preempted once the replacement served: a few
seconds. Without re-admission the replacement never serves and the wait below fails.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.single_controller import OnStep
from rolloutrun_runtime.trainer import run_trainer
from tests.support.data_plane import TOKEN
from tests.support.elastic_gyms import ElasticGyms
from tests.support.run_configs import tiny_config

#: Bounds that only catch a hang (a replacement never re-admitted), never timed.
SERVED_BOUND_S = 120
RUN_LIMIT_S = 120


async def test_a_replaced_gym_gets_work_once_it_is_healthy(tmp_path):
    cfg = tiny_config(
        tmp_path,
        seed=3,
        grpo={"maxSteps": 100_000},
        rollout={"gymUnreachableSeconds": 60},
        checkpointing={"snapshotIntervalSeconds": 0},
    )
    gyms = ElasticGyms(cfg, TOKEN)
    await gyms.start()
    replaced: list[asyncio.Task[None]] = []

    def replace_gym_1_after_step_1(record: dict[str, Any]) -> None:
        if not replaced:
            replaced.append(asyncio.get_running_loop().create_task(gyms.replace(1)))

    preemption = asyncio.Event()
    run = asyncio.ensure_future(
        run_trainer(
            gyms.config(),
            hooks=OnStep(replace_gym_1_after_step_1),
            preemption=preemption,
            gym_members=gyms.endpoints,
        )
    )
    try:
        served = asyncio.ensure_future(gyms.replacement_served.wait())
        await asyncio.wait({served, run}, timeout=SERVED_BOUND_S, return_when="FIRST_COMPLETED")
        assert served.done(), "the replacement of Gym 1 never got a /run: not re-admitted"
        preemption.set()  # the run stops as a preempted trainer does: its task cancelled
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(run, RUN_LIMIT_S)
        await asyncio.gather(*replaced)
    finally:
        if not run.done():
            run.cancel()
        await gyms.stop()
    assert gyms.runs[(1, 1)] > 0 and gyms.runs[(0, 0)] > 0
