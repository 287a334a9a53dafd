"""The pure helpers around a pass: the status merge patch and the lenient status reader."""

from __future__ import annotations

import datetime as dt

from rolloutrun_operator.actuator import (
    conflict_result,
    freed_result,
    in_steps,
    invalid_status,
    lenient_status,
    status_json,
)
from rolloutrun_operator.api.v1alpha1 import RolloutRunStatus
from rolloutrun_operator.api.validation import RolloutRunInvalid
from rolloutrun_operator.plan import Action, Verb


def test_cleared_fields_are_explicit_nulls_in_the_merge_patch():
    patch = status_json(RolloutRunStatus(incarnation=2))
    assert patch["nextStartTime"] is None and patch["lastFailure"] is None
    assert patch["incarnation"] == 2 and patch["conditions"] == []


def test_a_status_from_a_newer_operator_is_read_without_its_unknown_fields():
    status = lenient_status({"incarnation": 3, "restarts": 1, "futureField": {"x": 1}}, "ns/a")
    assert status is not None and (status.incarnation, status.restarts) == (3, 1)


def test_an_unreadable_status_keeps_its_incarnation():
    status = lenient_status({"incarnation": 5, "restarts": -4}, "ns/a")
    assert status is not None and status.incarnation == 5 and status.restarts == 0
    assert lenient_status(None, "ns/a") is None and lenient_status({}, "ns/a") is None


def test_an_invalid_spec_status_names_the_problem_and_keeps_transition_times():
    body = {
        "metadata": {"generation": 4},
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": "False",
                    "reason": "InvalidSpec",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                },
                {"type": "Bogus", "status": "Maybe"},
            ]
        },
    }
    problem = RolloutRunInvalid("x", ["spec.run.policy: dModel must be divisible by nHeads"])
    patch = invalid_status(body, problem, dt.datetime(2026, 1, 2, tzinfo=dt.UTC))
    assert patch["observedGeneration"] == 4
    ready = next(c for c in patch["conditions"] if c["type"] == "Ready")
    assert ready["reason"] == "InvalidSpec" and "divisible" in ready["message"]
    assert ready["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert {c["type"] for c in patch["conditions"]} == {"Ready", "Progressing"}


def test_a_conflict_on_create_keeps_the_last_status_and_names_the_object():
    from rolloutrun_operator.kube import ChildConflict
    from tests.support.rolloutruns import make_run, running_status

    run = make_run(running_status(3, restarts=1))
    conflict = ChildConflict("Pod/demo-i3-trainer", "no owner")
    now = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
    result = conflict_result(run, conflict, now)
    assert result.actions == [] and result.status.incarnation == 3
    assert result.status.restarts == 1
    ready = next(c for c in result.status.conditions if c.type == "Ready")
    assert ready.reason == "ChildConflict"
    assert "Pod/demo-i3-trainer exists and is not owned by this run (owner: no owner)" in (
        ready.message
    )
    assert [e.reason for e in result.events] == ["ChildConflict"]
    run.status = result.status  # the next pass meets the same object: no second Event
    assert conflict_result(run, conflict, now).events == []


def test_a_conflict_with_a_terminating_object_is_looked_at_again_soon():
    """Its name is free once it is gone, and no watch event tells the run (the object does
    not carry its label): the run must not wait for the idle requeue (20 min)."""
    from rolloutrun_operator.actuator import TERMINATING_HOLDER_RECHECK_SECONDS
    from rolloutrun_operator.kube import ChildConflict
    from rolloutrun_operator.reconcile import IDLE_REQUEUE_SECONDS
    from tests.support.rolloutruns import make_run, running_status

    run = make_run(running_status(1))
    now = dt.datetime(2026, 1, 2, tzinfo=dt.UTC)
    ending = conflict_result(run, ChildConflict("Pod/demo-i1-trainer", "no owner", True), now)
    staying = conflict_result(run, ChildConflict("Pod/demo-i1-trainer", "no owner"), now)
    assert ending.requeue_after == ending.other_requeue_after == TERMINATING_HOLDER_RECHECK_SECONDS
    assert staying.requeue_after == IDLE_REQUEUE_SECONDS
    assert ending.status == staying.status


def test_a_name_freed_on_create_keeps_the_last_status_and_looks_again_at_once():
    """Nothing this pass decided is claimed (a trainer it meant to create would otherwise
    count as launched, and then as lost), no Event, and the next pass without waiting."""
    from tests.support.rolloutruns import make_run, running_status

    run = make_run(running_status(3, restarts=1))
    assert run.status is not None
    run.status.incarnation_start_time = None
    result = freed_result(run)
    assert result.actions == [] and result.events == []
    assert status_json(result.status) == status_json(run.status)
    assert result.requeue_after == 0.0 and result.other_requeue_after == 0.0


def test_consecutive_deletes_form_one_step_every_other_action_its_own():
    """A lost trainer's Gym pods are deleted together (one round trip, not one each); a
    create after them still waits for them, and creates keep their order (the ConfigMap
    before the pods that mount it)."""
    delete = [Action(Verb.DELETE, "Pod", f"r-i1-gym-{i}") for i in range(2)]
    config = Action(Verb.REPLACE, "ConfigMap", "r-config", {})
    create = [Action(Verb.CREATE, "Pod", f"r-i2-gym-{i}", {}) for i in range(2)]
    lease = Action(Verb.DELETE, "Lease", "r-trainer")
    steps = in_steps([*delete, config, *create, lease])
    assert steps == [delete, [config], [create[0]], [create[1]], [lease]]
    assert in_steps([]) == []
