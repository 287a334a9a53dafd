"""``pods/<name>/log``: container logs from the kubelet that runs the pod.

Each container's stdout and stderr go to ``<pod dir>/logs/<container>.log`` (the previous
run's to ``<container>.previous.log``); this serves them with ``container``, ``previous``,
``tailLines``, ``limitBytes`` and ``follow`` as the real endpoint does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

from . import errors

if TYPE_CHECKING:
    from .kubelet import Kubelet
    from .podworker import PodWorker


class PodLogs:
    def __init__(self, kubelets: Callable[[], Iterable[Kubelet]]) -> None:
        self._kubelets = kubelets

    def _worker(self, namespace: str, name: str, container: str | None) -> tuple[PodWorker, str]:
        worker = None
        for kubelet in self._kubelets():
            for candidate in kubelet.workers.values():
                if (candidate.namespace, candidate.name) == (namespace, name):
                    worker = candidate
        if worker is None:
            raise errors.bad_request(
                f'container in pod "{name}" is waiting to start: ContainerCreating'
            )
        names = [r.name for r in worker.init + worker.main]
        if container is None:
            if len(worker.main) != 1:
                choices = " ".join(r.name for r in worker.main)
                raise errors.bad_request(
                    f"a container name must be specified for pod {name}, choose one of: [{choices}]"
                )
            container = worker.main[0].name
        if container not in names:
            raise errors.bad_request(f"container {container} is not valid for pod {name}")
        return worker, container

    async def read_log(
        self, namespace: str, name: str, container: str | None, query: dict[str, str]
    ) -> bytes:
        worker, container = self._worker(namespace, name, container)
        previous = query.get("previous") == "true"
        path = worker.log_path(container, previous=previous)
        if not path.exists():
            if previous:
                raise errors.bad_request(
                    f'previous terminated container "{container}" in pod "{name}" not found'
                )
            return b""
        data = path.read_bytes()
        if query.get("tailLines"):
            tail = int(query["tailLines"])
            data = b"".join(data.splitlines(keepends=True)[-tail:]) if tail else b""
        if query.get("limitBytes"):
            data = data[: int(query["limitBytes"])]
        return data

    async def follow_log(
        self,
        namespace: str,
        name: str,
        container: str | None,
        query: dict[str, str],
        write: Callable[[bytes], Awaitable[None]],
    ) -> None:
        worker, container = self._worker(namespace, name, container)
        await write(await self.read_log(namespace, name, container, query))
        path = worker.log_path(container)
        offset = path.stat().st_size if path.exists() else 0
        record = next(r for r in worker.init + worker.main if r.name == container)
        while True:
            running = record.state == "running" and not worker.finished.is_set()
            if path.exists() and path.stat().st_size > offset:
                with open(path, "rb") as handle:
                    handle.seek(offset)
                    chunk = handle.read()
                offset += len(chunk)
                await write(chunk)
            elif not running:
                return
            await asyncio.sleep(0.2)
