"""Shared fixtures: one real fake-gcs-server per session; a fresh storage per test on each backend.

The storage contract suite and the snapshot-manifest tests both run on file:// and gs://.
Every test runs with the run's data-plane token set (see ``tests.support.data_plane``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.storage import CheckpointStorage, open_storage
from tests.support.data_plane import TOKEN
from tests.support.gcs_emulator import FakeGcs
from tests.support.storage_params import BUCKET


@pytest.fixture(scope="session", autouse=True)
def data_plane_token() -> Iterator[str]:
    """Every test runs as a run whose data-plane token is ``tests.support.data_plane.TOKEN``:
    Gym and generation servers refuse to start without one, and clients send it. For the
    session (module fixtures start servers too), with its own patch, not a test's
    ``monkeypatch`` (whose ``undo()`` keeps it)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ENV_GYM_TOKEN, TOKEN)
        yield TOKEN


@pytest.fixture(autouse=True)
def data_plane_token_kept(data_plane_token: str) -> Iterator[None]:
    """Put the token back after each test: the entry points a test calls in process
    (``trainer.main``, ``rolloutrun gym``, ``rolloutrun train``) take it out of the process
    environment, as they must in a pod, which would leave every later test without it."""
    os.environ[ENV_GYM_TOKEN] = data_plane_token
    yield
    os.environ[ENV_GYM_TOKEN] = data_plane_token


@pytest.fixture(scope="session")
def fake_gcs() -> Iterator[FakeGcs]:
    with FakeGcs() as gcs:
        gcs.create_bucket(BUCKET)
        yield gcs


@pytest.fixture(scope="session")
def gcs_client(fake_gcs: FakeGcs) -> Any:
    return fake_gcs.client()


@pytest.fixture
def gs_storage(fake_gcs: FakeGcs, gcs_client: Any) -> CheckpointStorage:
    """A gs:// storage under a prefix unique to the test."""
    return open_storage(f"gs://{BUCKET}/t-{uuid.uuid4().hex[:12]}", client=gcs_client)


@pytest.fixture
def file_storage(tmp_path: Path) -> CheckpointStorage:
    return open_storage(f"file://{tmp_path}/store")


@pytest.fixture(params=["file", "gs"])
def storage(request: pytest.FixtureRequest) -> CheckpointStorage:
    """Tests that take ``storage`` run once per backend."""
    fixture = "file_storage" if request.param == "file" else "gs_storage"
    result: CheckpointStorage = request.getfixturevalue(fixture)
    return result


def pytest_addoption(parser: pytest.Parser) -> None:
    """``--kubeconfig``/``--image``...: tests/e2e's cluster tests against a real cluster."""
    from tests.e2e.options import add_options

    add_options(parser)
