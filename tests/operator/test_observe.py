"""Observation views parsed from API JSON of the shape the API server returns."""

from __future__ import annotations

import datetime as dt

from rolloutrun_operator import naming
from rolloutrun_operator.observe import (
    format_time,
    lease_view,
    node_view,
    observed_from,
    parse_time,
    pod_view,
)

PREEMPTED = {
    "metadata": {
        "name": "demo-i2-trainer",
        "labels": {naming.LABEL_ROLE: "trainer", naming.LABEL_INCARNATION: "2"},
        "deletionTimestamp": "2026-01-01T12:00:30Z",
        "ownerReferences": [
            {"kind": "RolloutRun", "name": "demo", "uid": "u1", "controller": True}
        ],
    },
    "spec": {"nodeName": "spot-1"},
    "status": {
        "phase": "Failed",
        "podIP": "10.0.0.7",
        "reason": "Terminated",
        "conditions": [
            {"type": "Ready", "status": "False"},
            {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"},
        ],
        "containerStatuses": [
            {"name": "trainer", "state": {"terminated": {"exitCode": 143, "reason": "Error"}}}
        ],
    },
}


def test_a_preempted_pod_is_read_with_its_reasons():
    view = pod_view(PREEMPTED)
    assert view.role == "trainer" and view.incarnation == 2 and view.gym_index is None
    assert view.phase == "Failed" and view.terminated
    assert view.disruption == "PreemptionByScheduler" and view.status_reason == "Terminated"
    assert view.exit_code == 143 and view.terminated_reason == "Error"
    assert view.deletion_time == dt.datetime(2026, 1, 1, 12, 0, 30, tzinfo=dt.UTC)
    assert view.node_name == "spot-1" and view.pod_ip == "10.0.0.7" and not view.ready
    assert view.terminated_message is None


def test_a_termination_message_is_read():
    pod = {
        "metadata": {"name": "demo-i2-trainer"},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {
                    "name": "trainer",
                    "state": {
                        "terminated": {"exitCode": 78, "reason": "Error", "message": "no entry"}
                    },
                }
            ],
        },
    }
    view = pod_view(pod)
    assert (view.exit_code, view.terminated_message) == (78, "no entry")


def test_a_bare_pod_reads_as_pending_and_bad_labels_as_unknown():
    view = pod_view({"metadata": {"name": "x", "labels": {naming.LABEL_INCARNATION: "abc"}}})
    assert view.phase == "Pending" and view.incarnation is None and view.exit_code is None


def test_lease_annotations_and_expiry():
    lease = {
        "metadata": {
            "annotations": {
                naming.ANNOTATION_TRAIN_STEP: "12",
                naming.ANNOTATION_ANCHOR_STEP: "10",
                naming.ANNOTATION_LATEST_MANIFEST: "gs://b/p/m.json",
                naming.ANNOTATION_LATEST_MANIFEST_TIME: "2026-01-01T12:00:00Z",
            }
        },
        "spec": {
            "holderIdentity": "demo-i4-trainer/4",
            "leaseDurationSeconds": 15,
            "renewTime": "2026-01-01T12:00:00.123456Z",
        },
    }
    view = lease_view(lease)
    assert view.holder_incarnation == 4
    assert (view.train_step, view.anchor_step) == (12, 10)
    assert view.latest_manifest == "gs://b/p/m.json"
    # the trainer's clock: kept as written, to be compared for change only
    assert (view.renew_time, view.duration_seconds) == ("2026-01-01T12:00:00.123456Z", 15)
    unheld = lease_view({"spec": {"leaseDurationSeconds": 15}})
    assert unheld.holder is None and unheld.holder_incarnation is None
    assert unheld.renew_time is None
    garbage = lease_view({"metadata": {"annotations": {naming.ANNOTATION_TRAIN_STEP: "-3"}}})
    assert garbage.train_step is None


def test_a_lease_time_the_crd_would_refuse_is_not_copied_into_status():
    # status.latestManifestTime is format: date-time: the API server would refuse the pass's
    # status write over the trainer's text, so only an RFC 3339 time is carried over
    def view(written: str) -> str | None:
        notes = {naming.ANNOTATION_LATEST_MANIFEST_TIME: written}
        return lease_view({"metadata": {"annotations": notes}}).latest_manifest_time

    assert view("2026-01-01T12:00:00Z") == "2026-01-01T12:00:00Z"
    assert view("2026-01-01T13:00:00+01:00") == "2026-01-01T12:00:00Z"
    assert view("yesterday") is None


def test_node_readiness_and_observed_assembly():
    node = {
        "metadata": {"name": "n1"},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "Unknown", "lastTransitionTime": "2026-01-01T12:00:00Z"}
            ]
        },
    }
    assert node_view(node).ready is False and node_view({"metadata": {"name": "n2"}}).ready
    config = {
        "data": {"run.yaml": "x"},
        "metadata": {"annotations": {naming.ANNOTATION_CONFIG_INCARNATION: "3"}},
    }
    config["metadata"]["ownerReferences"] = PREEMPTED["metadata"]["ownerReferences"]
    lease = {"metadata": {"name": "demo-trainer", **owned("u1")}}
    children = {"Lease/demo-trainer": lease, "Secret/demo-gym-token": None}
    seen = observed_from([PREEMPTED], None, config, children, ["s"], [node], "t", uid="u1")
    assert seen.present == {"Lease/demo-trainer"} and seen.foreign == {}
    assert seen.config == {"run.yaml": "x"} and seen.config_incarnation == 3
    assert seen.nodes["n1"].ready is False and seen.members(2)[0].name == "demo-i2-trainer"
    assert seen.lease is None and seen.new_token == "t"


def test_times_round_trip_in_kubernetes_format():
    moment = parse_time("2026-01-01T12:00:00Z")
    assert moment is not None and format_time(moment) == "2026-01-01T12:00:00Z"
    assert parse_time("not a time") is None and parse_time(None) is None


def test_a_running_container_reports_when_it_started():
    pod = {
        "metadata": {"name": "demo-i1-trainer", "labels": {naming.LABEL_INCARNATION: "1"}},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": "trainer", "state": {"running": {"startedAt": "2026-01-01T12:00:05Z"}}}
            ],
        },
    }
    assert pod_view(pod).started == dt.datetime(2026, 1, 1, 12, 0, 5, tzinfo=dt.UTC)


def owned(uid: str, controller: bool = True) -> dict:
    reference = {"kind": "RolloutRun", "name": "x", "uid": uid, "controller": controller}
    return {"ownerReferences": [reference]}


def test_only_objects_the_run_controls_are_its_children():
    mine, theirs = owned("u1"), owned("u2")
    labels = {naming.LABEL_RUN: "demo", naming.LABEL_ROLE: "gym", naming.LABEL_INCARNATION: "1"}
    pods = [
        {"metadata": {"name": "demo-i1-gym-0", "labels": labels, **mine}},
        {"metadata": {"name": "squatter", "labels": labels}},  # the run's label, no owner
        {"metadata": {"name": "other", "labels": labels, **theirs}},
        {"metadata": {"name": "weak", "labels": labels, **owned("u1", controller=False)}},
    ]
    lease = {"metadata": {"name": "demo-trainer"}, "spec": {"holderIdentity": "x/99"}}
    config = {"metadata": {"name": "demo-config", **theirs}, "data": {"run.yaml": "evil"}}
    children = {
        "Secret/demo-gym-token": {"metadata": {"name": "demo-gym-token"}},
        "Role/demo-member": {"metadata": {"name": "demo-member", **theirs}},
        "Service/demo-gym": {"metadata": {"name": "demo-gym", **mine}},
        "Service/demo-trainer": None,
    }
    seen = observed_from(pods, lease, config, children, [], [], "t", uid="u1")
    assert [pod.name for pod in seen.pods] == ["demo-i1-gym-0"]
    assert seen.lease is None and seen.config is None
    assert seen.present == {"Service/demo-gym"}
    assert seen.foreign == {
        "Pod/squatter": "no owner",
        "Pod/other": "RolloutRun/x (uid u2)",
        "Pod/weak": "no owner",
        "Lease/demo-trainer": "no owner",
        "ConfigMap/demo-config": "RolloutRun/x (uid u2)",
        "Secret/demo-gym-token": "no owner",
        "Role/demo-member": "RolloutRun/x (uid u2)",
    }
    # a run without a uid owns nothing (never "everything")
    assert observed_from(pods, None, None, {}, [], [], "t", uid="").pods == ()


def test_the_named_service_account_is_seen_with_its_annotations():
    account = {"metadata": {"name": "sa", "annotations": {"rolloutrun.dev/allow-runs": "demo"}}}
    seen = observed_from([], None, None, {}, [], [], "t", uid="u1", account=account)
    assert seen.account == {"rolloutrun.dev/allow-runs": "demo"}
    assert observed_from([], None, None, {}, [], [], "t", uid="u1").account is None


def test_the_member_binding_subjects_and_each_pods_account_are_seen():
    owner = [{"kind": "RolloutRun", "name": "demo", "uid": "u1", "controller": True}]
    binding = {
        "metadata": {"name": "demo-member", "ownerReferences": owner},
        "subjects": [
            {"kind": "ServiceAccount", "name": "mine", "namespace": "ns"},
            {"kind": "ServiceAccount", "name": "demo-member", "namespace": "ns"},
            {"kind": "User", "name": "alice"},
        ],
    }
    pod = {
        "metadata": {"name": "demo-i1-trainer", "ownerReferences": owner},
        "spec": {"serviceAccountName": "mine"},
    }
    children = {"RoleBinding/demo-member": binding}
    seen = observed_from([pod], None, None, children, [], [], "t", uid="u1")
    assert seen.binding_accounts == ("demo-member", "mine")
    assert seen.pods[0].service_account == "mine"
    # absent, or someone else's: nothing to follow
    assert observed_from([], None, None, {}, [], [], "t", uid="u1").binding_accounts is None
    foreign = observed_from([], None, None, children, [], [], "t", uid="u2")
    assert foreign.binding_accounts is None
