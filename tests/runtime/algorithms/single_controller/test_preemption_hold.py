"""A preemption notice holds training: nothing is trained after the forced snapshot's cut.

The real trainer (in process, real Gym servers on loopback) gets the notice after step 2;
its forced snapshot is made slow (a second before it starts, as a large state on a busy
machine would take), time in which an unheld train pump trains on. Every step trained
before the run stops must be in the last published snapshot, so the next incarnation trains
each step once: the stored metrics have one row per step. Before the hold, the steps
trained meanwhile were thrown away, trained again, and logged twice (``[1, 2, 3, 4, 3, 4]``).
``TrainingHold`` alone: the notice waits on a step computing, never on a pump waiting for
rollouts (that wait once kept a preempted trainer alive for half its grace period). And
``forced_snapshot`` alone: an attempt that met an optimizer commit is tried again (it
used to end the run with no snapshot), any other outcome is final, the grace bounds it all.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots import RolloutSnapshotter
from rolloutrun_runtime.algorithms.rollout_checkpointing.snapshots_decisions import (
    SnapshotOutcome,
)
from rolloutrun_runtime.algorithms.single_controller.controller import forced_snapshot
from rolloutrun_runtime.algorithms.single_controller.hooks import NoHooks
from rolloutrun_runtime.algorithms.single_controller.run_state import TrainingHold
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.run_logs import read_stored_metrics
from rolloutrun_runtime.storage import open_storage
from rolloutrun_runtime.trainer import run_trainer
from tests.support.run_configs import tiny_config

RUN_LIMIT_S = 150
STEPS = 6
NOTICE_AFTER = 2
SLOW_SNAPSHOT_S = 1.0


class _NoticeAt(NoHooks):
    """Sets the preemption notice when step ``step`` is trained; keeps what was published."""

    def __init__(self, notice: asyncio.Event, step: int) -> None:
        self.notice, self.step = notice, step
        self.published: list[dict[str, Any]] = []

    def on_step(self, record: dict[str, Any]) -> None:
        if record["step"] == self.step:
            self.notice.set()

    def on_published(self, published: dict[str, Any]) -> None:
        self.published.append(published)


def _config(tmp_path: Path, log_dir: str) -> Any:
    cfg = tiny_config(
        tmp_path,
        grpo={"maxSteps": STEPS},
        checkpointing={
            "storageUri": f"file://{tmp_path / 'storage'}",
            "snapshotIntervalSeconds": 0,
        },
    )
    return cfg.model_copy(update={"log_dir": str(tmp_path / log_dir)})


def _trained_steps(log_dir: str) -> list[int]:
    lines = (Path(log_dir) / TRACE_FILE).read_text().splitlines()
    return [e["step"] for e in map(json.loads, lines) if e["event"] == "step_completed"]


@pytest.fixture
def slow_preemption_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    attempt = RolloutSnapshotter.attempt

    async def slow(self: RolloutSnapshotter, *, force: bool = False, reason: str = "") -> Any:
        if reason == "preemption":
            await asyncio.sleep(SLOW_SNAPSHOT_S)
        return await attempt(self, force=force, reason=reason)

    monkeypatch.setattr(RolloutSnapshotter, "attempt", slow)


@pytest.mark.usefixtures("slow_preemption_snapshot")
async def test_nothing_is_trained_after_a_preemption_snapshot(tmp_path, gym_endpoints):
    first = await gym_endpoints(_config(tmp_path, "pod-0"))
    notice = asyncio.Event()
    hooks = _NoticeAt(notice, NOTICE_AFTER)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run_trainer(first, hooks=hooks, preemption=notice), RUN_LIMIT_S)

    trained = _trained_steps(first.log_dir)
    # Held before the next step: at most the one the watcher's wake-up found begun.
    assert trained in (list(range(1, NOTICE_AFTER + 1)), list(range(1, NOTICE_AFTER + 2)))
    assert hooks.published and hooks.published[-1]["train_step"] == trained[-1]

    second = await gym_endpoints(_config(tmp_path, "pod-1"))
    result = await asyncio.wait_for(run_trainer(second), RUN_LIMIT_S)
    assert result.resumed_from is not None
    rows = read_stored_metrics(open_storage(f"file://{tmp_path / 'storage'}"))
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))  # each step once


def _attempts(*outcomes: SnapshotOutcome | None) -> tuple[Any, list[int]]:
    """An attempt answering ``outcomes`` in turn (None: never answers); and its call count."""
    calls: list[int] = []

    async def attempt() -> SnapshotOutcome:
        calls.append(1)
        outcome = outcomes[len(calls) - 1]
        if outcome is None:
            await asyncio.sleep(3600)
        assert outcome is not None
        return outcome

    return attempt, calls


async def test_a_forced_snapshot_that_met_an_optimizer_commit_is_tried_again():
    attempt, calls = _attempts(
        SnapshotOutcome.SKIPPED_COMMIT_WINDOW,
        SnapshotOutcome.SKIPPED_COMMIT_WINDOW,
        SnapshotOutcome.PUBLISHED,
    )
    assert await forced_snapshot(attempt, time.monotonic() + 5) is SnapshotOutcome.PUBLISHED
    assert len(calls) == 3


async def test_any_other_outcome_is_final_and_time_running_out_is_none():
    attempt, calls = _attempts(SnapshotOutcome.FAILED, SnapshotOutcome.PUBLISHED)
    assert await forced_snapshot(attempt, time.monotonic() + 5) is SnapshotOutcome.FAILED
    assert len(calls) == 1
    attempt, calls = _attempts(SnapshotOutcome.SKIPPED_COMMIT_WINDOW, None)
    assert await forced_snapshot(attempt, time.monotonic() + 0.3) is None
    assert len(calls) == 2
    attempt, calls = _attempts(SnapshotOutcome.PUBLISHED)
    assert await forced_snapshot(attempt, time.monotonic() - 1) is None
    assert calls == []


async def test_the_hold_waits_only_on_a_step_computing_never_on_generation():
    hold = TrainingHold()
    assert await hold.idle(0)  # a pump selecting (waiting for rollouts) is idle
    await hold.before_compute()  # not held: the step is under way
    assert not await hold.idle(0.05)
    hold.hold()
    hold.step_done()
    assert await hold.idle(5)
    parked = asyncio.ensure_future(hold.before_compute())
    await asyncio.sleep(0.05)
    assert not parked.done() and await hold.idle(0)  # parked: computes nothing
    parked.cancel()
