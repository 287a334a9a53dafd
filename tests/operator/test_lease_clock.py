"""Lease expiry on the operator's own clock, whatever the trainer's clock says.

The trainer writes the Lease's ``renewTime`` with its clock; the operator used to add
``leaseDurationSeconds`` to it and compare with its own clock, so a trainer 60 s behind was
declared lost (``LeaseExpired``, counted as a failure) while renewing every few seconds, and
a hung trainer 60 s ahead was noticed a minute late. The operator now times how long the
renewal has not changed, as client-go's leader election does. These tests drive the pure
reconcile pass after pass, each pass reading back the status the previous one wrote, as the
operator does through the API server.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from rolloutrun_operator.api.v1alpha1 import LeaseObservation
from rolloutrun_operator.losses import LEASE_EXPIRY_MARGIN_SECONDS, observe_lease
from rolloutrun_operator.plan import Verb
from rolloutrun_operator.reconcile import Result, reconcile
from tests.support.rolloutruns import (
    NOW,
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

DURATION = 15  # leaseDurationSeconds of tests.support.rolloutruns
SKEWS = [-3600.0, -60.0, 60.0, 3600.0]


def at(seconds: float) -> dt.datetime:
    return T0 + dt.timedelta(seconds=seconds)


def one_pass(status: dict[str, Any], now: float, renewed: dt.datetime) -> Result:
    """A reconcile pass at operator time ``now``, the Lease last renewed at ``renewed``
    (the trainer's clock), from the status the previous pass wrote."""
    view = lease(1, renewed)
    return reconcile(make_run(status), observed(members(1), lease=view), at(now))


def written(result: Result) -> dict[str, Any]:
    """The status as the operator writes it and reads it back on the next pass."""
    return result.status.model_dump(mode="json", by_alias=True, exclude_none=True)


def drive(skew: float, renew_until: float, end: float) -> list[tuple[float, Result]]:
    """Passes every second of operator time up to ``end``; the trainer renews every 5 s
    until ``renew_until``, stamping ``renewTime`` with its clock, ``skew`` off the operator's.
    Stops at the first pass that ends the incarnation."""
    status = running_status()
    renewed = at(skew)
    passes = []
    for second in range(int(end) + 1):
        if second <= renew_until and second % 5 == 0:
            renewed = at(second + skew)
        result = one_pass(status, second, renewed)
        passes.append((float(second), result))
        if result.status.last_failure is not None:
            break
        status = written(result)
    return passes


@pytest.mark.parametrize("skew", SKEWS, ids=lambda s: f"trainer{s:+.0f}s")
def test_a_renewing_trainer_is_never_lost_whatever_its_clock_skew(skew: float) -> None:
    for second, result in drive(skew, renew_until=300, end=300):
        assert result.status.last_failure is None, f"lost at {second}s: {result.status}"
        assert result.actions == [] and result.status.restarts == 0
        # the next look is at most leaseDuration + margin away, never in the past
        assert result.requeue_after is not None
        assert 0 < result.requeue_after <= DURATION + LEASE_EXPIRY_MARGIN_SECONDS


@pytest.mark.parametrize("skew", [*SKEWS, 0.0], ids=lambda s: f"trainer{s:+.0f}s")
def test_a_silent_lease_expires_after_its_duration_of_operator_time(skew: float) -> None:
    """The trainer renews last at operator time 30 s, then hangs: the run loses it at
    30 + leaseDuration + margin on the operator's clock, not a second earlier or later."""
    passes = drive(skew, renew_until=30, end=120)
    second, result = passes[-1]
    assert second == 30 + DURATION + LEASE_EXPIRY_MARGIN_SECONDS
    failure = result.status.last_failure
    assert failure is not None and failure.reason == "LeaseExpired"
    assert "unchanged since the operator saw it at 2026-01-01T12:00:30Z" in failure.message
    assert result.status.restarts == 1  # a hung trainer is a failure
    # it publishes no snapshot: nothing to keep its Gyms for, nor to wait its grace period
    graces = {a.name: a.grace_seconds for a in result.actions if a.verb is Verb.DELETE}
    assert graces == {"demo-i1-trainer": 1, "demo-i1-gym-0": None, "demo-i1-gym-1": None}
    # the pass that saw the last renewal looked again exactly at the expiry
    seen = dict(passes)[30.0]
    assert seen.requeue_after == pytest.approx(DURATION + LEASE_EXPIRY_MARGIN_SECONDS)


def test_a_restarted_operator_keeps_timing_from_the_status() -> None:
    """The observation lives in status: an operator started after the trainer hung (nothing
    in memory) still ends the incarnation on time; without it, it starts the clock over."""
    renewed = at(-45.0)  # the trainer's clock, 45 s behind: never compared with the operator's
    seen = {"holder": lease(1, renewed).holder, "renewTime": lease(1, renewed).renew_time}
    status = running_status(lease={**seen, "observedAt": "2026-01-01T12:00:10Z"})
    expiry = 10 + DURATION + LEASE_EXPIRY_MARGIN_SECONDS
    assert one_pass(status, expiry - 1, renewed).status.last_failure is None
    lost = one_pass(status, expiry, renewed).status.last_failure
    assert lost is not None and lost.reason == "LeaseExpired"
    fresh = one_pass(running_status(), expiry, renewed)
    assert fresh.status.last_failure is None
    assert fresh.status.lease is not None
    assert fresh.status.lease.observed_at == "2026-01-01T12:00:27Z"


def test_the_observation_changes_only_with_the_holder_or_the_renewal() -> None:
    view = lease(1, at(-60.0))
    first = observe_lease(None, view, at(0))
    assert first.observed_at == "2026-01-01T12:00:00Z" and first.holder == view.holder
    assert observe_lease(first, view, at(100)) is first  # no change: the clock runs on
    renewed = observe_lease(first, lease(1, at(-55.0)), at(100))
    assert renewed.observed_at == "2026-01-01T12:01:40Z"
    successor = observe_lease(first, lease(2, at(-60.0)), at(100))  # a new holder
    assert successor.observed_at == "2026-01-01T12:01:40Z"
    unreadable = first.model_copy(update={"observed_at": "garbage"})
    assert observe_lease(unreadable, view, at(100)).observed_at == "2026-01-01T12:01:40Z"
    assert isinstance(first, LeaseObservation)


def test_a_lease_of_another_incarnation_clears_the_observation() -> None:
    seen = {"holder": "x", "renewTime": "y", "observedAt": "2026-01-01T12:00:00Z"}
    result = reconcile(
        make_run(running_status(2, lease=seen)),
        observed(members(2), lease=lease(1, at(-100.0))),
        at(60),
    )
    assert result.status.lease is None and result.status.last_failure is None


def test_a_trainer_that_never_took_its_lease_is_deleted_with_a_short_grace():
    """It can publish nothing (it holds no Lease to commit under): its own grace period would
    only hold the next incarnation's start. Its Gyms keep theirs (an expired Lease: above)."""
    pods = (trainer(1, started=NOW - dt.timedelta(seconds=900)), gym(1, 0), gym(1, 1))
    result = reconcile(make_run(running_status()), observed(pods, lease=lease(0, NOW)), NOW)
    assert condition(result, "Restarting")[:2] == ("True", "LeaseNotAcquired")
    graces = {a.name: a.grace_seconds for a in result.actions if a.verb is Verb.DELETE}
    assert graces == {"demo-i1-trainer": 1, "demo-i1-gym-0": None, "demo-i1-gym-1": None}
