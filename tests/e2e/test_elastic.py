"""Elastic members end to end: Gym pods deleted again and again under a training run are
replaced while the run goes on with ONE incarnation, and the audit stays clean (no rollout
lost or duplicated, no side effect applied twice), asynchronous and turn level.

Before, each deleted Gym pod ended the incarnation (the trainer's process, its warm weights
and every rollout in flight on the other Gyms), so the run counted one incarnation more per
deletion. Waits are polls with generous bounds that only catch hangs; nothing is timed.
"""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import pytest

from rolloutrun_localcluster.embedded import EmbeddedRun, member_replacements
from rolloutrun_localcluster.testing import eventually
from rolloutrun_runtime.contract.layout import TRACE_FILE
from tests.e2e.conftest import RUN_BOUND_S, finish, tiny, wait_for_snapshot

#: Steps of a run: long enough to be still training after the deletions (a replacement
#: takes seconds on a loaded machine; the tiny run trains about a step a second).
MAX_STEPS = 100


def _turn_level() -> dict[str, Any]:
    """The tiny run as a multi-turn task with turn-level snapshots (side effects per turn)."""
    document = tiny()
    run = document["spec"]["run"]
    run["task"] = {
        "name": "reach_target",
        "datasetSize": 256,
        "maxOperand": 9,
        "maxTurns": 3,
        "maxNewTokens": 3,
    }
    run["policy"]["maxSeqLen"] = 48
    run["checkpointing"]["targetLevel"] = "turn"
    return document


def _replaced(run: EmbeddedRun) -> int:
    return int(member_replacements(run.status()).get("gym", {}).get("count") or 0)


def _delete_gyms_repeatedly(run: EmbeddedRun, deletions: int) -> list[str]:
    """Delete a Gym pod (alternating the index) each time the last replacement is Ready and
    the trainer trained a step more; the names deleted."""
    deleted = []
    for k in range(deletions):
        step = int(run.status().get("trainStep") or 0)
        eventually(
            lambda s=step: int(run.status().get("trainStep") or 0) > s,
            timeout=RUN_BOUND_S,
            what="a step trained since the last replacement",
        )
        name = f"{run.name}-i1-gym-{k % 2}"
        run.delete_pod(name)
        deleted.append(name)
        eventually(lambda k=k: _replaced(run) > k, timeout=RUN_BOUND_S, what=f"replacement {k + 1}")
    return deleted


def test_gym_pods_deleted_repeatedly_are_replaced_within_one_incarnation(start_run):
    _deleted_repeatedly(start_run, tiny(), deletions=2)


@pytest.mark.chaos
def test_turn_level_gym_pods_deleted_repeatedly_are_replaced_within_one_incarnation(start_run):
    _deleted_repeatedly(start_run, _turn_level(), deletions=3)


def _deleted_repeatedly(start_run: Any, document: dict[str, Any], deletions: int) -> None:
    document = copy.deepcopy(document)
    document["spec"]["run"]["grpo"]["maxSteps"] = MAX_STEPS
    run = start_run(document)
    wait_for_snapshot(run)
    deleted = _delete_gyms_repeatedly(run, deletions)
    summary = finish(run)

    assert summary["result"] == "Succeeded", summary
    assert summary["steps"] == MAX_STEPS
    assert summary["incarnations"] == 1, summary  # the trainer was never restarted
    assert (summary["preemptions"], summary["restarts"]) == (0, 0)
    replaced = summary["member_replacements"]["gym"]
    assert replaced["count"] == deletions and len(replaced["recent_s"]) == deletions
    assert len(deleted) == deletions
    assert summary["audit"].get("ok") is True, summary["audit"]
    assert summary["audit_holds"]
    status = run.status()
    assert status["members"] and all(m["lostAt"] is None for m in status["members"])
    assert {m["index"] for m in status["members"]} == {0, 1}


def _dispatches(run: EmbeddedRun) -> list[tuple[float, str]]:
    """Each attempt's dispatch in the run's rollout trace: (wall time, Gym instance id)."""
    events = [json.loads(line) for line in (run.log_dir / TRACE_FILE).read_text().splitlines()]
    return [(e["t"], e["gym_instance_id"]) for e in events if e["event"] == "attempt_dispatched"]


def test_a_standby_gym_takes_work_only_after_a_loss_and_is_replaced_as_a_gym(start_run):
    """``spec.gym.standby: 1``: three Gym pods, the third handed no episode until an active
    one is lost (from the trainer's own trace), then its share; the standby's own loss is a
    Gym replacement like any other, and the run keeps one incarnation with a clean audit."""
    document = tiny(gym={"standby": 1})
    document["spec"]["run"]["grpo"]["maxSteps"] = MAX_STEPS
    run = start_run(document)
    wait_for_snapshot(run)
    lost_at = time.time()
    run.delete_pod(f"{run.name}-i1-gym-0")
    eventually(lambda: _replaced(run) > 0, timeout=RUN_BOUND_S, what="gym 0 replaced")
    step = int(run.status().get("trainStep") or 0)
    eventually(
        lambda: int(run.status().get("trainStep") or 0) > step,
        timeout=RUN_BOUND_S,
        what="a step trained since the replacement",
    )
    run.delete_pod(f"{run.name}-i1-gym-2")  # the standby itself
    eventually(lambda: _replaced(run) > 1, timeout=RUN_BOUND_S, what="the standby replaced")
    summary = finish(run)

    assert summary["result"] == "Succeeded", summary
    assert summary["incarnations"] == 1, summary
    assert summary["member_replacements"]["gym"]["count"] == 2
    assert summary["audit"].get("ok") is True, summary["audit"]
    assert summary["audit_holds"]
    assert {m["index"] for m in run.status()["members"]} == {0, 2}
    dispatches = _dispatches(run)
    standby = f"{run.name}-gym-2"
    before = [i for t, i in dispatches if t < lost_at]
    assert before and {f"{run.name}-gym-0", f"{run.name}-gym-1"} == set(before), set(before)
    assert any(i == standby for t, i in dispatches if t >= lost_at), "the standby took no work"
