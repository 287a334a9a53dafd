"""A snapshot's commit, cut and write wait for the trainer's in-process engines to rest.

Why: an in-process engine decodes on the trainer's own event loop (each decode step is a turn
of it) and needs the interpreter lock for Python's share of its tensor work, so whatever a
snapshot does on the loop or in its writer thread while calls decode delays every one of them
(measured: each rollout dispatched after a snapshotted step took ~4 ms longer). Between calls
the same work costs the rollouts nothing. The wait sits between the environment's prepare and
its commit: the prepare answers as the last episode leaves its copy at a turn boundary, when
the episodes call the model together, and a commit then (the Gym encodes the copies, the
trainer decodes them) lands in that burst of calls.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import RolloutSnapshotter
from rolloutrun_runtime.environments.checkpointing.nemo_gym import GymEnvironmentCheckpoint
from rolloutrun_runtime.workers import SharesTrainerLoop
from rolloutrun_runtime.workers.inprocess import InProcessWorkers
from tests.support.rollout_checkpoints import (
    harness,
    run_to_end,
    snapshot_after_commits,
    tiny_config,
)


@pytest.mark.parametrize("deterministic", [False, True])
async def test_periodic_snapshots_wait_for_the_engines_forced_ones_do_not(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, deterministic: bool
) -> None:
    waits: list[tuple[float, float, bool, bool]] = []
    calls: list[str] = []  # the environment phase's calls and the waits, in order
    wait = InProcessWorkers.until_idle

    async def recorded(self: InProcessWorkers, timeout_s: float, quiet_s: float = 0.0) -> bool:
        idle = await wait(self, timeout_s, quiet_s)
        none_decoding = all(engine.running == 0 for engine in self.engines)
        waits.append((timeout_s, quiet_s, idle, none_decoding))
        calls.append("wait")
        return idle

    monkeypatch.setattr(InProcessWorkers, "until_idle", recorded)
    for name in ("prepare", "commit"):
        monkeypatch.setattr(GymEnvironmentCheckpoint, name, _logged(name, calls))
    cancelled: list[str] = []  # attempts the run's end cancelled: they record nothing
    attempt = RolloutSnapshotter.attempt

    async def counted(self: RolloutSnapshotter, **kwargs: Any) -> Any:
        try:
            return await attempt(self, **kwargs)
        except asyncio.CancelledError:
            cancelled.append(kwargs.get("reason", "periodic"))
            raise

    monkeypatch.setattr(RolloutSnapshotter, "attempt", counted)
    # turn level: the environment phase asks the Gyms for copies (prepare, then commit)
    checkpointing = {"snapshotEverySteps": 1, "deterministic": deterministic, "targetLevel": "turn"}
    task = {"name": "reach_target", "maxOperand": 9, "maxTurns": 3, "maxNewTokens": 3}
    config = tiny_config(tmp_path, checkpointing=checkpointing, task=task, policy={"maxSeqLen": 64})
    async with harness() as h:
        cfg = await h.start_gyms(config)
        torch.manual_seed(cfg.seed)
        controller = await h.controller(cfg)
        assert isinstance(controller.workers, SharesTrainerLoop)
        outcomes: list[Any] = []
        snapshot_after_commits(controller, {2}, outcomes)
        await run_to_end(controller)
    attempts = [r for r in h.records if r.get("kind") == "snapshot"]
    periodic = [r for r in attempts if r["reason"] == "train_step"]
    published = [r for r in periodic if "timing/rollout_checkpoint" in r]  # only those timed
    (forced,) = [r for r in attempts if r["reason"] == "test"]
    seen = [(r["reason"], r["rollout/checkpoint_outcome"]) for r in attempts]
    assert published and forced["rollout/checkpoint_outcome"] == "published", seen
    # a wait for every periodic attempt that reached the cut (every published one; one
    # skipped before it, or discarded in the environment phase, had none), none when forced;
    # and one for each attempt the run's end cancelled after its wait (it records nothing)
    assert "test" not in cancelled
    assert len(published) <= len(waits) <= len(periodic) + len(cancelled), (waits, seen)
    assert forced["timing/rollout_checkpoint"]["idle_wait_s"] == 0.0
    assert any(idle for _, _, idle, _ in waits)  # the engines do rest between calls
    for timeout_s, quiet_s, idle, none_decoding in waits:
        assert (timeout_s, quiet_s) == (pytest.approx(0.1), pytest.approx(0.005))
        assert none_decoding or not idle  # idle: no call is decoding
    # each wait between a prepare and its commit; the forced attempt's commit follows its
    # prepare with no wait between
    order = "".join({"prepare": "p", "wait": "w", "commit": "c"}[c] for c in calls)
    assert order.count("w") == len(waits) and "ww" not in order, order
    assert all(order[i - 1] == "p" for i, c in enumerate(order) if c == "w"), order
    assert "pc" in order, order  # the forced one


def _logged(name: str, calls: list[str]) -> Any:
    method = getattr(GymEnvironmentCheckpoint, name)

    async def logged(self: GymEnvironmentCheckpoint, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return await method(self, *args, **kwargs)

    return logged
