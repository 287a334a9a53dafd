"""Fixtures of the operator tests that drive it on the local cluster (one cluster a module)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rolloutrun_localcluster.cluster import LocalCluster
from tests.support.operator_cluster import client_with_crd, shimmed_cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    yield from shimmed_cluster(tmp_path_factory)


@pytest.fixture(scope="module")
def api(cluster: LocalCluster) -> Iterator[Any]:
    yield from client_with_crd(cluster)
