"""Stopping the local cluster leaves no task pending: ``rolloutrun run`` ended by printing
asyncio's ``Task was destroyed but it is pending!`` for pod workers."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_localcluster.cluster import LocalCluster
from rolloutrun_localcluster.testing import eventually

SLEEPER = {"containers": [{"name": "c", "image": "x", "command": ["sleep", "600"]}]}


def test_a_worker_whose_pod_was_removed_is_still_awaited_at_stop(tmp_path: Path) -> None:
    """A pod removed from the API (deleted with grace 0) is forgotten by its kubelet while
    its worker task still runs; stopping the kubelet must cancel and await that task too."""

    async def scenario() -> Any:
        cluster = LocalCluster(tmp_path, restart_backoff=(0.2, 2.0))
        await cluster.astart()
        try:
            pods = cluster.registry.get("", "v1", "pods")
            assert pods is not None
            cluster.store.create(pods, "default", {"metadata": {"name": "p"}, "spec": SLEEPER})
            kubelet = cluster.kubelets["local"]
            while not any(worker.processes for worker in kubelet.workers.values()):
                await asyncio.sleep(0.05)
            worker = next(iter(kubelet.workers.values()))
            cluster.store.delete(pods, "default", "p", {"gracePeriodSeconds": 0})
            while worker.uid in kubelet.workers:
                await asyncio.sleep(0)  # the kubelet syncs: the worker is forgotten
            assert worker.task is not None and not worker.task.done()
            await kubelet.stop()
            return worker.task
        finally:
            await cluster.astop()

    task = asyncio.run(scenario())
    assert task.done()


def test_nothing_is_left_pending_on_the_clusters_loop(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever a component's stop misses is cancelled and awaited before the cluster's
    thread closes its loop, and named in a warning, instead of being destroyed pending."""
    cluster = LocalCluster(tmp_path, restart_backoff=(0.2, 2.0)).start()
    pods = cluster.registry.get("", "v1", "pods")
    assert pods is not None
    cluster.call(
        cluster.store.create, pods, "default", {"metadata": {"name": "p"}, "spec": SLEEPER}
    )
    eventually(lambda: cluster.pod_pids("default", "p"), what="the pod runs")
    stray: list[asyncio.Task[None]] = []

    def start_stray() -> None:
        stray.append(asyncio.get_running_loop().create_task(asyncio.sleep(600), name="stray"))

    cluster.call(start_stray)
    with caplog.at_level(logging.WARNING):
        cluster.stop()
        gc.collect()
    assert stray[0].cancelled()
    assert "Task was destroyed" not in caplog.text
    assert "tasks still running when the local cluster stopped: ['stray']" in caplog.text


def test_sigterm_stops_rolloutrun_run_and_every_pod_it_started(tmp_path: Path) -> None:
    """``rolloutrun run`` stopped by SIGTERM (a CI job's timeout, ``kill``) stops its cluster
    as Ctrl-C does; it used to die at once, leaving its trainer and Gyms running."""
    import shutil
    import signal
    import subprocess
    import sys

    from rolloutrun_localcluster.processes import cluster_tag, tagged_pids

    rolloutrun = shutil.which("rolloutrun", path=str(Path(sys.executable).parent))
    if rolloutrun is None:
        pytest.skip("the rolloutrun console script is not installed (pip install -e .)")
    example = Path(__file__).resolve().parents[2] / "examples" / "tiny-grpo.yaml"
    work = tmp_path / "run"
    tag = cluster_tag(str(work.resolve() / "cluster"))
    argv = [rolloutrun, "run", str(example), "--work-dir", str(work), "--max-steps", "100000"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        eventually(lambda: len(tagged_pids(tag)) >= 2, what="the run's pods", timeout=120)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 130, output
        assert "interrupted; the cluster and its pods were stopped" in output
        assert not tagged_pids(tag), "pod processes outlived rolloutrun run"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        for pid in tagged_pids(tag):  # what this test's run left, never anything else
            os.kill(pid, signal.SIGKILL)
