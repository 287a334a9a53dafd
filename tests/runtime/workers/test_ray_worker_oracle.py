"""The oracle with generation workers lost: a deterministic run whose Ray generation actors
are SIGKILLed mid-run, one after the other, ends with the weights of an undisturbed run.

Real Ray actors (each a process of its own), real Gym servers on loopback, the real
controller. After the first train step actor 0's process is killed with SIGKILL, as a
deleted worker pod's node takes it: its calls in flight end as ``policy_unreachable`` on the
Gyms and are redispatched (attempt + 1) to actor 1; the next refit finds actor 0 dead and
starts its replacement. At that moment actor 1 is killed too: no live actor is left, and the
step's groups (which the next refit waits for, in deterministic mode) can only be generated
by the replacement, admitted as soon as its server runs (before: only at a refit, which
never came; the run ended on the outage). The result must not depend on which actor served
a call: the Gym's sampling seed depends only on (seed, prompt, sibling, turn), each call
pins the weight version of its target step, and the engine computes every call on its own
(batch-invariant), so the final weights equal those of the same run undisturbed, bit for
bit, and nothing lost to the kills is scored.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import TraceWriter, read_events
from rolloutrun_runtime.audit import audit, load_durable_state
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.contract.wire import POLICY_UNREACHABLE
from rolloutrun_runtime.policy.model import state_sha256
from tests.support.rollout_checkpoints import Harness, tiny_config

#: Bound of a whole run (Ray actors start in seconds; a hang fails the test).
RUN_LIMIT_S = 240
MAX_STEPS = 4
#: The train step after which the first generation actor is killed.
KILL_AFTER_STEP = 1


def _config(tmp_path: Path, standby: int = 0) -> RunConfig:
    return tiny_config(
        tmp_path,
        grpo={"maxSteps": MAX_STEPS, "maxStaleness": 1},
        # an outage (no live actor) ends the run in 30 s rather than hanging the test
        rollout={"maxAttempts": 2, "rolloutTimeoutSeconds": 600, "gymUnreachableSeconds": 30},
        checkpointing={"deterministic": True, "snapshotIntervalSeconds": 0},
        workers={"backend": "ray", "generationWorkers": 2, "standbyWorkers": standby},
    )


def _actor_pid(actor: Any) -> int:
    import ray

    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60))


async def _until(check: Any, running: asyncio.Future[Any]) -> None:
    """Poll ``check()`` (every 10 ms) while the run goes on."""
    while not check():
        assert not running.done(), "the run ended before the kill"
        await asyncio.sleep(0.01)


async def _run(cfg: RunConfig, *, kill: bool) -> tuple[Any, str, list[int]]:
    """One run; with ``kill``, actor 0's process SIGKILLed after step 1, then actor 1's as
    soon as a refit has found actor 0 dead. Returns the controller, the final weights'
    digest and the pids killed."""
    harness = Harness()
    killed: list[int] = []
    try:
        cfg = await harness.start_gyms(cfg)
        trace = TraceWriter(Path(cfg.log_dir) / TRACE_FILE)
        steps: list[int] = []
        controller = await harness.controller(
            cfg, trace=trace, on_step=lambda record: steps.append(int(record["step"]))
        )
        workers = harness.workers[-1]
        pids = [await asyncio.to_thread(_actor_pid, actor) for actor in workers._actors]
        if cfg.workers.standby_workers:  # a standby started: the first loss promotes it
            async with asyncio.timeout(RUN_LIMIT_S):
                while not workers.standbys:
                    await asyncio.sleep(0.05)
        running = asyncio.ensure_future(controller.run())
        if kill:
            await _until(lambda: steps and steps[-1] >= KILL_AFTER_STEP, running)
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
            # the first loss seen (a replacement created, or a standby taking the index)
            await _until(lambda: 0 in workers.replacements, running)
            os.kill(pids[1], signal.SIGKILL)
            killed.append(pids[1])
        await asyncio.wait_for(running, RUN_LIMIT_S)
        trace.close()
        return controller, state_sha256(controller.model.state_dict()), killed
    finally:
        await harness.close()


@pytest.mark.ray
async def test_generation_actors_sigkilled_one_after_the_other_change_no_weight(
    ray_session: None, tmp_path: Path
) -> None:
    _, reference, _ = await _run(_config(tmp_path / "reference"), kill=False)
    cfg = _config(tmp_path / "lost")
    controller, weights, killed = await _run(cfg, kill=True)

    assert len(killed) == 2
    events = list(read_events(Path(cfg.log_dir) / TRACE_FILE))
    abandoned = [
        e
        for e in events
        if e["event"] == "attempt_abandoned" and e.get("reason") == POLICY_UNREACHABLE
    ]
    assert not [e for e in events if e["event"] == "attempt_failed"]  # never a failed sample
    assert controller.trainer_version == MAX_STEPS
    workers = controller.workers
    assert workers.replacements == {0: 1, 1: 1}, "a lost actor was not replaced"
    assert weights == reference, f"abandoned attempts: {len(abandoned)}"
    report = audit(load_durable_state(Path(cfg.log_dir), seed=cfg.seed, max_steps=MAX_STEPS))
    assert report.ok, report
    assert (report.prompts.lost, report.prompts.duplicated) == (0, 0)


@pytest.mark.chaos  # two more runs of a minute each on a shared machine
@pytest.mark.ray
async def test_a_standby_serving_a_lost_workers_index_changes_no_weight(
    ray_session: None, tmp_path: Path
) -> None:
    """The same kills with a warm standby actor: the first lost index is served by the
    standby at once (promoted on the latest refit's weights, under the refits' lock), the
    second by a standby or a replacement; the final weights are those of the undisturbed
    run without standby, bit for bit."""
    _, reference, _ = await _run(_config(tmp_path / "reference"), kill=False)
    cfg = _config(tmp_path / "lost", standby=1)
    controller, weights, killed = await _run(cfg, kill=True)
    assert len(killed) == 2
    assert controller.trainer_version == MAX_STEPS
    assert controller.workers.promotions >= 1
    assert weights == reference
    report = audit(load_durable_state(Path(cfg.log_dir), seed=cfg.seed, max_steps=MAX_STEPS))
    assert report.ok, report
