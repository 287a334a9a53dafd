"""KubernetesLease over real HTTP against the local cluster's API server: resourceVersion
conflicts, take-over by a newer incarnation, fencing, progress annotations."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutrun_runtime.coordination import (
    FencedError,
    KubernetesLease,
    LeaseError,
    LeaseHolder,
    holder_identity,
)
from tests.support.races import at_once

from .surface import Recording, violations


def trainer(api: Any, name: str, incarnation: int, pod: str | None = None) -> KubernetesLease:
    pod = pod or f"run-i{incarnation}-trainer"
    identity = holder_identity(pod, incarnation)
    return KubernetesLease(name, "default", identity, incarnation, api_client=api)


def read(api: Any, name: str) -> Any:
    from kubernetes import client as k8s

    leases: Any = k8s.CoordinationV1Api(api)
    return leases.read_namespaced_lease(name, "default")


def test_acquire_renew_and_progress_on_a_real_lease(api, lease_name):
    lease = trainer(api, lease_name, 1)
    assert isinstance(lease, LeaseHolder)
    lease.acquire(timeout=10)
    lease.renew()
    lease.ensure_held()
    lease.record_progress(train_step=3, anchor_step=0, latest_manifest="gs://b/run/m3.json")
    stored = read(api, lease_name)
    assert stored.spec.holder_identity == "run-i1-trainer/1"
    assert stored.spec.renew_time is not None and stored.spec.lease_duration_seconds == 15
    assert stored.metadata.annotations["rolloutrun.dev/train-step"] == "3"
    assert stored.metadata.annotations["rolloutrun.dev/latest-manifest"] == "gs://b/run/m3.json"
    lease.stop(release=True)
    assert read(api, lease_name).spec.holder_identity is None
    # the progress survives a release: the operator keeps mirroring it
    assert read(api, lease_name).metadata.annotations["rolloutrun.dev/train-step"] == "3"


def test_a_newer_incarnation_takes_over_and_fences_the_old_one(api, lease_name):
    old, new = trainer(api, lease_name, 1), trainer(api, lease_name, 2)
    old.acquire(timeout=10)
    new.acquire(timeout=10)
    with pytest.raises(FencedError):
        old.ensure_held()
    with pytest.raises(FencedError):
        old.record_progress(latest_manifest="gs://b/run/stale.json")
    with pytest.raises(FencedError):
        old.try_acquire()
    assert "rolloutrun.dev/latest-manifest" not in (
        read(api, lease_name).metadata.annotations or {}
    )


def test_a_stale_resource_version_is_a_conflict_not_an_overwrite(api, lease_name):
    first, second = trainer(api, lease_name, 1, "a"), trainer(api, lease_name, 1, "b")
    record, version = first._read()
    second.acquire(timeout=10)
    assert first._write(record, version) is False
    assert read(api, lease_name).spec.holder_identity == "b/1"


def test_racing_trainers_elect_exactly_one_holder(api, lease_name):
    leases = [trainer(api, lease_name, 1, f"p{i}") for i in range(6)]
    wins = at_once([lease.try_acquire for lease in leases])
    assert sorted(wins) == [False] * 5 + [True]


def test_a_missing_lease_is_a_clear_error(api):
    with pytest.raises(LeaseError, match="operator creates it"):
        trainer(api, "no-such-lease", 1).acquire(timeout=1)


def test_the_lease_uses_only_what_the_minimum_kubernetes_offers(api, lease_name):
    """Every path (acquire, renew, progress, conflict, release, missing lease) touches only
    ApiClient/CoordinationV1Api attributes and keywords kubernetes 29.0.0 has."""
    log: list[tuple[str, str, tuple[str, ...]]] = []

    def recorded(name: str) -> KubernetesLease:
        lease = KubernetesLease(
            name, "default", "p/1", 1, api_client=Recording(api, "ApiClient", log)
        )
        if hasattr(lease, "leases"):  # (a client that bypasses the typed API has none)
            lease.leases = Recording(lease.leases, "CoordinationV1Api", log)
        return lease

    lease = recorded(lease_name)
    lease.acquire(timeout=10)
    lease.renew()
    lease.record_progress(train_step=1, latest_manifest="gs://b/run/m1.json")
    record, version = lease._read()
    lease.renew()
    assert lease._write(record, version) is False  # the 409 path
    lease.stop(release=True)
    with pytest.raises(LeaseError, match="operator creates it"):
        recorded("no-such-lease").acquire(timeout=1)
    touched = {name for _, name, _ in log}
    assert {"read_namespaced_lease", "replace_namespaced_lease"} <= touched
    assert violations(log) == []


def test_only_a_transport_failure_reads_as_unreachable(api, lease_name):
    from kubernetes import client as k8s

    nowhere = k8s.ApiClient(k8s.Configuration(host="http://127.0.0.1:1"))
    with pytest.raises(LeaseError, match="unreachable"):
        KubernetesLease(lease_name, "default", "p/1", 1, api_client=nowhere).try_acquire()
    broken = trainer(api, lease_name, 1)
    broken.leases = object()  # a programming error surfaces as itself
    with pytest.raises(AttributeError):
        broken.try_acquire()


def test_a_moment_on_a_whole_second_still_serializes_as_a_micro_time():
    import datetime as dt

    from rolloutrun_runtime.coordination import micro_time

    whole = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.UTC)
    assert micro_time(whole).isoformat() == "2026-01-02T03:04:05.000001+00:00"  # type: ignore[union-attr]
    assert micro_time(whole.replace(microsecond=7)) == whole.replace(microsecond=7)
    assert micro_time(None) is None
