"""Kueue admission as tables: the run + its Workload + what is left of its pods -> actions,
status and Events (the pure :func:`rolloutrun_operator.kueue.gate` inside ``reconcile``)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from rolloutrun_operator import kueue
from rolloutrun_operator.api.validation import parse_rolloutrun
from rolloutrun_operator.plan import Verb
from rolloutrun_operator.reconcile import reconcile
from tests.support.rolloutruns import (
    BASE,
    NOW,
    gym,
    make_run,
    members,
    observed,
    running_status,
    trainer,
)
from tests.support.rolloutruns import (
    condition as cond,
)

WORKLOAD = "rolloutrun-demo"


def queued_run(status: dict[str, Any] | None = None, **labels: str) -> Any:
    document = copy.deepcopy(BASE)
    document["metadata"]["labels"] = {kueue.QUEUE_LABEL: "team-a", **labels}
    document["spec"]["gym"]["resources"] = {"requests": {"cpu": "2"}}
    if status is not None:
        document["status"] = status
    return parse_rolloutrun(document)


def workload(*conditions: dict[str, Any], admission: dict[str, Any] | None = None) -> Any:
    status: dict[str, Any] = {"conditions": list(conditions)}
    if admission is not None:
        status["admission"] = admission
    return {
        "apiVersion": kueue.API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": WORKLOAD,
            "namespace": "ns",
            "resourceVersion": "7",
            "ownerReferences": [{"kind": "RolloutRun", "uid": "uid-1", "controller": True}],
        },
        "spec": kueue.workload_manifest(queued_run(), "team-a")["spec"],
        "status": status,
    }


def condition(kind: str, status: bool, reason: str, message: str = "") -> dict[str, Any]:
    value = "True" if status else "False"
    return {"type": kind, "status": value, "reason": reason, "message": message}


ADMISSION = {
    "clusterQueue": "cluster-a",
    "podSetAssignments": [
        {"name": "trainer", "flavors": {"cpu": "gpu-a100", "memory": "gpu-a100"}, "count": 1},
        {"name": "gym", "flavors": {"cpu": "spot"}, "count": 2},
    ],
}
FLAVORS = {
    "gpu-a100": {"spec": {"nodeLabels": {"pool": "a100"}}},
    "spot": {
        "spec": {
            "nodeLabels": {"pool": "spot"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        }
    },
}
ADMITTED = workload(
    condition("QuotaReserved", True, "QuotaReserved"),
    condition("Admitted", True, "Admitted"),
    admission=ADMISSION,
)


def evicted(reason: str) -> Any:
    return workload(
        condition("QuotaReserved", True, "QuotaReserved"),
        condition("Admitted", True, "Admitted"),
        condition("PodsReady", True, "PodsReady"),
        condition("Evicted", True, reason, "Preempted to accommodate a higher priority Workload"),
        admission=ADMISSION,
    )


def of_kind(result: Any, kind: str) -> list[Any]:
    return [action for action in result.actions if action.kind == kind]


def test_a_run_without_the_queue_label_never_touches_kueue():
    result = reconcile(make_run(), observed(present=frozenset(), config=None), NOW)
    assert of_kind(result, "Workload") == []
    assert of_kind(result, "Pod")  # starts at once, as before


def test_a_queued_run_creates_its_workload_and_no_pod_until_admitted():
    result = reconcile(queued_run(), observed(present=frozenset(), config=None), NOW)
    assert [str(a) for a in result.actions] == [f"create Workload/{WORKLOAD}"]
    manifest = result.actions[0].manifest
    assert manifest["spec"]["queueName"] == "team-a"
    sets = {s["name"]: s for s in manifest["spec"]["podSets"]}
    assert (sets["trainer"]["count"], sets["gym"]["count"]) == (1, 2)
    (gym_container,) = sets["gym"]["template"]["spec"]["containers"]
    assert gym_container["resources"]["requests"]["cpu"] == "2"
    assert manifest["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert manifest["metadata"]["ownerReferences"][0]["controller"] is True
    assert cond(result, "Suspended")[:2] == ("True", "Suspended")
    assert cond(result, "Ready")[:2] == ("False", kueue.QUEUED)
    assert result.status.incarnation == 0
    assert [e.message for e in result.events] == [
        f"Workload {WORKLOAD} created in queue team-a; waiting for admission"
    ]


def test_the_priority_label_becomes_the_workload_priority_class():
    run = queued_run(**{kueue.PRIORITY_LABEL: "high"})
    (create,) = reconcile(run, observed(present=frozenset(), config=None), NOW).actions
    assert create.manifest["spec"]["priorityClassName"] == "high"
    assert create.manifest["spec"]["priorityClassSource"] == "kueue.x-k8s.io/workloadpriorityclass"


def test_a_pending_workload_keeps_the_run_held_and_says_why():
    pending = workload(condition("QuotaReserved", False, "Pending", "insufficient quota for cpu"))
    result = reconcile(queued_run(), observed(present=frozenset(), workload=pending), NOW)
    assert result.actions == []
    status, reason, message = cond(result, "Ready")
    assert (status, reason) == ("False", kueue.QUEUED)
    assert "insufficient quota for cpu" in message
    assert result.requeue_after is None  # the Workload's events wake it


def test_a_workload_someone_else_owns_is_not_taken_for_the_runs_own():
    foreign = copy.deepcopy(ADMITTED)
    foreign["metadata"]["ownerReferences"][0]["uid"] = "other"
    result = reconcile(queued_run(), observed(present=frozenset(), workload=foreign), NOW)
    assert [str(a) for a in result.actions] == [f"create Workload/{WORKLOAD}"]
    assert of_kind(result, "Pod") == []


def test_admission_starts_the_run_on_the_admitted_flavors():
    seen = observed(present=frozenset(), config=None, workload=ADMITTED, flavors=FLAVORS)
    result = reconcile(queued_run(), seen, NOW)
    assert result.status.incarnation == 1
    assert cond(result, "Suspended")[:2] == ("False", "NotSuspended")
    assert [e.message for e in result.events] == ["incarnation 1 (Admitted)"]
    pods = of_kind(result, "Pod")
    assert len(pods) == 2  # the Gyms first, as without Kueue
    for pod in pods:
        spec = pod.manifest["spec"]
        assert spec["nodeSelector"] == {"pool": "spot"}
        assert spec["tolerations"] == [
            {"key": "spot", "operator": "Exists", "effect": "NoSchedule"}
        ]


def test_the_admitted_trainer_goes_on_its_own_flavor():
    ready = tuple(dataclasses.replace(gym(1, i), incarnation=1) for i in range(2))
    seen = observed(ready, workload=ADMITTED, flavors=FLAVORS)
    status = {"incarnation": 1, "conditions": [condition("Suspended", False, "NotSuspended")]}
    result = reconcile(queued_run(status), seen, NOW)
    (pod,) = of_kind(result, "Pod")
    assert pod.name == "demo-i1-trainer"
    assert pod.manifest["spec"]["nodeSelector"] == {"pool": "a100"}
    assert "tolerations" not in pod.manifest["spec"]


def test_running_members_mark_the_workload_pods_ready_once():
    run = queued_run(running_status())
    result = reconcile(run, observed(members(1), workload=ADMITTED), NOW)
    (patch,) = of_kind(result, "Workload")
    assert patch.verb is Verb.PATCH_STATUS
    assert patch.manifest["metadata"]["resourceVersion"] == "7"
    marked = {c["type"]: c["status"] for c in patch.manifest["status"]["conditions"]}
    assert marked["PodsReady"] == "True"
    ready = copy.deepcopy(ADMITTED)
    ready["status"]["conditions"].append(condition("PodsReady", True, "PodsReady"))
    assert of_kind(reconcile(run, observed(members(1), workload=ready), NOW), "Workload") == []


def test_eviction_stops_the_trainer_first_and_keeps_the_quota_until_pods_are_gone():
    run = queued_run(running_status())
    result = reconcile(run, observed(members(1), workload=evicted("Preempted")), NOW)
    assert [str(a) for a in result.actions] == ["delete Pod/demo-i1-trainer"]
    status, reason, message = cond(result, "Ready")
    assert (status, reason) == ("False", kueue.EVICTED)
    assert "Preempted" in message and "higher priority" in message
    assert cond(result, "Suspended")[:2] == ("True", "Suspending")


def test_eviction_deletes_the_gyms_once_the_trainer_exited():
    run = queued_run(running_status())
    done = (trainer(1, phase="Succeeded"), gym(1, 0), gym(1, 1))
    result = reconcile(run, observed(done, workload=evicted("Preempted")), NOW)
    assert sorted(str(a) for a in result.actions) == [
        "delete Pod/demo-i1-gym-0",
        "delete Pod/demo-i1-gym-1",
        "delete Pod/demo-i1-trainer",
    ]
    assert of_kind(result, "Workload") == []


def test_eviction_with_the_pods_gone_gives_the_quota_back_as_kueue_expects():
    run = queued_run(running_status())
    result = reconcile(run, observed((), workload=evicted("Preempted")), NOW)
    (release,) = of_kind(result, "Workload")
    assert release.verb is Verb.PATCH_STATUS
    status = release.manifest["status"]
    assert status["admission"] is None
    by_type = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
    assert by_type["QuotaReserved"] == ("False", "Pending")
    assert by_type["Admitted"] == ("False", "NoReservation")
    assert by_type["Requeued"] == ("True", "Preempted")
    assert by_type["Evicted"] == ("True", "Preempted")  # Kueue's to clear on readmission
    assert by_type["PodsReady"] == ("False", "WaitForStart")  # the next pods are not yet
    assert cond(result, "Suspended")[:2] == ("True", "Suspended")
    assert [e.reason for e in result.events] == [kueue.EVICTED]


def test_a_deactivated_workload_is_not_requeued():
    result = reconcile(
        queued_run(running_status()), observed((), workload=evicted("InactiveWorkload")), NOW
    )
    (release,) = of_kind(result, "Workload")
    by_type = {c["type"]: c["status"] for c in release.manifest["status"]["conditions"]}
    assert by_type["Requeued"] == "False"


def test_readmission_starts_the_next_incarnation_from_the_latest_manifest():
    status = running_status(latestManifestUri="file:///data/demo/manifests/m-00040.json")
    status["conditions"] += [condition("Suspended", True, "Suspended")]
    readmitted = copy.deepcopy(ADMITTED)
    readmitted["status"]["conditions"].append(condition("Evicted", False, "QuotaReserved"))
    seen = observed((), config=None, workload=readmitted, flavors=FLAVORS)
    result = reconcile(queued_run(status), seen, NOW)
    assert result.status.incarnation == 2
    assert cond(result, "Suspended")[:2] == ("False", "Resumed")
    (config,) = of_kind(result, "ConfigMap")
    assert "m-00040.json" in str(config.manifest["data"])


def test_a_finished_run_finishes_its_workload():
    status = running_status()
    status["conditions"].append(condition("Succeeded", True, "MaxStepsReached", "trained"))
    result = reconcile(queued_run(status), observed((), workload=ADMITTED), NOW)
    (finish,) = of_kind(result, "Workload")
    by_type = {
        c["type"]: (c["status"], c["reason"]) for c in finish.manifest["status"]["conditions"]
    }
    assert by_type["Finished"] == ("True", "MaxStepsReached")


def test_spec_suspend_still_wins_over_an_admission():
    document_status = running_status()
    run = queued_run(document_status)
    run.spec.suspend = True
    result = reconcile(run, observed(members(1), workload=ADMITTED), NOW)
    assert cond(result, "Ready")[:2] == ("False", "Suspended")


def test_a_deleted_workload_is_recreated_and_the_run_stops_until_admitted_again():
    """As Kueue's job controllers do: no Workload means no admission."""
    run = queued_run(running_status())
    result = reconcile(run, observed(members(1), workload=None), NOW)
    assert [str(a) for a in result.actions] == [
        f"create Workload/{WORKLOAD}",
        "delete Pod/demo-i1-trainer",
    ]
    assert cond(result, "Ready")[:2] == ("False", kueue.QUEUED)


def resized_run(status: dict[str, Any] | None = None) -> Any:
    """The queued run with three Gyms of 4 CPUs instead of two of 2."""
    run = queued_run(status)
    document = run.model_dump(by_alias=True, exclude_none=True)
    document["spec"]["gym"]["replicas"] = 3
    document["spec"]["gym"]["resources"] = {"requests": {"cpu": "4"}}
    return parse_rolloutrun(document)


def test_a_size_change_updates_a_workload_without_a_reservation_in_place():
    pending = workload(condition("QuotaReserved", False, "Pending", "insufficient quota"))
    result = reconcile(resized_run(), observed(present=frozenset(), workload=pending), NOW)
    (update,) = of_kind(result, "Workload")
    assert update.verb is Verb.REPLACE
    assert update.manifest["metadata"]["resourceVersion"] == "7"  # not over Kueue's write
    sets = {s["name"]: s for s in update.manifest["spec"]["podSets"]}
    assert sets["gym"]["count"] == 3
    (container,) = sets["gym"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"] == "4"
    assert cond(result, "Ready")[:2] == ("False", kueue.QUEUED)
    assert of_kind(result, "Pod") == []
    # the unchanged run leaves its Workload alone
    assert (
        of_kind(
            reconcile(queued_run(), observed(present=frozenset(), workload=pending), NOW),
            "Workload",
        )
        == []
    )


def test_a_size_change_under_an_admission_stops_the_members_then_requeues():
    """podSets are immutable while quota is reserved: never updated, the Workload is
    deleted once the members are gone (the trainer first: its forced snapshot)."""
    run = resized_run(running_status())
    result = reconcile(run, observed(members(1), workload=ADMITTED), NOW)
    assert [str(a) for a in result.actions] == ["delete Pod/demo-i1-trainer"]
    status, reason, message = cond(result, "Ready")
    assert (status, reason) == ("False", kueue.RESIZED)
    assert f"Workload {WORKLOAD}" in message
    gone = copy.deepcopy(ADMITTED)
    gone["metadata"]["uid"] = "wl-1"
    result = reconcile(run, observed((), workload=gone), NOW)
    (delete,) = of_kind(result, "Workload")
    assert (delete.verb, delete.uid) == (Verb.DELETE, "wl-1")
    assert of_kind(result, "Pod") == []
    # and with no Workload the next pass queues the new size
    (create,) = reconcile(run, observed((), workload=None), NOW).actions
    assert {s["name"]: s["count"] for s in create.manifest["spec"]["podSets"]} == {
        "trainer": 1,
        "gym": 3,
    }


def test_only_what_kueue_sees_counts_as_a_change():
    base = kueue.workload_manifest(queued_run(), "team-a")["spec"]["podSets"]
    other = copy.deepcopy(base)
    other[1]["template"]["spec"]["containers"][0]["env"].append({"name": "X", "value": "1"})
    assert kueue.pod_sets_shape(other) == kueue.pod_sets_shape(base)
    other[1]["template"]["spec"]["tolerations"] = [{"key": "spot", "operator": "Exists"}]
    assert kueue.pod_sets_shape(other) != kueue.pod_sets_shape(base)
