"""One Ray runtime per test session (``ray.init`` costs seconds and most of a GiB)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

RAY_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
}


@pytest.fixture(scope="session")
def ray_session() -> Iterator[None]:
    """A local Ray bound to 127.0.0.1, shared by every ``ray`` test of the session."""
    os.environ.update(RAY_ENV)
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            address="local",  # never a stale "current cluster" a killed head left
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
        )
    yield
    if started:
        ray.shutdown()
