"""What users watch in status: pods the kubelet or scheduler hold back, reward, step rate.

Pod JSON is written in the shape the API server returns (kubelet waiting states, the
scheduler's ``PodScheduled`` condition); the reconcile is driven as a table, like
test_reconcile_lifecycle.py.
"""

from __future__ import annotations

import datetime as dt

import pytest

from rolloutrun_operator import naming
from rolloutrun_operator.observe import ContainerWaiting, lease_view, pod_view
from rolloutrun_operator.problems import pod_problem
from rolloutrun_operator.reconcile import reconcile
from tests.support.rolloutruns import (
    NOW,
    RUN,
    gym,
    lease,
    make_run,
    members,
    observed,
    running_status,
    trainer,
)
from tests.support.rolloutruns import (
    condition as cond,
)


def waiting_pod(role: str, reason: str, message: str) -> dict:
    return {
        "metadata": {
            "name": f"{RUN}-i1-{role}",
            "labels": {naming.LABEL_ROLE: role, naming.LABEL_INCARNATION: "1"},
        },
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "True"}],
            "containerStatuses": [
                {
                    "name": role,
                    "ready": False,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": reason, "message": message}},
                }
            ],
        },
    }


UNSCHEDULABLE = {
    "metadata": {
        "name": f"{RUN}-i1-gym-0",
        "labels": {naming.LABEL_ROLE: "gym", naming.LABEL_INCARNATION: "1"},
    },
    "status": {
        "phase": "Pending",
        "conditions": [
            {
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
            }
        ],
    },
}

PULL = 'Back-off pulling image "ghcr.io/acme/gym:v9"'
WAITING = [
    ("gym", "ImagePullBackOff", PULL, "GymImagePullBackOff"),
    ("gym", "ErrImagePull", "manifest unknown", "GymErrImagePull"),
    ("trainer", "CrashLoopBackOff", "back-off 40s restarting", "TrainerCrashLoopBackOff"),
    ("gym", "CreateContainerConfigError", 'secret "s" not found', "GymCreateContainerConfigError"),
    ("trainer", "InvalidImageName", 'invalid "Bad:Name"', "TrainerInvalidImageName"),
]


@pytest.mark.parametrize(("role", "kubelet", "message", "reason"), WAITING)
def test_a_container_the_kubelet_holds_back_is_a_problem_naming_pod_and_container(
    role, kubelet, message, reason
):
    view = pod_view(waiting_pod(role, kubelet, message))
    assert view.waiting == ContainerWaiting(role, kubelet, message)
    problem = pod_problem(view)
    assert problem is not None
    assert problem[0] == reason
    assert problem[1] == f"pod {view.name} container {role}: {kubelet}: {message}"


def test_a_container_merely_creating_or_an_unscheduled_pod_is_read_as_such():
    creating = pod_view(waiting_pod("gym", "ContainerCreating", ""))
    assert creating.waiting is None and pod_problem(creating) is None
    view = pod_view(UNSCHEDULABLE)
    assert view.unschedulable == "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."
    assert pod_problem(view) == (
        "GymUnschedulable",
        f"pod {RUN}-i1-gym-0 unschedulable: 0/3 nodes are available: 3 Insufficient "
        "nvidia.com/gpu.",
    )


def test_a_gym_stuck_in_image_pull_backoff_is_the_ready_reason_not_starting_gyms():
    kubelet = pod_view(waiting_pod("gym", "ImagePullBackOff", PULL)).waiting
    stuck = gym(1, 1, phase="Pending", pod_ip=None, ready=False, waiting=kubelet)
    status = {"incarnation": 1, "conditions": []}
    result = reconcile(make_run(status), observed((gym(1, 0), stuck)), NOW)
    ready, reason, message = cond(result, "Ready")
    assert (ready, reason) == ("False", "GymImagePullBackOff")
    assert message == f"pod {stuck.name} container gym: ImagePullBackOff: {PULL}"
    assert cond(result, "Progressing")[:2] == ("True", "StartingGyms")
    assert [(e.type, e.reason) for e in result.events] == [("Warning", "GymImagePullBackOff")]
    # the next pass with the same problem announces nothing new
    again = reconcile(
        make_run(result.status.model_dump(by_alias=True)), observed((gym(1, 0), stuck)), NOW
    )
    assert cond(again, "Ready")[1] == "GymImagePullBackOff" and again.events == []


def test_an_unschedulable_trainer_is_the_ready_reason_not_starting_trainer():
    held = trainer(1, phase="Pending", pod_ip=None, ready=False, unschedulable="0/1 nodes")
    pods = (held, gym(1, 0), gym(1, 1))
    result = reconcile(make_run(running_status()), observed(pods), NOW)
    assert cond(result, "Ready") == (
        "False",
        "TrainerUnschedulable",
        f"pod {held.name} unschedulable: 0/1 nodes",
    )
    assert [e.reason for e in result.events] == ["TrainerUnschedulable"]


def test_a_gym_whose_command_cannot_start_is_reported_with_the_kubelets_message():
    why = 'exec: "no-such-gym": executable file not found in $PATH'
    failed = gym(
        1, 0, phase="Failed", exit_code=128, terminated_reason="StartError", terminated_message=why
    )
    pods = (trainer(1), failed, gym(1, 1))
    classic = make_run(running_status(), recovery={"elasticMembers": False})
    result = reconcile(classic, observed(pods), NOW)
    assert result.status.last_failure is not None
    assert result.status.last_failure.reason == "GymStartError"
    assert result.status.last_failure.message == f"{failed.name}: exit code 128 (StartError): {why}"
    assert cond(result, "Ready")[1] == "GymStartError"


def test_a_failed_members_last_line_is_in_the_reason_it_ended():
    """A trainer that ended with a named error (its Ray head would not start) or a Gym
    whose launcher refused its mounts: the status says what, not only ``exit code 1``."""
    why = (
        "Traceback (most recent call last):\n  ...\n"
        "rolloutrun_runtime.workers.ray_cluster.RayNodeEndedError: the trainer's Ray head "
        "node on 10.0.0.5 ended before the driver connected, 3 starts in a row\n"
    )
    failed = trainer(1, phase="Failed", exit_code=1, terminated_message=why)
    result = reconcile(make_run(running_status()), observed((failed, gym(1, 0), gym(1, 1))), NOW)
    assert result.status.last_failure is not None
    assert result.status.last_failure.reason == "TrainerFailed"
    assert result.status.last_failure.message == (
        f"{failed.name}: exit code 1: rolloutrun_runtime.workers.ray_cluster.RayNodeEndedError: "
        "the trainer's Ray head node on 10.0.0.5 ended before the driver connected, "
        "3 starts in a row"
    )
    silent = trainer(1, phase="Failed", exit_code=137)
    result = reconcile(make_run(running_status()), observed((silent, gym(1, 0), gym(1, 1))), NOW)
    assert result.status.last_failure is not None
    assert result.status.last_failure.message == f"{silent.name}: exit code 137"


def test_the_reward_annotation_is_read_and_mirrored_into_status():
    raw = {"metadata": {"annotations": {naming.ANNOTATION_REWARD: "0.4375"}}, "spec": {}}
    assert lease_view(raw).reward == 0.4375
    for garbled in ("nan", "x", "", "1e20"):  # 1e20: past the CRD's bound
        raw["metadata"]["annotations"][naming.ANNOTATION_REWARD] = garbled
        assert lease_view(raw).reward is None
    view = lease(1, NOW, train_step=12, reward=0.4375)
    result = reconcile(make_run(running_status()), observed(members(1), lease=view), NOW)
    assert result.status.last_reward == 0.4375


def test_the_step_rate_is_steps_per_minute_over_a_window_of_operator_time():
    def step(status, train_step, at):
        view = lease(1, at, train_step=train_step)
        return reconcile(make_run(status), observed(members(1), lease=view), at).status

    first = step(running_status(), 10, NOW)
    assert first.step_rate is None  # one sample is no rate
    assert first.step_window == "10@2026-01-01T12:01:00Z"
    early = step(first.model_dump(by_alias=True), 14, NOW + dt.timedelta(seconds=30))
    assert early.step_rate is None and early.step_window == first.step_window
    later = step(early.model_dump(by_alias=True), 40, NOW + dt.timedelta(seconds=90))
    assert later.step_rate == 20.0  # 30 steps in 90 s
    assert later.step_window == "40@2026-01-01T12:02:30Z"
    stalled = step(later.model_dump(by_alias=True), 40, NOW + dt.timedelta(seconds=150))
    assert stalled.step_rate == 0.0
    # not training (suspended): no rate
    suspended = reconcile(
        make_run(stalled.model_dump(by_alias=True), suspend=True),
        observed(members(1), lease=lease(1, NOW, train_step=40)),
        NOW + dt.timedelta(seconds=160),
    ).status
    assert (suspended.step_rate, suspended.step_window) == (None, None)
    # a window the operator cannot read back starts anew
    garbled = {**later.model_dump(by_alias=True), "stepWindow": "x@never"}
    assert step(garbled, 41, NOW + dt.timedelta(seconds=200)).step_window == (
        "41@2026-01-01T12:04:20Z"
    )


def test_while_backing_off_ready_keeps_saying_why_the_incarnation_ended():
    why = 'demo-i1-gym-0: exit code 128 (StartError): exec: "gym": not found'
    status = {
        "incarnation": 1,
        "restarts": 1,
        "nextStartTime": "2026-01-01T13:00:00Z",
        "lastFailure": {"reason": "GymStartError", "pod": "demo-i1-gym-0", "message": why},
        "conditions": [{"type": "Restarting", "status": "True", "reason": "GymStartError"}],
    }
    result = reconcile(make_run(status), observed(), NOW)
    assert cond(result, "Ready") == (
        "False",
        "GymStartError",
        f"{why}; next incarnation at 2026-01-01T13:00:00Z",
    )
