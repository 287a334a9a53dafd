"""A Gym lost while a turn-level trainer starts from a snapshot is replaced, not the run
(issue 14).

A real turn-level trainer over two in-process Gym replicas (pod instance ids,
``<run>-gym-<i>``, as the operator starts them) is stopped by a preemption notice right
after its snapshot parked and exported the episodes out on both replicas. Gym 1's pod is
then lost, and the next trainer starts from that snapshot with Gym 1 silent: its id is the
pod's, derived from the run name and index; the survivor's episodes are restored on it
(``attempt_restored`` at turn level), Gym 1's go on from their snapshot records as a lost
replica's do mid-run (``attempt_restored`` at member level: on the survivor, or on Gym 1's
replacement, announced as the operator announces it after the first step). The run
finishes on this one trainer, no sample failed, and the durable-state audit is clean (lost
0, duplicated 0, no side effect applied twice). Before, the trainer ended at start
("Gym replica ... did not answer /healthz"), and with every Gym answering but one failing
its restore, every episode of every replica restarted from turn 0.

With static endpoints (no id to derive: the launcher's or the user's) the trainer waits for
the silent replica within ``rollout.gymUnreachableSeconds`` (here it comes back at its
address a moment later) and restores on every replica once it answers.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.algorithms.rollout_checkpointing.trace import read_events
from rolloutrun_runtime.algorithms.single_controller import OnStep
from rolloutrun_runtime.audit import audit, load_durable_state
from rolloutrun_runtime.contract.layout import TRACE_FILE
from rolloutrun_runtime.contract.pod import ENV_RUN_NAME, gym_instance_id
from rolloutrun_runtime.experience.rollout_recovery import rollout_id_for, sibling_id_for
from rolloutrun_runtime.trainer import run_trainer
from tests.support.data_plane import TOKEN
from tests.support.elastic_gyms import ElasticGyms
from tests.support.run_configs import tiny_config

#: Generous bound on a whole tiny run: a deadlock fails the test instead of hanging it.
RUN_LIMIT_S = 200
MAX_STEPS = 4
RUN = "demo"


def _config(tmp_path: Path) -> Any:
    return tiny_config(
        tmp_path,
        name=RUN,
        seed=11,
        policy={"maxSeqLen": 48},
        task={
            "name": "reach_target",
            "datasetSize": 64,
            "maxOperand": 9,
            "maxTurns": 6,
            "maxNewTokens": 3,
            "turnDelayMs": 60,
        },
        grpo={"maxSteps": MAX_STEPS, "maxStaleness": 1, "promptsPerStep": 2},
        rollout={"maxAttempts": 3, "gymUnreachableSeconds": 60},
        checkpointing={"targetLevel": "turn", "snapshotIntervalSeconds": 0},
    )


def _effects(files: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """The runs' side effects by rollout id, in revision order."""
    by_rollout: dict[str, list[dict[str, Any]]] = {}
    for path in files:
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            by_rollout.setdefault(entry["rollout_id"], []).append(entry)
    return {r: sorted(entries, key=lambda e: e["revision"]) for r, entries in by_rollout.items()}


def _whole_restore_refused(events: list[Any]) -> list[Any]:
    """The restore's failure as a whole (an episode refused alone, e.g. one whose run applied
    an effect past its record before the first trainer stopped, names its rollout)."""
    refused = [e for e in events if e["event"] == "environment_restore_refused"]
    return [e for e in refused if e["rollout_id"] is None]


async def _preempted_after_step_1(gyms: ElasticGyms) -> None:
    """The first trainer: a preemption notice at step 1 publishes a snapshot, then stops."""
    notice = asyncio.Event()

    def on_step(record: dict[str, Any]) -> None:
        if record["step"] == 1:
            notice.set()

    run = asyncio.ensure_future(
        run_trainer(gyms.config(), hooks=OnStep(on_step), preemption=notice)
    )
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(run, RUN_LIMIT_S)


@pytest.mark.timeout(400)
async def test_a_gym_lost_before_a_turn_level_restore_is_replaced_and_the_run_finishes(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV_RUN_NAME, RUN)  # the operator sets it in every pod
    cfg = _config(tmp_path)
    gyms = ElasticGyms(cfg, TOKEN, instance_id=lambda index: gym_instance_id(RUN, index))
    await gyms.start()
    back: list[asyncio.Task[None]] = []

    def gym_1_comes_back_after_a_step(record: dict[str, Any]) -> None:
        if not back:
            back.append(asyncio.get_running_loop().create_task(gyms.come_back(1)))

    try:
        await _preempted_after_step_1(gyms)
        trace_file = Path(cfg.log_dir) / TRACE_FILE
        before = len(list(read_events(trace_file)))
        await gyms.lose(1)  # the config still names its first address
        run = run_trainer(
            gyms.config(), hooks=OnStep(gym_1_comes_back_after_a_step), gym_members=gyms.endpoints
        )
        result = await asyncio.wait_for(run, RUN_LIMIT_S)
        await asyncio.gather(*back)
    finally:
        await gyms.stop()

    assert result.history and result.history[-1]["step"] == MAX_STEPS
    events = list(read_events(trace_file))[before:]
    restored = [e for e in events if e["event"] == "attempt_restored"]
    assert [e for e in restored if e["level"] == "turn"], "no episode restored on the survivor"
    assert [e for e in restored if e["level"] == "member"], "Gym 1's episodes did not go on"
    assert not _whole_restore_refused(events)
    assert not [e for e in events if e["event"] == "attempt_failed"]  # never a failed sample
    assert back, "no step was trained before Gym 1's replacement"
    # Gym 1's episodes went on from their records (on the survivor or the replacement):
    # under their own rollout ids and a later environment attempt, at a turn past 0, their
    # revisions 1..n each once across both replicas' side-effect logs (a restart from turn
    # 0 would run under a new rollout id).
    effects = _effects([gyms.audit_file(0), gyms.audit_file(1)])
    went_on = {
        rollout_id_for(sibling_id_for(e["group_id"], e["generation_index"]), e["attempt_uuid"])
        for e in restored
        if e["level"] == "member"
    }
    continued = {
        r: effects[r] for r in went_on if any(e["attempt"] >= 1 for e in effects.get(r, []))
    }
    assert continued, "no episode of Gym 1 applied an effect after going on from its record"
    for rollout_id, entries in continued.items():
        revisions = [e["revision"] for e in entries]
        assert revisions == list(range(1, len(revisions) + 1)), (rollout_id, revisions)
        assert next(e for e in entries if e["attempt"] >= 1)["turn"] > 0, (rollout_id, entries)
    state = load_durable_state(Path(cfg.log_dir), seed=cfg.seed, max_steps=MAX_STEPS)
    report = audit(state)
    assert report.ok, report
    assert (report.prompts.lost, report.prompts.duplicated) == (0, 0)


@pytest.mark.timeout(400)
async def test_a_static_gym_silent_at_a_turn_level_start_is_waited_for(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_RUN_NAME, raising=False)  # not a pod: ids cannot be derived
    cfg = _config(tmp_path)
    gyms = ElasticGyms(cfg, TOKEN)
    await gyms.start()
    try:
        await _preempted_after_step_1(gyms)
        trace_file = Path(cfg.log_dir) / TRACE_FILE
        before = len(list(read_events(trace_file)))
        await gyms.lose(1)

        port = int(gyms.urls[1].rstrip("/").rsplit(":", 1)[1])

        async def comes_back_a_moment_later() -> None:
            await asyncio.sleep(0.5)
            await gyms.come_back(1, port)  # at its address: nobody announces another

        back = asyncio.ensure_future(comes_back_a_moment_later())
        run = run_trainer(gyms.config())
        result = await asyncio.wait_for(run, RUN_LIMIT_S)
        await back
    finally:
        await gyms.stop()

    assert result.history and result.history[-1]["step"] == MAX_STEPS
    events = list(read_events(trace_file))[before:]
    assert [e for e in events if e["event"] == "attempt_restored" and e["level"] == "turn"]
    assert not _whole_restore_refused(events)
    assert not [e for e in events if e["event"] == "attempt_failed"]
    assert gyms.runs.get((1, 1), 0) > 0  # the replacement took the restore and the work
    state = load_durable_state(Path(cfg.log_dir), seed=cfg.seed, max_steps=MAX_STEPS)
    report = audit(state)
    assert report.ok, report
    assert (report.prompts.lost, report.prompts.duplicated) == (0, 0)
