"""One local cluster for the whole localcluster test session (starting one costs ~0.1 s, but
sharing it also shows that tests do not disturb each other through it)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import api_client, local_cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    directory: Path = tmp_path_factory.mktemp("localcluster")
    yield from local_cluster(
        directory, restart_backoff=(0.2, 2.0), image_backoff=(2.0, 20.0), bookmark_interval=0.5
    )


@pytest.fixture(scope="session")
def client(cluster: LocalCluster) -> Iterator[Any]:
    api = api_client(cluster)
    yield api
    api.close()


@pytest.fixture
def namespace(client: Any) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (its pods are stopped by the kubelet)."""
    from kubernetes import client as k8s

    name = f"t-{uuid.uuid4().hex[:8]}"
    core: Any = k8s.CoreV1Api(client)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


@pytest.fixture(scope="session")
def widgets(client: Any) -> Any:
    """The test ``Widget`` CRD, applied once; a ``CustomObjectsApi`` to use it."""
    from kubernetes import client as k8s

    from tests.support.kopf_operator import CRD

    try:
        ext: Any = k8s.ApiextensionsV1Api(client)
        ext.create_custom_resource_definition(CRD)
    except k8s.ApiException as error:
        if error.status != 409:
            raise
    return k8s.CustomObjectsApi(client)
