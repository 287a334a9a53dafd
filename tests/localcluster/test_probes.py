"""Readiness probes end with their container, whatever the moment they are cancelled at.

Finding 4 of issue 10: a stopped incarnation sometimes held the next one for 59 s (the
grace period plus the operator's stuck-termination wait) although every member had exited.
The pod worker cancels a container's probe task when the container exits and waits for it;
on Python 3.11 ``asyncio.wait_for`` swallows a cancellation that arrives in the loop
iteration in which the awaited connection completes, the probe loop went on forever, the
worker never finished and the kubelet never removed the pod. These tests cancel a probe at
exactly that moment (the fake connection cancels the probing task as it opens).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from rolloutrun_localcluster import podspec, probes
from rolloutrun_localcluster.netns import LoopbackNetwork
from rolloutrun_localcluster.podworker import PodWorker


class _Writer:
    def close(self) -> None:
        pass

    async def wait_closed(self) -> None:
        pass


def _cancel_while_connecting(monkeypatch: pytest.MonkeyPatch, target: list[asyncio.Task[Any]]):
    """``asyncio.open_connection`` that cancels ``target[0]`` as the connection opens."""

    async def connect(*_args: Any, **_kwargs: Any) -> tuple[object, _Writer]:
        target[0].cancel()  # the container exited while this probe's connection opened
        return object(), _Writer()

    monkeypatch.setattr(asyncio, "open_connection", connect)


def test_a_probe_cancelled_as_its_connection_opens_stays_cancelled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    async def main() -> bool:
        target: list[asyncio.Task[Any]] = []
        _cancel_while_connecting(monkeypatch, target)
        probe = {"tcpSocket": {"port": 8000}, "timeoutSeconds": 1}
        task = asyncio.create_task(probes.probe_once(probe, {}, "127.0.0.1", {}, tmp_path))
        target.append(task)
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert asyncio.run(main())


class _Kubelet:
    min_probe_period = 0.01
    network = LoopbackNetwork("127.0.0.0/16")

    async def node_up(self) -> None:
        pass


class _Process:
    returncode: int | None = None


def test_the_probe_loop_ends_once_its_container_exited_even_if_a_cancel_is_lost(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Whatever swallows a cancellation, the loop does not outlive the container's process."""

    inside = asyncio.Event()

    async def swallowing_probe(*_args: Any, **_kwargs: Any) -> bool:
        inside.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)
        return True

    monkeypatch.setattr(probes, "probe_once", swallowing_probe)
    worker: Any = PodWorker.__new__(PodWorker)
    worker.kubelet, worker.ip, worker.dir = _Kubelet(), "127.0.0.1", tmp_path
    worker.uid = "uid"
    worker.report = lambda: None
    record = podspec.ContainerRecord("main", state="running")
    process = _Process()
    spec = {"readinessProbe": {"tcpSocket": {"port": 8000}, "periodSeconds": 0.01}}

    async def main() -> None:
        task = asyncio.create_task(worker._probe(spec, record, {}, process))
        await inside.wait()
        process.returncode = 0
        task.cancel()  # lost in the probe
        await asyncio.wait_for(asyncio.shield(task), 5)
        assert task.done() and not task.cancelled()

    asyncio.run(main())
