"""The pure reconcile as tables, losses and recovery: spec + observed children + time ->
actions, status, Events.

Which losses end an incarnation (a member failed, deleted, evicted, preempted or exited, a
node lost, a Lease never taken) and whether each counts as a failure or a preemption; what
is waited for instead (a node within its timeout, a trainer within its acquire timeout);
what fails the run for good (failures past ``maxRestarts``, an unrestorable trainer's exit
78); and how the next incarnation starts: after a backoff that only failures pay
(exponential, capped, reset by a stable period), once the old trainer has exited and its
forced snapshot is out, from the latest manifest, under a new number even while blocked, a
member stuck terminating force-deleted and named. Where a lost Gym is the subject, the tables
turn elastic members off (``recovery.elasticMembers: false``: any lost member ends the
incarnation); the elastic replacement of a Gym under its index is test_members.py. A run's
life without losses is test_reconcile_lifecycle.py: the two were one file until it outgrew
the 600-line limit.
"""

from __future__ import annotations

import datetime as dt

import pytest
import yaml

from rolloutrun_operator import naming
from rolloutrun_operator.api.v1alpha1 import RecoveryPolicy
from rolloutrun_operator.observe import NodeView
from rolloutrun_operator.plan import Verb, backoff_seconds
from rolloutrun_operator.reconcile import IDLE_REQUEUE_SECONDS, reconcile
from tests.support.rolloutruns import (
    NOW,
    T0,
    cond,
    gym,
    lease,
    make_run,
    members,
    observed,
    running_status,
    trainer,
    verbs,
)

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
    assert cond(result, "Succeeded") == ("False", "Failed")
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
    assert cond(result, "Succeeded") == ("False", "Failed")
    assert (result.status.restarts, result.status.next_start_time) == (0, None)
    again = reconcile(make_run(result.status.model_dump(by_alias=True)), observed(others), NOW)
    assert again.status.incarnation == 1 and cond(again, "Failed")[0] == "True"
    assert not [a for a in again.actions if a.verb is Verb.CREATE]
