"""The trainer plans its restore, builds its model and starts its generation workers while
its Gyms do not answer yet (issue 14: start-up that does not dominate recovery).

A turn-level run whose Gym 1 is not serving when the trainer starts (its pod still
starting): the trainer needs Gym 1's instance id for its environment checkpoint and waits
for it. Gym 1 comes up only once the trainer has started its generation workers
(``STARTUP``'s ``workers_started``). Before, the trainer waited for its Gyms first: its
workers never started, Gym 1 never came up, and the run failed when
``gymUnreachableSeconds`` ran out. Where pods start together, that wait and the trainer's
own start (a Ray cluster's, seconds) now overlap.
"""

from __future__ import annotations

import asyncio
import time

from rolloutrun_runtime.metrics import STARTUP
from rolloutrun_runtime.trainer import run_trainer
from tests.support.data_plane import TOKEN
from tests.support.elastic_gyms import ElasticGyms
from tests.support.trainer_start import marked_since, two_gym_turn_config

#: Generous bound on a whole tiny run: a deadlock fails the test instead of hanging it.
RUN_LIMIT_S = 120
MAX_STEPS = 2


async def test_the_workers_start_while_a_gym_does_not_answer_yet(tmp_path):
    cfg = two_gym_turn_config(tmp_path, MAX_STEPS, unreachable_s=30)
    gyms = ElasticGyms(cfg, TOKEN)
    await gyms.start()
    config = gyms.config()
    await gyms.lose(1)  # not serving yet when the trainer starts
    started_at = time.time()

    async def gym_1_up_once_the_workers_started() -> None:
        await marked_since("workers_started", started_at)
        await gyms.come_back(1)

    gym_1 = asyncio.create_task(gym_1_up_once_the_workers_started())
    try:
        run = run_trainer(config, gym_members=gyms.endpoints)
        result = await asyncio.wait_for(run, RUN_LIMIT_S)
        await gym_1
    finally:
        gym_1.cancel()
        await gyms.stop()

    assert [r["step"] for r in result.history] == list(range(1, MAX_STEPS + 1))
    phases = STARTUP.phases()
    assert started_at < phases["workers_started"][0] < phases["gyms_answered"][0]
