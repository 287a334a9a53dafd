"""A preemption notice (SIGTERM) during the trainer's start stops it at once.

Where a pod is stopped, what its start waits for can be stopped with it: the worker pods of
its Ray cluster never join, a Gym being deleted never answers. The trainer used to watch for
the notice only once it trained, so such a start held the pod for its whole grace period
(30 s seen with worker pods) and ended in a timeout instead of exit 143. Here a turn-level
run's Gym 1 never answers: the notice, given while the trainer waits for it, cancels the
run well before ``gymUnreachableSeconds`` (which the old code waited out, then failed with
``GymOutageError``). Nothing was generated, so no snapshot is taken.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from rolloutrun_runtime.metrics import STARTUP
from rolloutrun_runtime.trainer import run_trainer
from tests.support.data_plane import TOKEN
from tests.support.elastic_gyms import ElasticGyms
from tests.support.trainer_start import marked_since, two_gym_turn_config

#: Far longer than the stop takes, far shorter than the Gym wait the old code sat out.
STOP_LIMIT_S = 20
UNREACHABLE_S = 120


async def test_a_notice_while_a_gym_does_not_answer_stops_the_start(tmp_path):
    cfg = two_gym_turn_config(tmp_path, 2, UNREACHABLE_S)
    gyms = ElasticGyms(cfg, TOKEN)
    await gyms.start()
    config = gyms.config()
    await gyms.lose(1)  # never serves again
    notice = asyncio.Event()
    started_at = time.time()
    run = asyncio.ensure_future(run_trainer(config, gym_members=gyms.endpoints, preemption=notice))
    try:
        await marked_since("workers_started", started_at)  # now waiting for Gym 1 only
        notice.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(run), STOP_LIMIT_S)
    finally:
        run.cancel()
        await gyms.stop()
    assert "gyms_answered" not in STARTUP.phases() or (
        STARTUP.phases()["gyms_answered"][0] < started_at
    )
    assert not list((tmp_path / "run" / "checkpoints").glob("rollout_snapshots/*/MANIFEST.json"))
