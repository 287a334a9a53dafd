"""Gym replicas that go away under a live trainer: infrastructure, never a failed sample.

The controller runs against real in-process Gym servers that are stopped mid-run. Restarted
a moment later, the run completes with no attempt failed, no group given up and no step
closed short, and in deterministic mode its final weights equal an uninterrupted run's. Never
restarted, the trainer stops with an error naming the endpoint once
``rollout.gymUnreachableSeconds`` is spent, having recorded no empty step. Before this, every
attempt failed within milliseconds, every group was given up and steps closed with no
groups, recorded as reward 0 and loss 0.
"""

from __future__ import annotations

import asyncio
from typing import Any
from urllib.parse import urlsplit

import pytest

from rolloutrun_runtime.algorithms.gym_client import GymOutageError
from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import read_events
from rolloutrun_runtime.algorithms.single_controller import OnStep
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.metrics import read_metrics
from rolloutrun_runtime.trainer import run_trainer
from tests.support.run_configs import tiny_config

#: Generous bound on a whole tiny run: a deadlock fails the test instead of hanging it.
RUN_LIMIT_S = 150
#: How long the Gyms stay down (several backoff rounds, well inside the budget).
OUTAGE_S = 2.0


class _Gyms:
    """In-process Gym replicas that can be stopped and started again on their ports."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.runners: list[Any] = []
        self.urls: list[str] = []

    async def start(self, ports: list[int] | None = None) -> None:
        from rolloutrun_runtime.environments.gym import GymServer
        from rolloutrun_runtime.policy.http import serve_app

        self.urls = []
        for index in range(self.cfg.gym.replicas):
            server = GymServer(f"gym-{index}", self.cfg, None)
            runner, url = await serve_app(server.app, port=ports[index] if ports else 0)
            self.runners.append(runner)
            self.urls.append(url)

    async def stop(self) -> None:
        runners, self.runners = self.runners, []
        for runner in runners:
            await runner.cleanup()

    async def outage(self, seconds: float) -> None:
        ports = [urlsplit(url).port or 0 for url in self.urls]
        await self.stop()
        await asyncio.sleep(seconds)
        await self.start(ports)

    def config(self) -> RunConfig:
        gym = self.cfg.gym.model_copy(update={"endpoints": list(self.urls)})
        return self.cfg.model_copy(update={"gym": gym})


def _config(tmp_path: Any, **rollout: Any) -> RunConfig:
    return tiny_config(
        tmp_path,
        seed=7,
        grpo={"maxSteps": 5, "maxStaleness": 1},
        rollout={"maxAttempts": 3, **rollout},
        checkpointing={"deterministic": True, "snapshotIntervalSeconds": 0},
    )


async def _run(cfg: RunConfig, on_step: Any = None, **kwargs: Any) -> Any:
    hooks = OnStep(on_step) if on_step is not None else None
    return await asyncio.wait_for(run_trainer(cfg, hooks=hooks, **kwargs), RUN_LIMIT_S)


async def test_gyms_restarted_mid_run_lose_no_group_and_change_no_weight(tmp_path):
    reference_gyms = _Gyms(_config(tmp_path / "reference"))
    await reference_gyms.start()
    try:
        reference = await _run(reference_gyms.config())
    finally:
        await reference_gyms.stop()

    gyms = _Gyms(_config(tmp_path / "outage"))
    await gyms.start()
    outages: list[asyncio.Task[None]] = []

    def stop_gyms_after_step_2(record: dict[str, Any]) -> None:
        if record["step"] == 2:
            outages.append(asyncio.get_running_loop().create_task(gyms.outage(OUTAGE_S)))

    try:
        result = await _run(gyms.config(), on_step=stop_gyms_after_step_2)
        await asyncio.gather(*outages)
    finally:
        await gyms.stop()

    assert outages, "the outage never started"
    events = list(read_events(tmp_path / "outage" / "run" / TRACE_FILE))
    assert not [e for e in events if e["event"] == "attempt_failed"]
    given_up = [
        e
        for e in events
        if e["event"] == "group_dropped" and e["reason"].startswith("attempts exhausted")
    ]
    assert not given_up
    # Step by step the same groups (zero-variance drops included) and the same loss.
    for key in ("step", "groups", "prompt_ids", "shortfall", "replacements", "loss"):
        assert [r[key] for r in result.history] == [r[key] for r in reference.history], key
    assert all(r["groups"] > 0 for r in result.history)
    unreachable = [
        e
        for e in events
        if e["event"] == "attempt_abandoned" and e.get("reason") == "gym_unreachable"
    ]
    assert unreachable, "no attempt found the Gyms gone: the outage came too late to test"
    assert result.final_weights_sha256 == reference.final_weights_sha256


async def test_gyms_that_stay_gone_stop_the_trainer_naming_the_endpoint(tmp_path):
    gyms = _Gyms(_config(tmp_path, gymUnreachableSeconds=1))
    await gyms.start()
    stopped: list[asyncio.Task[None]] = []

    def stop_gyms_after_step_1(record: dict[str, Any]) -> None:
        if record["step"] == 1:
            stopped.append(asyncio.get_running_loop().create_task(gyms.stop()))

    try:
        with pytest.raises(Exception) as failed:
            await _run(gyms.config(), on_step=stop_gyms_after_step_1)
        await asyncio.gather(*stopped)
    finally:
        await gyms.stop()

    chain: list[BaseException] = []
    error: BaseException | None = failed.value
    while error is not None:
        chain.append(error)
        error = error.__cause__
    outage = next((e for e in chain if isinstance(e, GymOutageError)), None)
    assert outage is not None, f"the trainer stopped for another reason: {failed.value!r}"
    assert any(url in str(outage) for url in gyms.urls)
    assert "unreachable for" in str(outage)
    # Only steps whose rollouts ran before the outage were recorded (step 1, maybe step 2):
    # no step closed on groups lost to it.
    steps = [row["step"] for row in read_metrics(tmp_path / "run")]
    assert steps in ([1], [1, 2])
    assert all(row["groups"] > 0 for row in read_metrics(tmp_path / "run"))
