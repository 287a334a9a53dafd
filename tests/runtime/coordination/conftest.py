"""Fixtures of the Lease tests that run against the local cluster's real API server: one
cluster per module, an admin client, a fresh Lease per test (the operator creates a run's
Lease; here the test does), and a front that can hold its requests (:mod:`.slow_api`)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import api_client, local_cluster

from .slow_api import SlowApi


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from local_cluster(tmp_path_factory.mktemp("cluster"))


@pytest.fixture(scope="module")
def api(cluster: LocalCluster) -> Iterator[Any]:
    client = api_client(cluster)
    yield client
    client.close()


@pytest.fixture
def lease_name(api: Any) -> str:
    from kubernetes import client as k8s

    name = f"run-{uuid.uuid4().hex[:6]}-trainer"
    body = {"metadata": {"name": name}, "spec": {"leaseDurationSeconds": 15}}
    leases: Any = k8s.CoordinationV1Api(api)
    leases.create_namespaced_lease("default", body)
    return name


@pytest.fixture
def slow(cluster: LocalCluster) -> Iterator[SlowApi]:
    front = SlowApi(cluster)
    yield front
    front.close()
