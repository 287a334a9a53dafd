"""Generation workers as pods end to end: the trainer is the Ray head, two worker pods join
it from their own pod addresses, a worker pod deleted mid-run is replaced while the run
goes on with ONE incarnation, and the audit stays clean. Three Ray nodes on a shared
machine: under ``make chaos``. Waits are polls with generous bounds that only catch hangs.
"""

from __future__ import annotations

from typing import Any

import pytest

from rolloutrun_localcluster.embedded import EmbeddedRun, member_replacements
from rolloutrun_localcluster.testing import eventually
from tests.e2e.conftest import RUN_BOUND_S, tiny, wait_for_snapshot

MAX_STEPS = 400  # about two minutes: still training when the worker pod is deleted


def _replaced(run: EmbeddedRun) -> int:
    return int(member_replacements(run.status()).get("worker", {}).get("count") or 0)


@pytest.mark.chaos
@pytest.mark.timeout(1500)
def test_a_deleted_worker_pod_is_replaced_within_one_incarnation(start_run: Any) -> None:
    document = tiny(workers={"replicas": 2})
    run_spec = document["spec"]["run"]
    run_spec["grpo"]["maxSteps"] = MAX_STEPS
    run_spec["workers"] = {"backend": "ray", "generationWorkers": 2}
    run = start_run(document)
    wait_for_snapshot(run)
    run.delete_pod(f"{run.name}-i1-worker-0")
    eventually(lambda: _replaced(run) >= 1, timeout=RUN_BOUND_S * 2, what="worker replaced")
    # A generation call in flight on the lost worker ends as policy_unreachable within
    # seconds and is redispatched (before: it waited for the rollout timeout); the bound
    # stays generous for a shared machine.
    result, preempted = run.follow(timeout=RUN_BOUND_S * 3, interval=0.2)
    summary = run.summary(result, preempted)
    assert summary["result"] == "Succeeded", summary
    assert summary["steps"] == MAX_STEPS
    assert summary["incarnations"] == 1, summary  # the trainer (the Ray head) never restarted
    assert summary["member_replacements"]["worker"]["count"] == 1
    assert summary["audit"].get("ok") is True, summary["audit"]
