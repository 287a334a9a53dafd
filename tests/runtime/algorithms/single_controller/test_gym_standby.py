"""Warm standby Gym replicas (``gym.standby``), the trainer's half: a standby takes no new
episode while the active replicas are up, takes a lost one's share at once, and gives it
back when the replacement is re-admitted.

The dispatch decision is the pure :func:`pick_replica`, tested alone; then a real run with
real in-process Gym servers (two active, one standby) where an active one is lost: the
standby served no ``/run`` before the loss and served after it, and the run ends on one
trainer with no failed sample (the replacement harness of ``test_gym_replacement``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.gym_replicas import GymReplica, pick_replica
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import read_events
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.contract.run_config import RunConfig
from tests.runtime.algorithms.single_controller.test_gym_replacement import _Gyms, _run
from tests.support.run_configs import tiny_config


def _replicas(count: int) -> list[GymReplica]:
    return [GymReplica(f"http://g{i}", f"gym-{i}") for i in range(count)]


def _rotation(replicas: list[GymReplica], down: set[int], active: int | None, turns: int) -> list:
    urls = {f"http://g{i}" for i in down}
    return [pick_replica(replicas, t, urls.__contains__, active) for t in range(turns)]


def test_a_standby_takes_no_episode_while_the_active_replicas_are_up():
    assert _rotation(_replicas(3), set(), active=2, turns=4) == [0, 1, 0, 1]


def test_a_standby_takes_a_lost_replicas_share_and_gives_it_back():
    replicas = _replicas(3)
    assert _rotation(replicas, {1}, active=2, turns=4) == [0, 2, 0, 2]
    assert _rotation(replicas, {0}, active=2, turns=4) == [1, 2, 1, 2]
    assert _rotation(replicas, set(), active=2, turns=2) == [0, 1]  # re-admitted: back


def test_standbys_stand_in_one_for_one_in_index_order():
    replicas = _replicas(5)  # 2 active, 3 standbys
    assert _rotation(replicas, {0}, active=2, turns=4) == [1, 2, 1, 2]
    assert _rotation(replicas, {0, 1}, active=2, turns=4) == [2, 3, 2, 3]
    assert _rotation(replicas, {0, 2}, active=2, turns=4) == [1, 3, 1, 3]  # 2 lost too
    assert _rotation(replicas, {1, 3}, active=2, turns=2) == [0, 2]  # a lost standby: none


def test_without_a_standby_up_the_survivors_carry_the_share():
    replicas = _replicas(3)
    assert _rotation(replicas, {1, 2}, active=2, turns=3) == [0, 0, 0]
    assert _rotation(replicas, {0, 1}, active=2, turns=3) == [2, 2, 2]  # only the standby


def test_everyone_down_or_no_standbys_as_before():
    replicas = _replicas(3)
    assert _rotation(replicas, {0, 1, 2}, active=2, turns=3) == [0, 1, 2]
    assert _rotation(replicas, {1}, active=None, turns=4) == [0, 2, 0, 2]
    assert _rotation(replicas, set(), active=3, turns=3) == [0, 1, 2]
    assert _rotation(replicas, set(), active=7, turns=3) == [0, 1, 2]  # more than there are


def _config(tmp_path: Any) -> RunConfig:
    return tiny_config(
        tmp_path,
        seed=11,
        grpo={"maxSteps": 6, "maxStaleness": 1},
        rollout={"maxAttempts": 3, "gymUnreachableSeconds": 30},
        checkpointing={"snapshotIntervalSeconds": 0},
        gym={"replicas": 2, "standby": 1},
    )


@pytest.mark.timeout(240)
async def test_a_standby_serves_only_after_an_active_replica_is_lost(tmp_path):
    gyms = _Gyms(_config(tmp_path))
    await gyms.start()
    assert len(gyms.urls) == 3  # two active, one standby
    lost_at: list[float] = []
    replaced: list[asyncio.Task[None]] = []

    def lose_gym_1_after_step_2(record: dict[str, Any]) -> None:
        if record["step"] == 2 and not lost_at:
            lost_at.append(time.monotonic())
            loop = asyncio.get_running_loop()
            replaced.append(loop.create_task(gyms.replace(1, outage_s=2.0)))

    try:
        await _run(gyms, on_step=lose_gym_1_after_step_2)
        await asyncio.gather(*replaced)
    finally:
        await gyms.stop()

    assert lost_at, "the loss never happened"
    before = [index for at, index, _ in gyms.runs_at if at < lost_at[0]]
    after = [index for at, index, _ in gyms.runs_at if at >= lost_at[0]]
    assert before and 2 not in before, "the standby served before any loss"
    assert set(before) == {0, 1}
    assert 2 in after, "the standby never took the lost replica's share"
    events = list(read_events(tmp_path / "run" / TRACE_FILE))
    assert not [e for e in events if e["event"] == "attempt_failed"]  # never a failed sample
    assert not [e for e in events if e["event"] == "group_dropped" and "exhausted" in e["reason"]]
