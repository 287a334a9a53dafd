"""The pure reconcile as tables: spec + observed children + time -> actions, status, Events."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest
import yaml

from rolloutrun_operator import naming
from rolloutrun_operator.api.v1alpha1 import RecoveryPolicy
from rolloutrun_operator.name_rules import max_run_name
from rolloutrun_operator.observe import NodeView
from rolloutrun_operator.plan import Verb, backoff_seconds
from rolloutrun_operator.reconcile import IDLE_REQUEUE_SECONDS, reconcile
from tests.support.rolloutruns import (
    NOW,
    RUN,
    STATIC,
    T0,
    condition,
    gym,
    lease,
    make_run,
    members,
    observed,
    running_status,
    trainer,
)


def cond(result, kind):
    return condition(result, kind)[:2]


def verbs(result):
    return sorted(str(action) for action in result.actions)


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


LOSSES = [
    # (what happened, pods, extra observed fields, reason, counts as failure, deleted now):
    # the trainer goes first; a live Gym pod stays while its trainer may still snapshot
    (
        "trainer failed",
        (trainer(1, phase="Failed", exit_code=1),),
        {},
        "TrainerFailed",
        True,
        {"trainer"},
    ),
    ("gym pod deleted", (trainer(1), gym(1, 0)), {}, "PodDeleted", False, {"trainer"}),
    ("trainer deleted", (gym(1, 0), gym(1, 1)), {}, "PodDeleted", False, {"gym-0", "gym-1"}),
    (
        "trainer preempted",
        (trainer(1, phase="Failed", exit_code=143, disruption="PreemptionByScheduler"),),
        {},
        "PreemptionByScheduler",
        False,
        {"trainer"},
    ),
    (
        "gym evicted",
        (trainer(1), gym(1, 0, phase="Failed", status_reason="Evicted"), gym(1, 1)),
        {},
        "Evicted",
        False,
        {"trainer", "gym-0"},
    ),
    (
        "gym terminating",
        (trainer(1), gym(1, 0, deletion_time=NOW), gym(1, 1)),
        {},
        "PodDeleted",
        False,
        {"trainer"},
    ),
    (
        "gym exited",
        (trainer(1), gym(1, 0, phase="Succeeded", exit_code=0), gym(1, 1)),
        {},
        "GymExited",
        True,
        {"trainer", "gym-0"},
    ),
    (
        "trainer never took its lease",
        (trainer(1, started=NOW - dt.timedelta(seconds=900)), gym(1, 0), gym(1, 1)),
        {"lease": lease(0, NOW)},
        "LeaseNotAcquired",
        True,
        {"trainer", "gym-0", "gym-1"},
    ),
    (
        "node lost",
        members(1),
        {"nodes": {"node-a": NodeView("node-a", False, NOW - dt.timedelta(seconds=41))}},
        "NodeLost",
        False,
        {"trainer", "gym-0", "gym-1"},
    ),
]


@pytest.mark.parametrize(
    ("pods", "extra", "reason", "failure", "deleted"),
    [row[1:] for row in LOSSES],
    ids=[row[0] for row in LOSSES],
)
def test_any_lost_member_ends_the_incarnation_without_elastic_members(
    pods, extra, reason, failure, deleted
):
    run = make_run(running_status(), recovery={"elasticMembers": False})
    result = reconcile(run, observed(pods, **extra), NOW)
    status = result.status
    assert cond(result, "Restarting") == ("True", reason)
    assert cond(result, "Ready")[0] == "False"
    assert (status.restarts, status.preemptions) == ((1, 0) if failure else (0, 1))
    assert status.last_failure is not None and status.last_failure.reason == reason
    assert status.last_failure.time == "2026-01-01T12:01:00Z"
    assert status.incarnation == 1 and status.incarnation_start_time is None
    # only a failure backs off (backoffSeconds: 5) and counts as a loss in a row
    assert status.next_start_time == ("2026-01-01T12:01:05Z" if failure else "2026-01-01T12:01:00Z")
    assert status.consecutive_losses == (1 if failure else 0)
    assert {a.name for a in result.actions if a.verb is Verb.DELETE} == {
        f"demo-i1-{short}" for short in deleted
    }
    assert [(e.type, e.reason) for e in result.events] == [("Warning", reason)]
    assert result.requeue_after == (5 if failure else 0)


def test_pods_on_a_lost_node_are_force_deleted():
    nodes = {"node-a": NodeView("node-a", False, NOW - dt.timedelta(seconds=100))}
    result = reconcile(make_run(running_status()), observed(members(1), nodes=nodes), NOW)
    assert {a.grace_seconds for a in result.actions} == {0}


def test_a_node_not_ready_within_the_timeout_is_waited_for():
    nodes = {"node-a": NodeView("node-a", False, NOW - dt.timedelta(seconds=10))}
    result = reconcile(make_run(running_status()), observed(members(1), nodes=nodes), NOW)
    assert result.actions == [] and result.status.restarts == 0
    assert result.requeue_after == pytest.approx(30.0)


def test_an_expired_lease_of_an_older_incarnation_is_not_a_loss():
    stale = lease(1, NOW - dt.timedelta(seconds=100))
    result = reconcile(make_run(running_status(2)), observed(members(2), lease=stale), NOW)
    assert result.actions == [] and cond(result, "Ready") == ("True", "Running")


def test_failures_past_max_restarts_fail_the_run_but_preemptions_never_do():
    failed = (trainer(1, phase="Failed", exit_code=1), gym(1, 0), gym(1, 1))
    result = reconcile(make_run(running_status(restarts=2, preemptions=7)), observed(failed), NOW)
    assert cond(result, "Failed") == ("True", "RestartLimitExceeded")
    assert "TrainerFailed" in next(
        c.message for c in result.status.conditions if c.type == "Failed"
    )
    assert cond(result, "Progressing") == ("False", "Failed")
    assert cond(result, "Restarting") == ("False", "Failed")
    assert result.status.restarts == 2
    assert {a.name for a in result.actions} == {p.name for p in failed}
    assert result.events[-1].reason == "RestartLimitExceeded"

    preempted = (
        trainer(1, phase="Failed", disruption="DeletionByTaintManager"),
        gym(1, 0),
        gym(1, 1),
    )
    result = reconcile(make_run(running_status(restarts=2)), observed(preempted), NOW)
    assert cond(result, "Failed")[0] == "False"
    assert result.status.preemptions == 1 and result.status.restarts == 2


def test_a_failed_run_stays_failed_and_removes_leftover_pods():
    status = running_status(conditions=[{"type": "Failed", "status": "True", "reason": "X"}])
    result = reconcile(make_run(status), observed(members(1)), NOW)
    assert verbs(result) == ["delete Pod/demo-i1-trainer"]  # the trainer first
    result = reconcile(make_run(status), observed(members(1)[1:]), NOW)
    assert verbs(result) == ["delete Pod/demo-i1-gym-0", "delete Pod/demo-i1-gym-1"]
    assert result.status.incarnation == 1


def restarting(next_start: str, **fields):
    return running_status(
        incarnationStartTime=None,
        nextStartTime=next_start,
        lastFailure={"reason": "TrainerFailed", "pod": "demo-i1-trainer"},
        latestManifestUri="file:///data/demo/snapshots/s3/manifest.json",
        conditions=[{"type": "Restarting", "status": "True", "reason": "TrainerFailed"}],
        **fields,
    )


def test_the_next_incarnation_waits_for_the_backoff_and_the_old_pods():
    early = reconcile(make_run(restarting("2026-01-01T12:01:30Z")), observed(), NOW)
    assert early.actions == [] and early.status.incarnation == 1
    assert early.requeue_after == pytest.approx(30.0)
    assert cond(early, "Restarting") == ("True", "TrainerFailed")

    terminating = (gym(1, 0, deletion_time=NOW),)
    held = reconcile(make_run(restarting("2026-01-01T12:00:30Z")), observed(terminating), NOW)
    assert held.actions == [] and held.status.incarnation == 1

    stuck = (gym(1, 0, deletion_time=NOW - dt.timedelta(seconds=31)),)
    forced = reconcile(make_run(restarting("2026-01-01T12:00:30Z")), observed(stuck), NOW)
    assert [str(a) for a in forced.actions] == ["delete Pod/demo-i1-gym-0 (grace 0s)"]


def test_new_gym_pods_start_while_the_old_trainer_publishes_its_forced_snapshot():
    old_trainer = trainer(1, deletion_time=NOW)
    first = reconcile(make_run(restarting("2026-01-01T12:00:30Z")), observed((old_trainer,)), NOW)
    assert first.status.incarnation == 2
    assert {a.name for a in first.actions if a.kind == "Pod"} == {"demo-i2-gym-0", "demo-i2-gym-1"}
    assert not [a for a in first.actions if a.verb is Verb.DELETE]  # it is stopping already
    status = first.status.model_dump(by_alias=True)
    gyms_up = (old_trainer, gym(2, 0), gym(2, 1))
    waiting = reconcile(make_run(status), observed(gyms_up), NOW)
    assert "Pod/demo-i2-trainer" not in {f"{a.kind}/{a.name}" for a in waiting.actions}
    assert cond(waiting, "Ready") == ("False", "StoppingPrevious")
    gone = reconcile(make_run(status), observed(gyms_up[1:]), NOW)
    assert "create Pod/demo-i2-trainer" in verbs(gone)


def test_the_next_incarnation_resumes_from_the_latest_manifest():
    result = reconcile(make_run(restarting("2026-01-01T12:00:30Z")), observed(), NOW)
    assert result.status.incarnation == 2
    assert cond(result, "Restarting") == ("False", "Started")
    config = next(a for a in result.actions if a.kind == "ConfigMap").manifest or {}
    gym_config = yaml.safe_load(config["data"][naming.GYM_CONFIG_KEY])
    assert gym_config["checkpointing"]["resumeHint"].endswith("s3/manifest.json")
    assert config["metadata"]["annotations"][naming.ANNOTATION_CONFIG_INCARNATION] == "2"
    assert {a.name for a in result.actions if a.kind == "Pod"} == {"demo-i2-gym-0", "demo-i2-gym-1"}


def test_pods_of_older_incarnations_are_deleted():
    pods = (*members(2), gym(1, 0))
    result = reconcile(make_run(running_status(2)), observed(pods), NOW)
    assert verbs(result) == ["delete Pod/demo-i1-gym-0"]
    assert cond(result, "Ready") == ("True", "Running")


@pytest.mark.parametrize(
    ("losses", "expected"), [(0, 0), (1, 5), (2, 10), (3, 20), (4, 40), (5, 60), (40, 60)]
)
def test_backoff_is_exponential_and_capped(losses, expected):
    policy = RecoveryPolicy(backoff_seconds=5, max_backoff_seconds=60)
    assert backoff_seconds(policy, losses) == expected


def test_a_stable_period_resets_the_backoff():
    failed = (trainer(1, phase="Failed", exit_code=1), gym(1, 0), gym(1, 1))
    long_after = T0 + dt.timedelta(seconds=601)
    run = make_run(running_status(consecutiveLosses=4))
    assert reconcile(run, observed(failed), long_after).status.next_start_time == (
        "2026-01-01T12:10:06Z"
    )
    soon = reconcile(run, observed(failed), NOW).status
    assert soon.consecutive_losses == 5 and soon.next_start_time == "2026-01-01T12:02:00Z"


def test_trainer_exit_zero_succeeds_and_removes_the_gym_pods():
    pods = (trainer(1, phase="Succeeded", exit_code=0), gym(1, 0), gym(1, 1))
    result = reconcile(make_run(running_status()), observed(pods), NOW)
    assert cond(result, "Succeeded") == ("True", "MaxStepsReached")
    assert cond(result, "Progressing") == ("False", "Succeeded")
    assert verbs(result) == ["delete Pod/demo-i1-gym-0", "delete Pod/demo-i1-gym-1"]
    assert result.events[-1].reason == "Succeeded"
    again = reconcile(make_run(result.status.model_dump(by_alias=True)), observed(pods[:1]), NOW)
    assert again.actions == [] and cond(again, "Succeeded")[0] == "True"


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


def test_a_blocked_restart_never_reuses_the_old_incarnation_number():
    run = make_run(
        restarting("2026-01-01T12:00:30Z"),
        storage={"uri": "gs://bucket-x/runs", "credentialsSecret": {"name": "gcs-key"}},
    )
    blocked = reconcile(run, observed(), NOW)
    assert blocked.status.incarnation == 2 and blocked.actions == []
    assert cond(blocked, "Ready") == ("False", "SecretNotFound")
    again = reconcile(
        make_run(
            blocked.status.model_dump(by_alias=True),
            storage={"uri": "gs://bucket-x/runs", "credentialsSecret": {"name": "gcs-key"}},
        ),
        observed(secrets=frozenset({"gcs-key"})),
        NOW,
    )
    assert again.status.incarnation == 2
    assert "create Pod/demo-i2-gym-0" in verbs(again)


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


def test_a_trainer_starting_within_the_acquire_timeout_is_waited_for():
    pods = (trainer(1, started=NOW - dt.timedelta(seconds=100)), gym(1, 0), gym(1, 1))
    result = reconcile(make_run(running_status()), observed(pods), NOW)
    assert result.actions == [] and cond(result, "Ready") == ("True", "Running")
    deadline = 800.0  # the acquire timeout (900 s) after the trainer started 100 s ago
    assert result.requeue_after == pytest.approx(min(deadline, IDLE_REQUEUE_SECONDS))
    off = make_run(running_status(), recovery={"leaseAcquireTimeoutSeconds": 0})
    late = (trainer(1, started=NOW - dt.timedelta(days=1)), gym(1, 0), gym(1, 1))
    assert reconcile(off, observed(late), NOW).actions == []


def test_the_trainer_stops_first_and_its_gyms_only_after_it_exited():
    """Finding 2: a Gym deleted under a live trainer leaves the other Gyms up until the
    trainer's forced snapshot is done, then the next incarnation starts at once (without
    elastic members: with them the Gym is replaced, test_members)."""
    classic = make_run(running_status(), recovery={"elasticMembers": False})
    lost = reconcile(classic, observed((trainer(1), gym(1, 1))), NOW)
    assert [str(a) for a in lost.actions] == ["delete Pod/demo-i1-trainer"]  # SIGTERM, own grace
    status = lost.status.model_dump(by_alias=True)

    snapshotting = (trainer(1, deletion_time=NOW + dt.timedelta(seconds=30)), gym(1, 1))
    held = reconcile(make_run(status), observed(snapshotting), NOW)
    assert held.actions == [] and held.status.incarnation == 1

    exited = (trainer(1, phase="Failed", exit_code=143, deletion_time=NOW), gym(1, 1))
    released = reconcile(make_run(status), observed(exited), NOW)
    assert verbs(released) == ["delete Pod/demo-i1-gym-1"]
    assert released.status.incarnation == 1
    trainer_gone = reconcile(make_run(status), observed((gym(1, 1),)), NOW)
    assert verbs(trainer_gone) == ["delete Pod/demo-i1-gym-1"]

    # the pass that sees the last old pod gone starts the next incarnation (no backoff)
    later = NOW + dt.timedelta(seconds=1)
    started = reconcile(make_run(status), observed(), later)
    assert started.status.incarnation == 2
    new_pods = {a.name for a in started.actions if a.kind == "Pod"}
    assert new_pods == {"demo-i2-gym-0", "demo-i2-gym-1"}


def test_gyms_of_an_older_incarnation_wait_for_its_trainer_too():
    run = make_run(running_status(2))
    pods = (trainer(1, deletion_time=NOW), gym(1, 0), *members(2))
    assert reconcile(run, observed(pods), NOW).actions == []
    assert verbs(reconcile(run, observed((gym(1, 0), *members(2))), NOW)) == [
        "delete Pod/demo-i1-gym-0"
    ]


def test_preemptions_do_not_back_off_and_failures_still_do():
    preempted = (gym(1, 0), gym(1, 1))  # the trainer deleted
    failed = (trainer(1, phase="Failed", exit_code=1), gym(1, 0), gym(1, 1))
    status = running_status()
    for _ in range(5):
        result = reconcile(make_run(status), observed(preempted), NOW)
        assert result.status.next_start_time == "2026-01-01T12:01:00Z"  # at once
        assert result.status.consecutive_losses == 0 and result.requeue_after == 0
        status = {**result.status.model_dump(by_alias=True), **running_status()}
    assert result.status.preemptions == 5
    status = running_status(restarts=0)
    waits = []
    for _ in range(2):
        result = reconcile(make_run(status, recovery={"maxRestarts": 9}), observed(failed), NOW)
        waits.append(result.status.next_start_time)
        status = {**result.status.model_dump(by_alias=True), **running_status()}
        status["restarts"] = result.status.restarts
        status["consecutiveLosses"] = result.status.consecutive_losses
    assert waits == ["2026-01-01T12:01:05Z", "2026-01-01T12:01:10Z"]
    # a preemption between failures neither waits nor resets the failures' backoff
    between = reconcile(make_run(status), observed(preempted), NOW).status
    assert between.next_start_time == "2026-01-01T12:01:00Z"
    assert between.consecutive_losses == 2


def test_a_member_that_will_not_exit_is_force_deleted_and_named():
    stuck = (trainer(1, deletion_time=NOW - dt.timedelta(seconds=31)), gym(1, 1))
    result = reconcile(make_run(restarting("2026-01-01T12:00:30Z")), observed(stuck), NOW)
    assert [str(a) for a in result.actions] == ["delete Pod/demo-i1-trainer (grace 0s)"]
    events = [(e.type, e.reason) for e in result.events]
    assert events == [("Warning", "StuckTerminating")]
    assert "demo-i1-trainer" in result.events[0].message
    progressing = next(c for c in result.status.conditions if c.type == "Progressing")
    assert "force-deleted demo-i1-trainer" in progressing.message
    # within its deadline it is waited for, and nothing is reported
    waiting = (trainer(1, deletion_time=NOW - dt.timedelta(seconds=29)), gym(1, 1))
    quiet = reconcile(make_run(restarting("2026-01-01T12:00:30Z")), observed(waiting), NOW)
    assert quiet.actions == [] and quiet.events == []
    assert quiet.requeue_after == pytest.approx(1.0)


UNRESTORABLE = [
    # (what exited, pod, reason, failed for good)
    (
        "trainer exit 78",
        trainer(
            1,
            phase="Failed",
            exit_code=78,
            terminated_message="INFO restore: trying s7\nrefused: config changed: nHeads\n",
        ),
        "Unrestorable",
        True,
    ),
    ("trainer exit 1", trainer(1, phase="Failed", exit_code=1), "TrainerFailed", False),
    (
        "trainer exit 78 while preempted",
        trainer(1, phase="Failed", exit_code=78, disruption="PreemptionByScheduler"),
        "PreemptionByScheduler",
        False,
    ),
    ("gym exit 78", gym(1, 0, phase="Failed", exit_code=78), "GymFailed", False),
]


@pytest.mark.parametrize(
    ("pod", "reason", "final"), [row[1:] for row in UNRESTORABLE], ids=[r[0] for r in UNRESTORABLE]
)
def test_an_unrestorable_trainer_fails_the_run_instead_of_restarting(pod, reason, final):
    others = tuple(p for p in members(1) if p.name != pod.name)
    classic = make_run(running_status(), recovery={"elasticMembers": False})  # a Gym ends it
    result = reconcile(classic, observed((pod, *others)), NOW)
    assert result.status.last_failure is not None and result.status.last_failure.reason == reason
    assert result.events[-1].reason == reason
    if not final:
        assert cond(result, "Failed")[0] == "False"
        assert cond(result, "Restarting") == ("True", reason)
        return
    assert cond(result, "Failed") == ("True", "Unrestorable")
    message = next(c.message for c in result.status.conditions if c.type == "Failed")
    assert "exit code 78" in message and message.endswith(": refused: config changed: nHeads")
    assert cond(result, "Restarting") == ("False", "Failed")
    assert cond(result, "Progressing") == ("False", "Failed")
    assert (result.status.restarts, result.status.next_start_time) == (0, None)
    again = reconcile(make_run(result.status.model_dump(by_alias=True)), observed(others), NOW)
    assert again.status.incarnation == 1 and cond(again, "Failed")[0] == "True"
    assert not [a for a in again.actions if a.verb is Verb.CREATE]
