"""FileLease: the lease semantics (take-over, fencing, expiry, progress) on a lease file."""

from __future__ import annotations

import datetime as dt
import json
import threading
from typing import Any

import pytest

from rolloutrun_runtime import coordination
from rolloutrun_runtime.coordination import (
    FencedError,
    FileLease,
    KubernetesLease,
    LeaseHolder,
    LeaseRecord,
    holding,
    lease_from_environment,
    may_take,
)
from tests.support.races import at_once

T0 = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


class Clock:
    """A settable clock, so expiry is tested without waiting."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


@pytest.fixture
def clock():
    return Clock()


def trainer(path, incarnation, clock, pod=None, **options):
    pod = pod or f"demo-i{incarnation}-trainer"
    identity = coordination.holder_identity(pod, incarnation)
    return FileLease(path, identity, incarnation, duration_seconds=15, clock=clock, **options)


def stored(path):
    return json.loads(path.read_text())


def test_a_free_lease_is_acquired_held_and_carries_progress(tmp_path, clock):
    path = tmp_path / "lease.json"
    lease = trainer(path, 1, clock)
    assert isinstance(lease, LeaseHolder)
    lease.acquire(timeout=1)
    lease.ensure_held()
    lease.record_progress(train_step=12, anchor_step=10, latest_manifest="file:///d/m.json")
    data = stored(path)
    assert data["holderIdentity"] == "demo-i1-trainer/1"
    assert data["leaseDurationSeconds"] == 15
    assert data["renewTime"] == "2026-01-01T12:00:00.000000Z"
    assert data["annotations"] == {
        "rolloutrun.dev/train-step": "12",
        "rolloutrun.dev/anchor-step": "10",
        "rolloutrun.dev/latest-manifest": "file:///d/m.json",
        "rolloutrun.dev/latest-manifest-time": "2026-01-01T12:00:00Z",
    }
    clock.advance(10)
    lease.renew()
    clock.advance(10)
    lease.ensure_held()  # renewed at +10 s, valid until +25 s
    lease.record_progress(train_step=13)
    assert stored(path)["annotations"]["rolloutrun.dev/train-step"] == "13"
    assert stored(path)["annotations"]["rolloutrun.dev/anchor-step"] == "10"


def test_a_newer_incarnation_takes_over_at_once_and_fences_the_old_trainer(tmp_path, clock):
    path = tmp_path / "lease.json"
    old, new = trainer(path, 1, clock), trainer(path, 2, clock)
    old.acquire(timeout=1)
    new.acquire(timeout=1)  # no waiting for the old lease to expire
    new.ensure_held()
    for call in (
        old.ensure_held,
        old.renew,
        lambda: old.record_progress(latest_manifest="file:///d/stale.json"),
        old.try_acquire,
    ):
        with pytest.raises(FencedError):
            call()
    assert "stale" not in path.read_text()


def test_the_same_incarnation_waits_for_expiry(tmp_path, clock):
    path = tmp_path / "lease.json"
    first = trainer(path, 3, clock, pod="a")
    second = trainer(path, 3, clock, pod="b")
    first.acquire(timeout=1)
    assert second.try_acquire() is False
    clock.advance(16)
    assert second.try_acquire() is True
    with pytest.raises(FencedError):
        first.ensure_held()


def test_an_expired_own_lease_is_fenced_and_a_released_one_is_free(tmp_path, clock):
    path = tmp_path / "lease.json"
    lease = trainer(path, 1, clock)
    lease.acquire(timeout=1)
    clock.advance(15)
    with pytest.raises(FencedError, match="expired"):
        lease.ensure_held()
    lease.acquire(timeout=1)  # nobody took it: re-acquire
    lease.stop(release=True)
    assert stored(path)["holderIdentity"] is None
    assert trainer(path, 1, clock, pod="other").try_acquire()


def test_acquire_times_out_while_another_holder_is_valid(tmp_path, clock):
    path = tmp_path / "lease.json"
    trainer(path, 1, clock, pod="a").acquire(timeout=1)
    waiting = trainer(path, 1, clock, pod="b")
    waiting.duration_seconds = 0  # poll fast; the fake clock never reaches expiry
    original = waiting.try_acquire

    def tick() -> bool:
        clock.advance(0.5)
        return original() if clock.now < T0 + dt.timedelta(seconds=10) else False

    waiting.try_acquire = tick
    with pytest.raises(TimeoutError):
        waiting.acquire(timeout=2)


def test_racing_writers_elect_exactly_one_holder(tmp_path):
    path = tmp_path / "lease.json"
    leases = [trainer(path, 1, coordination.utcnow, pod=f"p{i}") for i in range(8)]
    wins = at_once([lease.try_acquire for lease in leases])
    assert sorted(wins) == [False] * 7 + [True]
    assert stored(path)["version"] == "1"


def test_background_renewal_notices_a_take_over(tmp_path):
    path = tmp_path / "lease.json"
    lost = threading.Event()
    old = trainer(path, 1, coordination.utcnow, on_lost=lambda error: lost.set())
    old.acquire(timeout=5)
    first_renewal = stored(path)["renewTime"]
    renewed = threading.Event()
    original = old.renew

    def renew_and_tell() -> None:
        original()
        renewed.set()

    old.renew = renew_and_tell
    old.start_renewing(interval=0.01)
    assert renewed.wait(60)
    assert stored(path)["renewTime"] >= first_renewal
    trainer(path, 2, coordination.utcnow).acquire(timeout=5)
    assert lost.wait(60)
    old.stop()
    with pytest.raises(FencedError):
        old.ensure_held()


def test_may_take_table():
    now = T0
    fresh: dict[str, Any] = {"renew_time": now, "duration_seconds": 15}
    assert may_take(LeaseRecord(), "p/1", 1, now)
    assert may_take(LeaseRecord(holder="p/1", **fresh), "p/1", 1, now)
    assert may_take(LeaseRecord(holder="q/1", **fresh), "p/2", 2, now)
    assert not may_take(LeaseRecord(holder="q/1", **fresh), "p/1", 1, now)
    assert may_take(
        LeaseRecord(holder="q/1", renew_time=now - dt.timedelta(seconds=16)), "p/1", 1, now
    )
    with pytest.raises(FencedError):
        may_take(LeaseRecord(holder="q/3", renew_time=now - dt.timedelta(hours=1)), "p/2", 2, now)


def test_the_environment_picks_the_backend(tmp_path):
    pod_env = {
        "ROLLOUTRUN_LEASE_NAME": "demo-trainer",
        "ROLLOUTRUN_LEASE_DURATION_SECONDS": "20",
        "ROLLOUTRUN_INCARNATION": "4",
        "POD_NAME": "demo-i4-trainer",
        "POD_NAMESPACE": "ns",
    }
    from kubernetes import client

    lease = lease_from_environment(pod_env, api_client=client.ApiClient(client.Configuration()))
    assert isinstance(lease, KubernetesLease)
    assert (lease.name, lease.namespace, lease.identity) == (
        "demo-trainer",
        "ns",
        "demo-i4-trainer/4",
    )
    assert lease.duration_seconds == 20
    local = lease_from_environment({"ROLLOUTRUN_INCARNATION": "2"}, local_path=tmp_path / "l.json")
    assert isinstance(local, FileLease) and local.incarnation == 2
    assert lease_from_environment({}) is None


def test_holding_releases_on_success_and_lets_the_lease_expire_on_error(tmp_path):
    path = tmp_path / "lease.json"
    with holding(trainer(path, 1, coordination.utcnow), acquire_timeout=5) as lease:
        assert lease is not None
        lease.ensure_held()
    assert stored(path)["holderIdentity"] is None
    with pytest.raises(RuntimeError), holding(trainer(path, 2, coordination.utcnow), 5):
        raise RuntimeError("trainer crashed")
    assert stored(path)["holderIdentity"] == "demo-i2-trainer/2"  # left to expire
    with holding(None) as nothing:
        assert nothing is None


def test_the_members_addresses_the_operator_writes_are_read_by_renewals_and_on_demand(
    tmp_path, clock
):
    """Elastic members: the operator annotates the Lease with a replaced Gym's address; a
    renewal (or a fresh read while a replica is down) hands it to the trainer, which keeps
    its own progress annotations beside it."""
    from rolloutrun_runtime.contract.pod import (
        MemberEndpoint,
        format_member_endpoints,
        member_endpoints_annotation,
    )
    from rolloutrun_runtime.pod import PodLease

    path = tmp_path / "lease.json"
    lease = trainer(path, 3, clock)
    lease.acquire(timeout=1)
    pod = PodLease(lease)
    assert pod.gym_members(fresh=True) == {}
    data = stored(path)
    moved = MemberEndpoint(1, "http://10.0.0.9:8000", 2)
    data["annotations"][member_endpoints_annotation("gym")] = format_member_endpoints(3, [moved])
    path.write_text(json.dumps(data))  # the operator's merge patch
    assert pod.gym_members(fresh=False) == {}  # not read since
    lease.renew()
    assert pod.gym_members(fresh=False) == {1: moved}
    lease.record_progress(train_step=5)
    assert member_endpoints_annotation("gym") in stored(path)["annotations"]  # kept
    data = stored(path)
    other = format_member_endpoints(2, [moved])  # an older incarnation's: never taken
    data["annotations"][member_endpoints_annotation("gym")] = other
    path.write_text(json.dumps(data))
    assert pod.gym_members(fresh=True) == {}
