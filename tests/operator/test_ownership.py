"""Ownership as tables: a run uses only children it controls and only a ServiceAccount that
consented; anything else holding a child's name is a ChildConflict, never adopted or deleted."""

from __future__ import annotations

import dataclasses
import datetime as dt

import pytest

from rolloutrun_operator.ownership import allows_run
from rolloutrun_operator.reconcile import reconcile
from tests.support.rolloutruns import (
    NOW,
    STATIC,
    T0,
    condition,
    gym,
    make_run,
    members,
    observed,
    running_status,
)


def cond(result, kind):
    return condition(result, kind)[:2]


ALLOW = "rolloutrun.dev/allow-runs"


@pytest.mark.parametrize("value", ["true", "*", "other, demo"])
def test_a_consenting_service_account_is_used_and_bound_to_the_lease_role(value):
    run = make_run(serviceAccountName="mine")
    result = reconcile(run, observed(present=frozenset(), config=None, account={ALLOW: value}), NOW)
    rbac = {
        a.kind: a for a in result.actions if a.kind in {"ServiceAccount", "Role", "RoleBinding"}
    }
    assert set(rbac) == {"Role", "RoleBinding"}  # the account is the user's, the Lease Role ours
    binding = rbac["RoleBinding"].manifest or {}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "mine", "namespace": "ns"}]
    assert binding["roleRef"]["name"] == (rbac["Role"].manifest or {})["metadata"]["name"]
    pods = [a.manifest or {} for a in result.actions if a.kind == "Pod"]
    assert pods and all(pod["spec"]["serviceAccountName"] == "mine" for pod in pods)


@pytest.mark.parametrize(
    ("account", "reason"),
    [
        (None, "ServiceAccountNotFound"),
        ({}, "ServiceAccountNotAllowed"),
        ({ALLOW: "false"}, "ServiceAccountNotAllowed"),
        ({ALLOW: "other,demo2"}, "ServiceAccountNotAllowed"),
    ],
)
def test_a_service_account_that_did_not_opt_in_is_refused(account, reason):
    run = make_run(serviceAccountName="mine")
    result = reconcile(run, observed(present=frozenset(), config=None, account=account), NOW)
    assert result.actions == []
    assert cond(result, "Ready") == ("False", reason)
    message = next(c.message for c in result.status.conditions if c.type == "Ready")
    assert "'mine'" in message and (reason == "ServiceAccountNotFound" or ALLOW in message)


@pytest.mark.parametrize(
    "ref",
    [
        "Secret/demo-gym-token",
        "Role/demo-member",
        "RoleBinding/demo-member",
        "Lease/demo-trainer",
        "ConfigMap/demo-config",
        "Pod/demo-i1-gym-1",
        "Pod/demo-i1-trainer",
    ],
)
def test_a_child_name_held_by_an_object_the_run_does_not_own_is_a_conflict(ref):
    foreign = {ref: "no owner"}
    present = STATIC - {ref}
    result = reconcile(make_run(), observed(present=present, config=None, foreign=foreign), NOW)
    assert result.actions == []  # nothing adopted, nothing started beside it
    assert cond(result, "Ready") == ("False", "ChildConflict")
    message = next(c.message for c in result.status.conditions if c.type == "Ready")
    assert f"{ref} exists and is not owned by this run (owner: no owner)" in message
    assert [e.reason for e in result.events] == ["IncarnationStarting", "ChildConflict"]
    # reported once: the next pass (same conflict) emits no second Event
    again = reconcile(
        make_run(result.status.model_dump(mode="json", by_alias=True)),
        observed(present=present, config=None, foreign=foreign),
        NOW,
    )
    assert again.actions == [] and "ChildConflict" not in [e.reason for e in again.events]
    assert cond(again, "Ready") == ("False", "ChildConflict")
    # removed: the run goes on
    resolved = reconcile(
        make_run(again.status.model_dump(mode="json", by_alias=True)),
        observed(present=present, config=None),
        NOW,
    )
    assert ref.split("/")[0] in {a.kind for a in resolved.actions} or ref.startswith("Pod/")
    assert cond(resolved, "Ready") == ("False", "StartingGyms")


def test_a_foreign_pod_with_the_run_label_is_never_deleted_or_counted():
    # observe set it apart: it is in ``foreign``, not in ``pods``; the running run ignores it
    result = reconcile(
        make_run(running_status()),
        observed(members(1), foreign={"Pod/squatter": "no owner"}),
        NOW,
    )
    assert result.actions == [] and cond(result, "Ready") == ("True", "Running")


def test_a_pod_delete_is_conditional_on_the_uid_observed():
    stuck = dict(deletion_time=T0 - dt.timedelta(seconds=60), uid="u-stuck")
    pods = (*members(2), gym(1, 0, uid="u-old"), gym(1, 1, **stuck))
    result = reconcile(make_run(running_status(2)), observed(pods), NOW)
    assert {(a.name, a.grace_seconds, a.uid) for a in result.actions} == {
        ("demo-i1-gym-0", None, "u-old"),
        ("demo-i1-gym-1", 0, "u-stuck"),
    }


@pytest.mark.parametrize(
    ("value", "allowed"),
    [("true", True), ("TRUE", True), ("*", True), ("a, demo ,b", True), ("", False),
     ("false", False), ("demo2", False), ("demo-x,de", False)],
)  # fmt: skip
def test_the_allow_runs_annotation(value, allowed):
    assert allows_run({"rolloutrun.dev/allow-runs": value}, "demo") is allowed
    assert allows_run({}, "demo") is False


def _binding_replacement(result):
    replaced = [a for a in result.actions if a.kind == "RoleBinding" and a.verb.name == "REPLACE"]
    if not replaced:
        return None
    (action,) = replaced
    return [subject["name"] for subject in (action.manifest or {})["subjects"]]


def test_the_lease_binding_follows_a_switched_service_account_keeping_live_trainers():
    # incarnation 1 runs as the run's own account; the spec now names "mine"
    run = make_run(status=running_status(1), serviceAccountName="mine")
    live = tuple(dataclasses.replace(pod, service_account="demo-member") for pod in members(1))
    seen = observed(live, account={ALLOW: "true"}, binding_accounts=("demo-member",))
    # the running trainer keeps its Lease; the next one's account is bound already
    assert _binding_replacement(reconcile(run, seen, NOW)) == ["demo-member", "mine"]
    # once no trainer runs as the old account, the binding narrows to the new one
    gone = tuple(pod for pod in live if pod.role != "trainer")
    narrowed = observed(gone, account={ALLOW: "true"}, binding_accounts=("demo-member", "mine"))
    assert _binding_replacement(reconcile(run, narrowed, NOW)) == ["mine"]


def test_a_binding_that_already_follows_the_spec_is_left_alone():
    run = make_run(status=running_status(1))
    live = tuple(dataclasses.replace(pod, service_account="demo-member") for pod in members(1))
    seen = observed(live, binding_accounts=("demo-member",))
    assert _binding_replacement(reconcile(run, seen, NOW)) is None


def test_a_switch_to_an_account_that_did_not_consent_binds_nothing():
    run = make_run(status=running_status(1), serviceAccountName="mine")
    live = tuple(dataclasses.replace(pod, service_account="demo-member") for pod in members(1))
    for account in (None, {}, {ALLOW: "other"}):
        seen = observed(live, account=account, binding_accounts=("demo-member",))
        assert _binding_replacement(reconcile(run, seen, NOW)) is None
