"""The pure reconcile as tables, a run's life without losses: spec + observed children + time
-> actions, status, Events.

A new run creates its static children, its config and its Gym pods, and starts the trainer
only once every Gym serves; a running incarnation needs nothing (a child that went away is
recreated) and mirrors the trainer's Lease into status; the trainer's exit 0 ends the run;
``suspend`` stops the pods trainer first and a resume starts a new incarnation. What the CRD
schema cannot reject (a missing Secret, unusable storage, a name too long) becomes a
condition, not a crash, and every pass leaves its inputs untouched and writes a status the
CRD accepts. What ends an incarnation and how the next one starts is
test_reconcile_recovery.py: the two were one file until it outgrew the 600-line limit, and the
helpers both read a result with live in ``tests.support.rolloutruns``.
"""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
import yaml

from rolloutrun_operator import naming
from rolloutrun_operator.conditions import ConditionType, ended
from rolloutrun_operator.name_rules import max_run_name
from rolloutrun_operator.plan import Verb
from rolloutrun_operator.reconcile import reconcile
from tests.support.rolloutruns import (
    NOW,
    RUN,
    STATIC,
    cond,
    condition,
    gym,
    lease,
    make_run,
    members,
    observed,
    running_status,
    trainer,
    verbs,
)


def test_a_new_run_creates_its_static_children_config_and_gym_pods_first():
    result = reconcile(make_run(), observed(present=frozenset(), config=None), NOW)
    assert result.status.incarnation == 1
    assert verbs(result) == sorted(
        [
            "create ServiceAccount/demo-member",
            "create Role/demo-member",
            "create RoleBinding/demo-member",
            "create Secret/demo-gym-token",
            "create Secret/demo-metrics-token",
            "create Lease/demo-trainer",
            "create Service/demo-trainer",
            "create Service/demo-gym",
            "create NetworkPolicy/demo-gym-ingress",
            "create NetworkPolicy/demo-generation-ingress",
            "create ConfigMap/demo-config",
            "create Pod/demo-i1-gym-0",
            "create Pod/demo-i1-gym-1",
        ]
    )
    # the ConfigMap precedes the pods that mount it
    kinds = [action.kind for action in result.actions]
    assert kinds.index("ConfigMap") < kinds.index("Pod")
    config = next(a for a in result.actions if a.kind == "ConfigMap").manifest or {}
    assert set(config["data"]) == {naming.GYM_CONFIG_KEY}
    assert cond(result, "Ready") == ("False", "StartingGyms")
    assert cond(result, "Progressing") == ("True", "StartingGyms")
    assert [e.reason for e in result.events] == ["IncarnationStarting"]
    assert result.status.observed_generation == 1
    assert {c.type for c in result.status.conditions} == {
        "Ready",
        "Progressing",
        "Restarting",
        "Suspended",
        "Succeeded",
        "Failed",
    }


def test_the_trainer_starts_only_when_every_gym_pod_has_an_address():
    status = {"incarnation": 1, "conditions": []}
    waiting = reconcile(
        make_run(status),
        observed((gym(1, 0), gym(1, 1, pod_ip=None, phase="Pending"))),
        NOW,
    )
    assert not [a for a in waiting.actions if a.name.endswith("trainer")]
    assert waiting.requeue_after is not None
    unready = reconcile(make_run(status), observed((gym(1, 0), gym(1, 1, ready=False))), NOW)
    assert not [a for a in unready.actions if a.name.endswith("trainer")]
    assert cond(unready, "Ready") == ("False", "StartingGyms")
    started = reconcile(make_run(status), observed((gym(1, 0), gym(1, 1))), NOW)
    config = next(a for a in started.actions if a.kind == "ConfigMap")
    assert config.verb is Verb.REPLACE
    assert config.manifest is not None
    trainer_config = yaml.safe_load(config.manifest["data"][naming.CONFIG_KEY])
    assert trainer_config["gym"]["endpoints"] == [
        "http://127.0.0.10:8000",
        "http://127.0.0.11:8000",
    ]
    assert config.manifest["metadata"]["annotations"][naming.ANNOTATION_CONFIG_INCARNATION] == "1"
    assert [str(a) for a in started.actions][-1] == "create Pod/demo-i1-trainer"
    assert started.status.incarnation_start_time == "2026-01-01T12:01:00Z"
    assert cond(started, "Progressing") == ("True", "StartingTrainer")


def test_a_running_incarnation_is_ready_and_needs_nothing():
    result = reconcile(make_run(running_status()), observed(members(1)), NOW)
    assert result.actions == []
    assert cond(result, "Ready") == ("True", "Running")
    assert cond(result, "Progressing") == ("True", "Training")
    assert result.events == []
    assert result.requeue_after is not None


def test_progressing_names_the_goal_not_the_step_the_lease_mirror_moves_between_passes():
    """``status.trainStep`` is mirrored from the Lease between passes; a Progressing
    message naming the step reached read ``step 40 of 200`` at step 165 on the local cluster."""
    said = [
        condition(
            reconcile(make_run(running_status(trainStep=step)), observed(members(1)), NOW),
            "Progressing",
        )
        for step in (40, 165)
    ]
    assert said[0] == said[1] == ("True", "Training", "training toward step 30")


def test_a_static_child_gone_while_running_is_recreated_and_the_run_keeps_running():
    gone = {f"Service/{RUN}-trainer", f"NetworkPolicy/{RUN}-gym-ingress", f"Role/{RUN}-member"}
    result = reconcile(make_run(running_status()), observed(members(1), present=STATIC - gone), NOW)
    assert {f"{action.kind}/{action.name}" for action in result.actions} == gone
    assert {action.verb for action in result.actions} == {Verb.CREATE}
    assert cond(result, "Ready") == ("True", "Running")
    assert not [pod for pod in result.actions if pod.kind == "Pod"]


def test_a_config_map_gone_while_running_is_rendered_again_with_the_gyms_serving():
    result = reconcile(make_run(running_status()), observed(members(1), config=None), NOW)
    assert [str(action) for action in result.actions] == [f"create ConfigMap/{RUN}-config"]
    rendered = result.actions[0].manifest["data"][naming.CONFIG_KEY]
    assert "127.0.0.10" in rendered and "127.0.0.11" in rendered  # the serving Gyms
    assert cond(result, "Ready") == ("True", "Running")


def test_lease_annotations_are_mirrored_into_status():
    view = lease(
        1,
        NOW,
        train_step=12,
        anchor_step=10,
        latest_manifest="file:///data/demo/snapshots/s7/manifest.json",
        latest_manifest_time="2026-01-01T12:00:50Z",
    )
    result = reconcile(make_run(running_status()), observed(members(1), lease=view), NOW)
    status = result.status
    assert (status.train_step, status.anchor_step) == (12, 10)
    assert status.latest_manifest_uri == "file:///data/demo/snapshots/s7/manifest.json"
    assert status.latest_manifest_time == "2026-01-01T12:00:50Z"
    # the next lease expiry is when to look again: first seen now, leaseDuration + margin
    assert result.requeue_after == pytest.approx(17.0)


def test_trainer_exit_zero_succeeds_and_removes_the_gym_pods():
    pods = (trainer(1, phase="Succeeded", exit_code=0), gym(1, 0), gym(1, 1))
    result = reconcile(make_run(running_status()), observed(pods), NOW)
    assert cond(result, "Succeeded") == ("True", "MaxStepsReached")
    assert cond(result, "Progressing") == ("False", "Succeeded")
    # the other end says how the run ended, not "Running" (as it did before)
    assert cond(result, "Failed") == ("False", "Succeeded")
    assert verbs(result) == ["delete Pod/demo-i1-gym-0", "delete Pod/demo-i1-gym-1"]
    assert result.events[-1].reason == "Succeeded"
    again = reconcile(make_run(result.status.model_dump(by_alias=True)), observed(pods[:1]), NOW)
    assert again.actions == [] and cond(again, "Succeeded")[0] == "True"
    assert cond(again, "Failed") == ("False", "Succeeded")


def _at_generation(status: dict, generation: int):
    run = make_run(status)
    run.metadata["generation"] = generation
    return run


@pytest.mark.parametrize("exit_code", [0, 1])
def test_a_spec_change_after_the_end_is_not_applied_and_says_how_to_go_on(exit_code):
    """A finished run starts nothing again (maxSteps raised on a Succeeded run did nothing and
    said nothing): one Warning per change names the end and the way on; no pod is made."""
    pods = (trainer(1, phase="Succeeded" if exit_code == 0 else "Failed", exit_code=exit_code),)
    status = running_status(restarts=2) if exit_code else running_status()
    ended_now = reconcile(make_run(status), observed(pods), NOW)
    end = "Succeeded" if exit_code == 0 else "Failed"
    assert cond(ended_now, end)[0] == "True"
    assert "SpecChangeIgnored" not in [e.reason for e in ended_now.events]
    done = ended_now.status.model_dump(by_alias=True)
    changed = reconcile(_at_generation(done, 2), observed(pods), NOW)
    warning = [e for e in changed.events if e.reason == "SpecChangeIgnored"]
    assert [e.type for e in warning] == ["Warning"]
    assert f"the run has ended ({end}: " in warning[0].message
    assert "generation 2" in warning[0].message and "same name and storage" in warning[0].message
    assert not [a for a in verbs(changed) if a.startswith("create")]
    assert cond(changed, end)[0] == "True"
    # said once per change, not on every pass
    again = reconcile(
        _at_generation(changed.status.model_dump(by_alias=True), 2), observed(pods), NOW
    )
    assert "SpecChangeIgnored" not in [e.reason for e in again.events]


def test_a_spec_change_while_running_is_no_warning():
    result = reconcile(
        _at_generation(running_status(observedGeneration=1), 2), observed(members(1)), NOW
    )
    assert "SpecChangeIgnored" not in [e.reason for e in result.events]


def test_a_trainer_that_resumed_at_max_steps_leaves_the_status_at_max_steps():
    """Its exit 0 is the proof; it trained no step of its own, so its Lease says none (a
    run applied again over the storage of one that finished showed trainStep 0)."""
    fresh = running_status()
    fresh.pop("trainStep", None)
    pods = (trainer(1, phase="Succeeded", exit_code=0),)
    result = reconcile(make_run(fresh), observed(pods), NOW)
    assert cond(result, "Succeeded") == ("True", "MaxStepsReached")
    assert result.status.train_step == make_run(fresh).spec.run.grpo.max_steps


def test_suspend_stops_the_pods_then_reports_suspended_and_resume_starts_anew():
    run = make_run(running_status(), suspend=True)
    stopping = reconcile(run, observed(members(1)), NOW)
    # SIGTERM to the trainer: its forced snapshot still reaches the Gyms
    assert [str(a) for a in stopping.actions] == ["delete Pod/demo-i1-trainer"]
    assert cond(stopping, "Suspended") == ("True", "Suspending")
    snapshotted = reconcile(
        make_run(stopping.status.model_dump(by_alias=True), suspend=True),
        observed((trainer(1, phase="Failed", exit_code=143, deletion_time=NOW), *members(1)[1:])),
        NOW,
    )
    assert verbs(snapshotted) == ["delete Pod/demo-i1-gym-0", "delete Pod/demo-i1-gym-1"]
    assert cond(snapshotted, "Suspended") == ("True", "Suspending")
    stopped = reconcile(
        make_run(stopping.status.model_dump(by_alias=True), suspend=True), observed(), NOW
    )
    assert stopped.actions == [] and cond(stopped, "Suspended") == ("True", "Suspended")
    assert cond(stopped, "Ready")[0] == "False" and cond(stopped, "Progressing")[0] == "False"
    assert cond(stopped, "Succeeded") == cond(stopped, "Failed") == ("False", "Suspended")
    assert [e.reason for e in stopped.events] == ["Suspended"]
    resumed = reconcile(make_run(stopped.status.model_dump(by_alias=True)), observed(), NOW)
    assert resumed.status.incarnation == 2 and resumed.status.restarts == 0
    assert cond(resumed, "Suspended") == ("False", "Resumed")
    assert "create Pod/demo-i2-gym-0" in verbs(resumed)


PROBLEMS = [
    (
        "missing credentials secret",
        {"storage": {"uri": "gs://bucket-x/runs", "credentialsSecret": {"name": "gcs-key"}}},
        "SecretNotFound",
    ),
    (
        "missing env secret",
        {
            "trainer": {
                "env": [{"name": "K", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
            }
        },
        "SecretNotFound",
    ),
    (
        "storage without a directory",
        {"storage": {"uri": "file://", "volumeClaimName": "c"}},
        "StorageUnusable",
    ),
    (
        "claim with gs storage",
        {"storage": {"uri": "gs://bucket-x/p", "volumeClaimName": "pvc"}},
        "StorageUnusable",
    ),
]


@pytest.mark.parametrize(
    ("spec", "reason"), [row[1:] for row in PROBLEMS], ids=[row[0] for row in PROBLEMS]
)
def test_what_the_schema_cannot_reject_becomes_a_condition(spec, reason):
    result = reconcile(make_run(**spec), observed(), NOW)
    assert result.actions == []
    assert result.status.incarnation == 1  # numbered, not started
    assert cond(result, "Ready") == ("False", reason)
    assert cond(result, "Progressing") == ("False", reason)
    assert result.requeue_after is not None


def test_a_secret_created_later_lets_the_run_start():
    run = make_run(storage={"uri": "gs://bucket-x/runs", "credentialsSecret": {"name": "gcs-key"}})
    result = reconcile(run, observed(secrets=frozenset({"gcs-key"})), NOW)
    assert result.status.incarnation == 1
    assert "create Pod/demo-i1-gym-0" in verbs(result)


def test_a_long_run_name_is_a_condition_not_a_crash():
    run = make_run()
    run.metadata["name"] = "x" * (max_run_name(run.spec.gym.replicas) + 1)
    result = reconcile(run, observed(), NOW)
    assert cond(result, "Ready") == ("False", "InvalidSpec") and result.actions == []
    ready = next(c for c in result.status.conditions if c.type == "Ready")
    assert "trainer pod name" in ready.message and "DNS-1123 label" in ready.message


def test_transition_times_move_only_when_a_condition_flips():
    first = reconcile(make_run(running_status()), observed(members(1)), NOW)
    later = NOW + dt.timedelta(minutes=5)
    second = reconcile(
        make_run(first.status.model_dump(by_alias=True)), observed(members(1)), later
    )
    times = {c.type: c.last_transition_time for c in second.status.conditions}
    assert times["Ready"] == "2026-01-01T12:01:00Z"
    failed = (trainer(1, phase="Failed", exit_code=2), gym(1, 0), gym(1, 1))
    third = reconcile(make_run(second.status.model_dump(by_alias=True)), observed(failed), later)
    times = {c.type: c.last_transition_time for c in third.status.conditions}
    assert times["Ready"] == "2026-01-01T12:06:00Z"
    assert times["Failed"] == "2026-01-01T12:01:00Z"


def test_the_status_written_is_valid_against_the_crd():
    from rolloutrun_operator.api.validation import schema_problems

    result = reconcile(make_run(running_status()), observed((trainer(1, phase="Failed"),)), NOW)
    document = make_run().model_dump(mode="json", by_alias=True, exclude_none=True)
    document["status"] = result.status.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert schema_problems(document) == []


def test_reconcile_never_mutates_its_inputs():
    run = make_run(running_status())
    before = run.model_dump()
    seen = observed(members(1))
    reconcile(run, seen, NOW)
    assert run.model_dump() == before
    assert dataclasses.replace(seen) == seen
    assert seen.present >= STATIC and RUN == "demo"


def test_unsuspending_while_pods_still_stop_waits_for_them_under_a_new_number():
    run = make_run(running_status(), suspend=True)
    stopping = reconcile(run, observed(members(1)), NOW)
    terminating = tuple(dataclasses.replace(pod, deletion_time=NOW) for pod in members(1))
    resumed = reconcile(
        make_run(stopping.status.model_dump(by_alias=True)), observed(terminating), NOW
    )
    assert resumed.status.incarnation == 2
    assert resumed.actions == []  # no new pods while the forced snapshot may still publish
    assert cond(resumed, "Ready") == ("False", "StoppingPrevious")
    later = reconcile(make_run(resumed.status.model_dump(by_alias=True)), observed(), NOW)
    assert later.status.incarnation == 2 and "create Pod/demo-i2-gym-0" in verbs(later)


def test_only_succeeded_or_failed_can_end_a_run():
    assert ended(ConditionType.FAILED, "Unrestorable", "m")["succeeded"].reason == "Failed"
    with pytest.raises(ValueError, match="Ready is not how a run ends"):
        ended(ConditionType.READY, "Running", "")
