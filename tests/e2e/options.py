"""The pytest options that point ``tests/e2e -m cluster`` at a real cluster (``make e2e``).

Apart from :mod:`tests.e2e.any_cluster` so that registering them (tests/conftest.py, for
every test run) imports nothing heavy.
"""

from __future__ import annotations

from typing import Any

#: Options of ``pytest tests/e2e`` (registered in tests/conftest.py) for a real cluster.
KUBECONFIG_OPTION = "--kubeconfig"
IMAGE_OPTION = "--image"
NAMESPACE_OPTION = "--e2e-namespace"
STORAGE_CLASS_OPTION = "--storage-class"
STORAGE_URI_OPTION = "--storage-uri"
KEEP_OPTION = "--keep-namespace"


def add_options(parser: Any) -> None:
    """The options that point ``tests/e2e -m cluster`` at a real cluster."""
    group = parser.getgroup("e2e", "end-to-end tests against a real cluster (make e2e)")
    group.addoption(KUBECONFIG_OPTION, help="run the cluster tests against this kubeconfig")
    group.addoption(IMAGE_OPTION, help="runtime image of the member pods (trainer, Gyms)")
    group.addoption(NAMESPACE_OPTION, help="an existing namespace (default: a fresh one)")
    group.addoption(STORAGE_CLASS_OPTION, help="StorageClass of the run's ReadWriteMany claim")
    group.addoption(STORAGE_URI_OPTION, help="gs://bucket/prefix instead of a claim")
    group.addoption(KEEP_OPTION, action="store_true", help="keep the namespace to inspect")
