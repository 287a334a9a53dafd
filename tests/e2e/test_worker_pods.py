"""Generation workers as pods end to end: the trainer is the Ray head, two worker pods join
it from their own pod addresses, worker pods deleted again and again mid-run are replaced
while the run goes on with ONE incarnation, and the audit stays clean (no rollout lost or
duplicated, no side effect applied twice), asynchronous and turn level. Three Ray nodes on
a shared machine: under ``make chaos``. Waits are polls with generous bounds that only
catch hangs; nothing is timed.
"""

from __future__ import annotations

from typing import Any

import kubernetes
import pytest

from rolloutrun_localcluster.embedded import EmbeddedRun, member_replacements
from rolloutrun_localcluster.testing import eventually
from rolloutrun_runtime.workers import STANDBY_ADMITTED_LOG, STANDBY_LOST_LOG, STANDBY_STARTED_LOG
from tests.e2e.conftest import RUN_BOUND_S, tiny, wait_for_snapshot

#: Still training after the deletions: each waits for the last replacement (about 30 s:
#: Ray drains a deleted node that long), and an idle machine trains ~8 steps a second.
MAX_STEPS = 1000
DELETIONS = 3


def _replaced(run: EmbeddedRun) -> int:
    return int(member_replacements(run.status()).get("worker", {}).get("count") or 0)


def _ready(run: EmbeddedRun, name: str) -> bool:
    """Whether pod ``name`` exists, is not being deleted, and is Ready."""
    try:
        pod = run.core.read_namespaced_pod(name, run.namespace)
    except kubernetes.client.ApiException as error:
        if error.status == 404:
            return False
        raise
    conditions = pod.status.conditions or []
    ready = any(c.type == "Ready" and c.status == "True" for c in conditions)
    return ready and pod.metadata.deletion_timestamp is None


def _worker_run(turn_level: bool, standby: int = 0) -> dict[str, Any]:
    # A Lease of 15 s: the trainer (the Ray head) is not the member under test, and Ray's
    # start on a shared machine can starve the 4 s Lease of the tiny run.
    workers = {"replicas": 2, "standby": standby}
    document = tiny(workers=workers, recovery={"leaseDurationSeconds": 15})
    run_spec = document["spec"]["run"]
    run_spec["grpo"]["maxSteps"] = MAX_STEPS
    run_spec["workers"] = {"backend": "ray", "generationWorkers": 2}
    if turn_level:  # a multi-turn task with turn-level snapshots (side effects per turn)
        run_spec["task"] = {
            "name": "reach_target",
            "datasetSize": 256,
            "maxOperand": 9,
            "maxTurns": 3,
            "maxNewTokens": 3,
        }
        run_spec["policy"]["maxSeqLen"] = 48
        run_spec["checkpointing"]["targetLevel"] = "turn"
    return document


def standby_pool(log: str) -> int:
    """How many started standbys the trainer's log says wait in the pool: the size the last
    start reported, less the admissions and losses after it (a loss of one still starting
    is counted too: never more than the pool holds)."""
    pool = 0
    for line in log.splitlines():
        if STANDBY_STARTED_LOG in line:
            pool = int(line.rsplit("(", 1)[1].split()[0])
        elif STANDBY_ADMITTED_LOG in line or STANDBY_LOST_LOG in line:
            pool = max(0, pool - 1)
    return pool


def _delete_workers_repeatedly(
    run: EmbeddedRun, deletions: int, pods: int = 2, standby: int = 0
) -> list[str]:
    """Delete a worker pod (alternating the index) each time the last replacement is
    counted, the pod is Ready, the trainer trained a step more and (``standby``) the
    standby pool is full again; the names deleted."""
    deleted = []
    for k in range(deletions):
        step = int(run.status().get("trainStep") or 0)
        eventually(
            lambda s=step: int(run.status().get("trainStep") or 0) > s,
            timeout=RUN_BOUND_S,
            what="a step trained since the last replacement",
        )
        name = f"{run.name}-i1-worker-{k % pods}"
        eventually(lambda n=name: _ready(run, n), timeout=RUN_BOUND_S, what=f"{name} Ready")
        eventually(
            lambda: standby_pool(_trainer_log(run)) >= standby,
            timeout=RUN_BOUND_S,
            what=f"{standby} started standby(s) in the pool",
        )
        run.delete_pod(name)
        deleted.append(name)
        eventually(lambda k=k: _replaced(run) > k, timeout=RUN_BOUND_S, what=f"replacement {k + 1}")
    return deleted


@pytest.mark.chaos
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("turn_level", [False, True], ids=["asynchronous", "turn-level"])
def test_worker_pods_deleted_repeatedly_are_replaced_within_one_incarnation(
    start_run: Any, turn_level: bool
) -> None:
    run = start_run(_worker_run(turn_level))
    wait_for_snapshot(run)
    deleted = _delete_workers_repeatedly(run, DELETIONS)
    # A generation call in flight on a lost worker ends as policy_unreachable within
    # seconds and is redispatched (before: it waited for the rollout timeout); the bound
    # stays generous for a shared machine.
    result, preempted = run.follow(timeout=RUN_BOUND_S * 6, interval=0.2)
    summary = run.summary(result, preempted)
    assert summary["result"] == "Succeeded", summary
    assert summary["steps"] == MAX_STEPS
    assert summary["incarnations"] == 1, summary  # the trainer (the Ray head) never restarted
    assert (summary["preemptions"], summary["restarts"]) == (0, 0)
    replaced = summary["member_replacements"]
    print(f"worker replacements (loss to Ready, s): {replaced.get('worker')}")
    # Each deletion is counted; on an overloaded machine a worker pod's own Ray start may
    # also time out: that pod fails, and is replaced (and counted) the same way.
    assert replaced["worker"]["count"] >= DELETIONS == len(deleted), replaced
    assert len(replaced["worker"]["recent_s"]) == replaced["worker"]["count"]
    assert "gym" not in replaced or replaced["gym"]["count"] == 0, replaced
    assert summary["audit"].get("ok") is True, summary["audit"]
    assert summary["audit_holds"]
    status = run.status()
    assert status["members"] and all(m["lostAt"] is None for m in status["members"])


def _trainer_log(run: EmbeddedRun) -> str:
    logs = sorted((run.work_dir / "cluster").glob("pods/*/*-trainer*/logs/trainer.log"))
    return "".join(log.read_text(errors="replace") for log in logs)


@pytest.mark.chaos
@pytest.mark.timeout(2400)
def test_standby_worker_pods_take_lost_workers_places_and_are_refilled(start_run: Any) -> None:
    """``spec.workers.standby: 1``: three worker pods (two serve, one waits); every pod
    deleted once in turn. Each lost serving worker's place is taken by the standby at once
    (the trainer's log says so), the operator refills the pool, one incarnation, the audit
    clean, and the operator counts exactly one replacement per deleted pod (a refill pod
    whose ``ray start`` missed Ray's 30 s bound tries again rather than being replaced).
    Each deletion waits for a started standby: deleted faster than a refill starts, every
    loss took the replacement path and none the standby's (seen once)."""
    run = start_run(_worker_run(False, standby=1))
    wait_for_snapshot(run)
    deleted = _delete_workers_repeatedly(run, DELETIONS, pods=3, standby=1)
    result, preempted = run.follow(timeout=RUN_BOUND_S * 6, interval=0.2)
    summary = run.summary(result, preempted)
    assert summary["result"] == "Succeeded", summary
    assert summary["incarnations"] == 1, summary
    replaced = summary["member_replacements"]
    assert replaced["worker"]["count"] == DELETIONS == len(deleted), replaced
    assert summary["audit"].get("ok") is True, summary["audit"]
    assert STANDBY_ADMITTED_LOG in _trainer_log(run)  # at least one deletion hit a serving pod
