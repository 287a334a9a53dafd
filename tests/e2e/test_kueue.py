"""A RolloutRun admitted, evicted and readmitted by Kueue, on the local cluster with the real
trainer and Gym pods and the operator under the chart's rules.

Kueue is emulated only as far as the protocol needs (:mod:`tests.support.kueue_admitter`):
its Workload and ResourceFlavor CRDs and a test-side admitter writing the Workload's
status as Kueue's scheduler would. Queued: a Workload and no pod. Admitted: the run trains
on the admitted flavor's nodes. Evicted: the trainer's forced snapshot is published, then
the pods go, the run says why and the quota is given back. Readmitted: the next
incarnation resumes from that snapshot and the run ends Succeeded with a clean audit.
"""

from __future__ import annotations

import json

import pytest

from rolloutrun_localcluster.embedded import condition_of
from rolloutrun_localcluster.testing import eventually
from rolloutrun_operator import kueue
from tests.e2e.conftest import (
    RUN_BOUND_S,
    finish,
    run_starts,
    tiny,
    wait_for_snapshot,
)
from tests.support.kueue_admitter import CRDS, Admitter

WORKLOAD = "rolloutrun-tiny"
MAX_STEPS = 48


@pytest.mark.chaos  # minutes on two cores: `make chaos` (the default suite stays under 15 min)
def test_kueue_admits_evicts_with_a_forced_snapshot_and_readmits(start_run):
    document = tiny()
    document["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-queue"}
    document["spec"]["run"]["grpo"]["maxSteps"] = MAX_STEPS  # still training when evicted
    run = start_run(document, crds=CRDS)
    admitter = Admitter(run.api, run.namespace)

    # Queued: the run owns a Workload in its queue and has no pod.
    workload = eventually(lambda: admitter.workload(WORKLOAD), what="the run's Workload")
    assert workload["spec"]["queueName"] == "team-queue"
    assert [(s["name"], s["count"]) for s in workload["spec"]["podSets"]] == [
        ("trainer", 1),
        ("gym", 2),
    ]
    ready = eventually(lambda: condition_of(run.status(), "Ready"), what="a Ready condition")
    assert ready["reason"] == kueue.QUEUED, ready
    assert run.pods() == {}

    # Admitted on a flavor whose node label every local node carries.
    admitter.flavor("local", {"kubernetes.io/os": "linux"})
    admitter.admit(WORKLOAD, "local")
    wait_for_snapshot(run, at_least_step=2)
    trainer = run.pods()["tiny-i1-trainer"]
    assert trainer.spec.node_selector == {"kubernetes.io/os": "linux"}
    eventually(
        lambda: (admitter.condition(WORKLOAD, "PodsReady") or {}).get("status") == "True",
        what="PodsReady on the Workload",
    )

    # Evicted: forced snapshot, then the pods go, the run says why, the quota is released.
    admitter.evict(WORKLOAD, "Preempted", "Preempted to accommodate a higher priority Workload")
    eventually(lambda: admitter.released(WORKLOAD), timeout=RUN_BOUND_S, what="quota released")
    assert run.pods() == {}
    status = run.status()
    assert condition_of(status, "Ready")["reason"] == kueue.EVICTED
    assert "Preempted" in condition_of(status, "Ready")["message"]
    assert condition_of(status, "Suspended")["reason"] == "Suspended"
    assert (admitter.condition(WORKLOAD, "Requeued") or {}).get("status") == "True"
    snapshots = [
        json.loads(line) for line in (run.log_dir / "snapshots.jsonl").read_text().splitlines()
    ]
    forced = [s for s in snapshots if s.get("reason") == "preemption"]
    # One, or two when the step the notice found begun committed after the first's cut.
    outcomes = [s["rollout/checkpoint_outcome"] for s in forced]
    assert outcomes in (["published"], ["published"] * 2), snapshots
    evicted_at = int(run.status()["trainStep"])

    # Readmitted: the next incarnation resumes from that snapshot and finishes.
    admitter.admit(WORKLOAD, "local")
    summary = finish(run)
    assert summary["result"] == "Succeeded", summary
    assert summary["steps"] == MAX_STEPS
    assert summary["incarnations"] == 2
    assert (summary["restarts"], summary["preemptions"]) == (0, 0)  # an eviction is neither
    first, second = run_starts(run)
    assert first["snapshot_id"] is None
    assert second["snapshot_id"] is not None and second["resumed_from"] is not None
    assert evicted_at < MAX_STEPS
    assert summary["audit"].get("ok") is True, summary["audit"]
    assert summary["audit_holds"]
    finished = admitter.condition(WORKLOAD, "Finished")
    assert finished is not None and finished["status"] == "True", finished
