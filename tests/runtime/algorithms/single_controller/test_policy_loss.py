"""A generation endpoint lost under a live trainer: its attempts redispatched, never scored.

One of the generation endpoints the trainer hands the Gyms is an address that accepts
connections and never answers (a deleted worker pod's address: no RST), the rollout timeout
is far longer than the run may take. The Gyms answer ``policy_unreachable`` after a few
seconds; the rollout pump abandons those attempts and redispatches them (not counted as
failed samples) to the live endpoint, and gives out the silent one no more. The run ends
with the weights of an undisturbed run, audit clean. Before, every call sent there waited
for ``rolloutTimeoutSeconds`` and then failed as a sample. At turn level (``make chaos``)
the lost calls' episodes go on at their recorded turns (member resume), no effect repeated.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
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

#: Bound of a whole run: one waiting for the rollout timeout (600 s) fails the test.
RUN_LIMIT_S = 150
MAX_STEPS = 3


@pytest.fixture
async def silent_endpoint() -> AsyncIterator[str]:
    """A generation address that accepts connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        await reader.read()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for writer in held:
        writer.close()
    server.close()


def _config(tmp_path: Path) -> RunConfig:
    return tiny_config(
        tmp_path,
        grpo={"maxSteps": MAX_STEPS, "maxStaleness": 1},
        rollout={"maxAttempts": 2, "rolloutTimeoutSeconds": 600},
        checkpointing={"deterministic": True, "snapshotIntervalSeconds": 0},
    )


async def _run(cfg: RunConfig, extra_endpoint: str | None = None) -> tuple[Any, str]:
    harness = Harness()
    try:
        cfg = await harness.start_gyms(cfg)
        trace = TraceWriter(Path(cfg.log_dir) / TRACE_FILE)
        controller = await harness.controller(cfg, trace=trace)
        if extra_endpoint is not None:  # a worker whose pod is gone, its address silent
            harness.workers[-1].endpoints.append(extra_endpoint)
        await asyncio.wait_for(controller.run(), RUN_LIMIT_S)
        trace.close()
        return controller, state_sha256(controller.model.state_dict())
    finally:
        await harness.close()


async def test_a_silent_generation_endpoint_costs_no_sample_and_no_rollout_timeout(
    tmp_path: Path, silent_endpoint: str
) -> None:
    _, reference = await _run(_config(tmp_path / "reference"))
    cfg = _config(tmp_path / "lost")
    controller, weights = await _run(cfg, silent_endpoint)

    events = list(read_events(Path(cfg.log_dir) / TRACE_FILE))
    abandoned = [
        e
        for e in events
        if e["event"] == "attempt_abandoned" and e.get("reason") == POLICY_UNREACHABLE
    ]
    assert abandoned, "no attempt was sent to the silent endpoint"
    assert not [e for e in events if e["event"] == "attempt_failed"]  # never a failed sample
    assert not [e for e in events if e["event"] == "group_dropped" and "exhausted" in e["reason"]]
    assert silent_endpoint in controller.rollout_pump.policies.down  # given out no more
    assert controller.trainer_version == MAX_STEPS
    assert weights == reference

    report = audit(load_durable_state(Path(cfg.log_dir), seed=cfg.seed, max_steps=MAX_STEPS))
    assert report.ok, report
    assert (report.prompts.lost, report.prompts.duplicated) == (0, 0)
    assert report.side_effects.duplicated == 0


def _turn_level_config(tmp_path: Path) -> RunConfig:
    return tiny_config(
        tmp_path,
        seed=13,
        policy={"maxSeqLen": 48},
        task={
            "name": "reach_target",
            "datasetSize": 64,
            "maxOperand": 9,
            "maxTurns": 6,
            "maxNewTokens": 3,
            "turnDelayMs": 20,
        },
        grpo={"maxSteps": MAX_STEPS, "maxStaleness": 1, "promptsPerStep": 2},
        rollout={"maxAttempts": 2, "rolloutTimeoutSeconds": 600},
        gym={"replicas": 1},
        checkpointing={
            "targetLevel": "turn",
            "deterministic": True,
            "snapshotIntervalSeconds": 0,
            "snapshotEveryRollouts": 4,
        },
    )


@pytest.mark.chaos  # four tiny runs in all: ~15 s on a shared machine
async def test_a_turn_level_run_loses_a_generation_endpoint_without_a_repeated_effect(
    tmp_path: Path, silent_endpoint: str
) -> None:
    _, reference = await _run(_turn_level_config(tmp_path / "reference"))
    cfg = _turn_level_config(tmp_path / "lost")
    _, weights = await _run(cfg, silent_endpoint)

    events = list(read_events(Path(cfg.log_dir) / TRACE_FILE))
    redispatched = [
        e
        for e in events
        if (e["event"] == "attempt_abandoned" and e.get("reason") == POLICY_UNREACHABLE)
        or (e["event"] == "attempt_restored" and e.get("level") == "member")
    ]
    assert redispatched, "no attempt was sent to the silent endpoint"
    assert not [e for e in events if e["event"] == "attempt_failed"]
    assert weights == reference  # episodes went on at their turns (member resume) or restarted
    report = audit(load_durable_state(Path(cfg.log_dir), seed=cfg.seed, max_steps=MAX_STEPS))
    assert report.ok, report
    assert report.side_effects.duplicated == 0
