"""Elastic members as tables: a lost Gym of a running incarnation is recreated under its
index with the next member generation, counted, and told to the trainer on its Lease; only
the trainer's loss ends the incarnation, and a Gym that keeps failing is bounded."""

from __future__ import annotations

import dataclasses
import datetime as dt

from rolloutrun_operator import naming
from rolloutrun_operator.observe import pod_view
from rolloutrun_operator.plan import Verb
from rolloutrun_operator.reconcile import reconcile
from rolloutrun_runtime.contract.pod import parse_member_endpoints
from tests.support.rolloutruns import (
    NOW,
    condition,
    gym,
    lease,
    make_run,
    members,
    observed,
    running_status,
    trainer,
)

GEN_LABEL = naming.LABEL_MEMBER_GENERATION


def verbs(result):
    return sorted(str(action) for action in result.actions)


def again(result, **status):
    """The run as the next pass reads it: this pass's status written back."""
    return make_run({**result.status.model_dump(by_alias=True, mode="json"), **status})


def test_a_deleted_gym_is_recreated_under_its_index_and_the_incarnation_goes_on():
    result = reconcile(make_run(running_status()), observed((trainer(1), gym(1, 1))), NOW)
    assert verbs(result) == ["create Pod/demo-i1-gym-0"]  # the trainer is left alone
    created = result.actions[0].manifest
    assert created["metadata"]["labels"][GEN_LABEL] == "1"
    assert created["metadata"]["labels"][naming.LABEL_GYM_INDEX] == "0"
    status = result.status
    assert (status.incarnation, status.preemptions, status.restarts) == (1, 0, 0)
    assert status.last_failure is None
    [member] = status.members
    assert (member.role, member.index, member.generation) == ("gym", 0, 1)
    assert member.lost_at == "2026-01-01T12:01:00Z" and member.lost_reason == "PodDeleted"
    assert condition(result, "Ready")[:2] == ("False", "ReplacingMembers")
    assert condition(result, "Restarting")[0] == "False"
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "GymReplacing")]

    # the next pass before the new pod is seen creates it again (a 409 is done), no new loss
    still = reconcile(again(result), observed((trainer(1), gym(1, 1))), NOW)
    assert verbs(still) == ["create Pod/demo-i1-gym-0"]
    assert still.status.members[0].generation == 1 and still.events == []


def test_a_terminating_gym_is_waited_for_and_then_replaced():
    going = (trainer(1), gym(1, 0, deletion_time=NOW), gym(1, 1))
    first = reconcile(make_run(running_status()), observed(going), NOW)
    assert first.actions == []  # already being deleted; the same name must be free first
    assert first.status.members[0].generation == 1
    # the old pod (generation 0) still there: only waited for, not lost a second time
    later = NOW + dt.timedelta(seconds=2)
    waiting = reconcile(again(first), observed(going), later)
    assert waiting.actions == [] and waiting.status.members[0].generation == 1
    gone = reconcile(again(first), observed((trainer(1), gym(1, 1))), later)
    assert verbs(gone) == ["create Pod/demo-i1-gym-0"]
    assert gone.actions[0].manifest["metadata"]["labels"][GEN_LABEL] == "1"


def test_the_replacement_ready_is_counted_timed_and_its_address_written_on_the_lease():
    lost = reconcile(make_run(running_status()), observed((trainer(1), gym(1, 1))), NOW)
    ready_at = NOW + dt.timedelta(seconds=3.5)
    new = gym(1, 0, generation=1, pod_ip="127.0.0.99")
    view = lease(1, ready_at)
    done = reconcile(again(lost), observed((trainer(1), new, gym(1, 1)), lease=view), ready_at)
    [record] = done.status.member_replacements
    assert (record.role, record.count) == ("gym", 1)
    assert record.last_seconds == record.max_seconds == 3.5
    assert record.recent_seconds == [3.5]
    assert done.status.members[0].lost_at is None
    assert condition(done, "Ready")[:2] == ("True", "Running")
    [annotate] = done.actions
    assert (annotate.verb, annotate.kind, annotate.name) == (Verb.ANNOTATE, "Lease", "demo-trainer")
    text = annotate.manifest["metadata"]["annotations"][naming.member_endpoints_annotation("gym")]
    endpoints = parse_member_endpoints(text, 1)
    assert endpoints[0] == naming.MemberEndpoint(0, "http://127.0.0.99:8000", 1)
    assert endpoints[1] == naming.MemberEndpoint(1, "http://127.0.0.11:8000", 0)
    assert parse_member_endpoints(text, 2) == {}  # a later trainer never takes them

    # written once: the Lease carrying it, nothing more to do
    annotated = dataclasses.replace(view, endpoints={"gym": text})
    pods = (trainer(1), new, gym(1, 1))
    quiet = reconcile(again(done), observed(pods, lease=annotated), ready_at)
    assert quiet.actions == [] and quiet.status.member_replacements[0].count == 1


def test_a_started_replacement_is_announced_before_its_readiness_probe_passes():
    lost = reconcile(make_run(running_status()), observed((trainer(1), gym(1, 1))), NOW)
    starting = gym(1, 0, generation=1, pod_ip="127.0.0.77", ready=False)
    view = lease(1, NOW)
    result = reconcile(again(lost), observed((trainer(1), starting, gym(1, 1)), lease=view), NOW)
    [annotate] = [a for a in result.actions if a.verb is Verb.ANNOTATE]
    text = annotate.manifest["metadata"]["annotations"][naming.member_endpoints_annotation("gym")]
    assert parse_member_endpoints(text, 1)[0] == naming.MemberEndpoint(
        0, "http://127.0.0.77:8000", 1
    )
    assert result.status.members[0].lost_at is not None  # counted once Ready, not before
    assert result.status.member_replacements == []
    # the lost generation's address is never announced
    going = gym(1, 0, generation=0, pod_ip="127.0.0.10", ready=False, deletion_time=NOW)
    old = reconcile(again(lost), observed((trainer(1), going, gym(1, 1)), lease=view), NOW)
    for action in old.actions:
        if action.verb is Verb.ANNOTATE:
            notes = action.manifest["metadata"]["annotations"]
            text = notes[naming.member_endpoints_annotation("gym")]
            assert 0 not in parse_member_endpoints(text, 1)


def test_a_failed_gym_is_deleted_then_replaced_and_its_failures_are_bounded():
    crashed = gym(1, 0, phase="Failed", exit_code=1)
    run = make_run(running_status(), recovery={"maxMemberFailures": 2})
    first = reconcile(run, observed((trainer(1), crashed, gym(1, 1))), NOW)
    assert verbs(first) == ["delete Pod/demo-i1-gym-0"]
    assert first.status.members[0].failures == 1
    assert condition(first, "Ready")[:2] == ("False", "ReplacingMembers")

    # its replacement (generation 1) fails too: the second failure ends the incarnation
    crashed_again = gym(1, 0, phase="Failed", exit_code=1, generation=1)
    status = first.status.model_dump(by_alias=True, mode="json")
    second_run = make_run(status, recovery={"maxMemberFailures": 2})
    second = reconcile(second_run, observed((trainer(1), crashed_again, gym(1, 1))), NOW)
    assert second.status.last_failure.reason == "MemberFailuresExhausted"
    assert "gym 0 failed 2 times" in second.status.last_failure.message
    assert second.status.restarts == 1
    assert condition(second, "Restarting")[:2] == ("True", "MemberFailuresExhausted")
    assert "delete Pod/demo-i1-trainer" in verbs(second)


def test_a_preempted_gym_costs_no_failure_and_the_trainer_still_ends_the_incarnation():
    evicted = gym(1, 1, phase="Failed", status_reason="Evicted")
    result = reconcile(make_run(running_status()), observed((trainer(1), gym(1, 0), evicted)), NOW)
    assert verbs(result) == ["delete Pod/demo-i1-gym-1"]
    assert result.status.members[0].failures == 0

    lost_trainer = (gym(1, 0), gym(1, 1))
    ended = reconcile(make_run(running_status()), observed(lost_trainer), NOW)
    assert ended.status.preemptions == 1
    assert condition(ended, "Restarting")[:2] == ("True", "PodDeleted")


def test_the_next_incarnation_starts_with_every_member_at_generation_zero():
    status = running_status(
        members=[{"role": "gym", "index": 0, "generation": 3, "failures": 1}],
        memberReplacements=[{"role": "gym", "count": 3, "recentSeconds": [1.0, 2.0, 1.0]}],
    )
    stopped = reconcile(make_run(status, suspend=True), observed(), NOW)
    resumed = reconcile(again(stopped), observed(), NOW)
    assert resumed.status.incarnation == 2 and resumed.status.members == []
    assert resumed.status.member_replacements[0].count == 3  # over the run's life
    pods = [a for a in resumed.actions if a.kind == "Pod"]
    labels = {a.name: a.manifest["metadata"]["labels"][GEN_LABEL] for a in pods}
    assert labels == {"demo-i2-gym-0": "0", "demo-i2-gym-1": "0"}


def test_the_member_generation_label_is_read_back():
    raw = {
        "metadata": {
            "name": "demo-i1-gym-0",
            "labels": {naming.LABEL_ROLE: "gym", naming.LABEL_GYM_INDEX: "0", GEN_LABEL: "4"},
        },
        "status": {"phase": "Running"},
    }
    assert pod_view(raw).generation == 4
    assert members(1)[1].generation == 0


def test_garbled_endpoint_annotations_read_as_none():
    assert parse_member_endpoints(None, 1) == {}
    assert parse_member_endpoints("not json", 1) == {}
    assert (
        parse_member_endpoints('{"incarnation":1,"members":[[0,"ftp://x",1],[1,"http://a",-1]]}', 1)
        == {}
    )
    good = parse_member_endpoints('{"incarnation":1,"members":[[0,"http://a:1",2],"x"]}', 1)
    assert good == {0: naming.MemberEndpoint(0, "http://a:1", 2)}
