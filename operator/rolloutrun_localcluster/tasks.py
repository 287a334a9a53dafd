"""Every task the local cluster starts is cancelled and awaited when it stops.

Why: a task still pending when its loop closes is destroyed with asyncio's ``Task was
destroyed but it is pending!`` (``rolloutrun run`` ended by printing it for pod workers),
and whatever its ``finally`` blocks would have done (kill the pod's processes, report its
last status) never happens. A worker the kubelet forgets (its pod was removed from the API)
or a termination it gave up on keeps running in the background; so the kubelet keeps every
task it starts in a :class:`TaskSet`, not only those it still looks after, and the cluster's
thread cancels whatever is left on its loop before closing it (as ``asyncio.run`` does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class TaskSet:
    """The tasks one component started and has not seen finish."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def start(self, coroutine: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        return self.adopt(asyncio.create_task(coroutine, name=name))

    def adopt(self, task: asyncio.Task[T]) -> asyncio.Task[T]:
        """Keep ``task`` until it is done (a task another object created)."""
        if not task.done():
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return task

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel_all(self) -> None:
        """Cancel every task and wait until each has finished (its ``finally`` included).
        Tasks started while waiting (a ``finally`` that starts one) are cancelled too."""
        while self._tasks:
            pending = list(self._tasks)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            self._tasks.difference_update(pending)


async def cancel_remaining() -> list[str]:
    """Cancel and await every other task of the running loop; the names of those that were
    still pending (each one a task some ``stop`` forgot: logged, so it gets fixed)."""
    current = asyncio.current_task()
    left = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    if left:
        names = sorted(task.get_name() for task in left)
        logger.warning("tasks still running when the local cluster stopped: %s", names)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        return names
    return []
