"""A snapshot's cut and write wait for the trainer's in-process engines to be between calls.

Why: an in-process engine decodes on the trainer's own event loop (each decode step is a turn
of it) and needs the interpreter lock for Python's share of its tensor work, so whatever a
snapshot does on the loop or in its writer thread while calls decode delays every one of them
(measured: each rollout dispatched after a snapshotted step took ~4 ms longer). Between calls
the same work costs the rollouts nothing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import RolloutSnapshotter
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
    waits: list[tuple[float, bool, bool]] = []
    wait = InProcessWorkers.until_idle

    async def recorded(self: InProcessWorkers, timeout_s: float) -> bool:
        idle = await wait(self, timeout_s)
        waits.append((timeout_s, idle, all(engine.running == 0 for engine in self.engines)))
        return idle

    monkeypatch.setattr(InProcessWorkers, "until_idle", recorded)
    cancelled: list[str] = []  # attempts the run's end cancelled: they record nothing
    attempt = RolloutSnapshotter.attempt

    async def counted(self: RolloutSnapshotter, **kwargs: Any) -> Any:
        try:
            return await attempt(self, **kwargs)
        except asyncio.CancelledError:
            cancelled.append(kwargs.get("reason", "periodic"))
            raise

    monkeypatch.setattr(RolloutSnapshotter, "attempt", counted)
    checkpointing = {"snapshotEverySteps": 1, "deterministic": deterministic}
    async with harness() as h:
        cfg = await h.start_gyms(tiny_config(tmp_path, checkpointing=checkpointing))
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
    assert any(idle for _, idle, _ in waits)  # the engines do rest between calls
    for timeout_s, idle, none_decoding in waits:
        assert timeout_s == pytest.approx(0.1)
        assert none_decoding or not idle  # idle: no call is decoding
