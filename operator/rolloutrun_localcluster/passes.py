"""One pass loop for the local cluster's background workers: a pass of work run on the
cluster's event loop whenever a store event marks it due.

Why: the scheduler, the volume provisioner and the controllers (garbage collection,
Endpoints) react to the store the same way: an event marks a pass due, a single task runs
it (never two at once, events during a pass mark the next one due), a failed pass is logged
and the next event tries again. Spelled once here, each worker says only what a pass does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable


class PassLoop:
    """Runs ``work`` each time :meth:`mark_due` was called since its last pass; ``debounce``
    seconds after being marked (None: at once) so a burst of events makes one pass."""

    def __init__(
        self,
        work: Callable[[], object],
        *,
        name: str,
        failure: str,
        logger: logging.Logger,
        debounce: float | None = None,
        share: float | None = 0.25,
    ) -> None:
        self._work = work
        self._name = name
        self._failure = failure
        self._logger = logger
        self._debounce = debounce
        # At most this share of the loop's time: after a pass of t seconds the next waits
        # t * (1/share - 1). A pass over every object (the collector, the scheduler) took
        # 100 ms at a thousand runs, and one ran for each of a restart storm's events:
        # the API server stopped serving the Lease renewals that would have ended it.
        self._share = share
        self._due = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def mark_due(self) -> None:
        self._due.set()

    def start(self) -> None:
        """Start the task (on the running loop) with a first pass due."""
        self._task = asyncio.create_task(self._loop(), name=self._name)
        self._due.set()

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def stop(self) -> None:
        self.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._task = None

    async def _loop(self) -> None:
        while True:
            await self._due.wait()
            if self._debounce is not None:
                await asyncio.sleep(self._debounce)
            self._due.clear()
            started = time.monotonic()
            try:
                self._work()
            except Exception:
                self._logger.exception(self._failure)
            rest = rest_after(time.monotonic() - started, self._share)
            if rest > 0:
                await asyncio.sleep(rest)


def rest_after(spent: float, share: float | None) -> float:
    """Seconds to wait after a pass of ``spent`` seconds so passes take at most ``share`` of
    the loop's time (None: no wait)."""
    if not share or spent <= 0:
        return 0.0
    return spent * (1 / share - 1)
