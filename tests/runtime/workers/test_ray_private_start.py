"""A private Ray whose raylet missed Ray's fixed 30 s start-up bound (a loaded machine) is
started again, a bounded number of times; any other failure is not retried.

``ray.init`` is replaced here: the real miss cannot be produced on demand."""

from __future__ import annotations

from typing import Any

import pytest

from rolloutrun_runtime.workers import ray_cluster

MISSED = "The current node timed out during startup. This could happen because ..."


class _Init:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls = 0
        self.shutdowns = 0

    def init(self, **_options: Any) -> None:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


@pytest.fixture
def fake_init(monkeypatch: pytest.MonkeyPatch):
    import ray

    def install(failures: list[Exception]) -> _Init:
        fake = _Init(failures)
        monkeypatch.setattr(ray, "init", fake.init)
        monkeypatch.setattr(ray, "shutdown", fake.shutdown)
        return fake

    return install


def test_a_start_that_missed_rays_bound_is_tried_again(fake_init: Any) -> None:
    fake = fake_init([Exception(MISSED)])
    ray_cluster.init_private({})  # before: the first miss ended `rolloutrun train`
    assert (fake.calls, fake.shutdowns) == (2, 1)


def test_tries_are_bounded(fake_init: Any) -> None:
    fake = fake_init([Exception(MISSED)] * ray_cluster.PRIVATE_START_ATTEMPTS)
    with pytest.raises(Exception, match="timed out during startup"):
        ray_cluster.init_private({})
    assert fake.calls == ray_cluster.PRIVATE_START_ATTEMPTS


def test_other_failures_are_not_retried(fake_init: Any) -> None:
    fake = fake_init([ValueError("bad option")])
    with pytest.raises(ValueError, match="bad option"):
        ray_cluster.init_private({})
    assert fake.calls == 1


STALE_HEAD = "127.0.0.1:9"  # the discard port: nothing serves a GCS there

PRIVATE_START = """
import ray
from rolloutrun_runtime.workers.ray_cluster import init_private
init_private({"include_dashboard": False, "log_to_driver": False, "num_cpus": 1})
print("gcs", ray.get_runtime_context().gcs_address, flush=True)
ray.shutdown()
"""


def test_a_stale_current_cluster_file_is_not_joined() -> None:
    """A head SIGKILLed on this machine leaves Ray's "current cluster" file naming it; a
    plain ``ray.init()`` would try to join that dead cluster instead of starting one."""
    import os
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    from tests.runtime.workers.conftest import RAY_ENV

    temp = Path(tempfile.mkdtemp(prefix="rr", dir="/tmp"))  # short: Ray's socket paths
    try:
        (temp / "ray").mkdir()
        (temp / "ray" / "ray_current_cluster").write_text(STALE_HEAD)
        env = {**os.environ, **RAY_ENV, "RAY_TMPDIR": str(temp)}
        env.pop("RAY_ADDRESS", None)
        done = subprocess.run(
            [sys.executable, "-c", PRIVATE_START],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        gcs = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("gcs ")]
        assert gcs and gcs[0] != STALE_HEAD
    finally:
        shutil.rmtree(temp, ignore_errors=True)
