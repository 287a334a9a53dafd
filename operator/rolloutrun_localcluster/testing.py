"""Helpers for tests that need a local cluster: a fixture body, a client, a poller.

Test-only: production code (``rolloutrun run``, ``rolloutrun cluster``) never imports it;
what it needs lives in the modules it belongs to (the pod network in ``kubelet``).

``local_cluster`` is a plain generator so any conftest can wrap it at the scope it wants::

    @pytest.fixture(scope="session")
    def cluster(tmp_path_factory):
        yield from local_cluster(tmp_path_factory.mktemp("cluster"))
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .cluster import LocalCluster
from .kubelet import free_pod_network

T = TypeVar("T")


def local_cluster(directory: Path, **options: Any) -> Iterator[LocalCluster]:
    """Start a cluster in ``directory`` for the duration of the fixture; kill its pods after.

    Unless ``pod_network`` is given, the pods get addresses from a random loopback /16."""
    options.setdefault("pod_network", free_pod_network())
    cluster = LocalCluster(directory, **options).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def api_client(cluster: LocalCluster) -> Any:
    """A ``kubernetes.client.ApiClient`` configured from the cluster's kubeconfig."""
    from kubernetes import config

    return config.new_client_from_config(config_file=str(cluster.kubeconfig_path))


def kopf_login(cluster: LocalCluster) -> Any:
    """A ``kopf.ConnectionInfo`` for an ``@kopf.on.login`` handler (no global kubeconfig)."""
    import kopf

    return kopf.ConnectionInfo(
        server=cluster.api_url,
        token=cluster.token,
        scheme="Bearer",
        ca_path=str(cluster.ca_path),
        default_namespace="default",
    )


def eventually(
    check: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.05, what: str = ""
) -> T:
    """Poll ``check`` until it returns something truthy; raise ``TimeoutError`` otherwise.

    A wait, not a timed assertion: the timeout only bounds a hang."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"gave up waiting for {what or getattr(check, '__name__', 'a condition')}"
            )
        time.sleep(interval)
