"""The generation endpoints the Gyms are given: the workers' live ones, less those lost.

Why: a generation worker can die between refits (its worker pod deleted); the Ray backend
learns it only at the next refit (``RayActorError``) and replaces the actor there. Until
then a Gym that is handed the dead endpoint spends its model call on it. When a Gym answers
``policy_unreachable`` the rollout pump marks the endpoint lost here: it is given to no Gym
until it answers ``/healthz`` again (a false alarm, a restarted server) or leaves the
workers' ``endpoints`` (the refit dropped it; its replacement serves at a new address and
is given out as soon as a refit admits it). While every endpoint is lost, all are given out
again: the calls find out, and the pump's bounded retries name the outage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from rolloutrun_runtime.contract.wire import HEALTHZ_ROUTE
from rolloutrun_runtime.workers import PolicyWorkers, WorkerError

logger = logging.getLogger(__name__)

#: How often a lost endpoint's ``/healthz`` is tried, and how long a try may wait.
READMIT_PERIOD_S = 0.5
PROBE_TIMEOUT_S = 2.0

Probe = Callable[[str], Awaitable[bool]]


class PolicyOutageError(WorkerError):
    """An attempt found no generation endpoint a Gym could reach for longer than
    ``rollout.gymUnreachableSeconds``: the workers are lost and none came back."""


async def answers_healthz(url: str) -> bool:
    """Whether ``url``'s ``/healthz`` answers 200 within :data:`PROBE_TIMEOUT_S`."""
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url.rstrip("/") + HEALTHZ_ROUTE) as response,
        ):
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


def choose(endpoints: list[str], lost: set[str], turn: int) -> str:
    """Round-robin turn ``turn`` among the endpoints not lost, else among all."""
    if not endpoints:
        raise ValueError("no generation endpoint: the workers serve none")
    up = [url for url in endpoints if url not in lost]
    choices = up or endpoints
    return choices[turn % len(choices)]


class PolicyEndpoints:
    """Which generation endpoint the next ``/run`` names (see the module doc)."""

    def __init__(
        self, workers: PolicyWorkers, budget_s: float, probe: Probe = answers_healthz
    ) -> None:
        self.workers = workers
        self.budget_s = budget_s
        self.probe = probe
        self.down: set[str] = set()
        self._turn = 0
        self._readmit: asyncio.Task[None] | None = None

    async def pick(self) -> str:
        """The next endpoint; while the workers serve none (every actor lost, a refit
        waiting for a replacement) wait for one, at most the budget."""
        waited = time.monotonic()
        while not self.workers.endpoints:
            if time.monotonic() - waited >= self.budget_s:
                raise PolicyOutageError(
                    f"no generation worker served for {self.budget_s:g}s "
                    "(rollout.gymUnreachableSeconds): every one was lost"
                )
            await asyncio.sleep(READMIT_PERIOD_S)
        self.down &= set(self.workers.endpoints)  # dropped by a refit: nothing to re-admit
        url = choose(self.workers.endpoints, self.down, self._turn)
        self._turn += 1
        return url

    def all_lost(self) -> bool:
        return all(url in self.down for url in self.workers.endpoints)

    def lost(self, url: str, since: float, error: str) -> bool:
        """A Gym could not reach ``url`` for an attempt that has found no reachable endpoint
        since ``since`` (``time.monotonic``): :meth:`mark_lost`, or past the budget
        (``rollout.gymUnreachableSeconds``), :class:`PolicyOutageError`. Whether every
        endpoint is lost now (the caller backs off)."""
        self.mark_lost(url)
        spent = time.monotonic() - since
        if spent >= self.budget_s:
            raise PolicyOutageError(
                f"no generation endpoint answered a Gym for {spent:.1f}s "
                f"(rollout.gymUnreachableSeconds {self.budget_s:g}); last: {error}"
            )
        return self.all_lost()

    def mark_lost(self, url: str) -> None:
        """A Gym could not reach ``url``: give it out no more until it answers again."""
        if url in self.down or url not in self.workers.endpoints:
            return
        logger.warning("generation endpoint %s lost: no Gym is given it until it answers", url)
        self.down.add(url)
        if self._readmit is None or self._readmit.done():
            self._readmit = asyncio.get_running_loop().create_task(self._readmit_loop())

    async def _readmit_loop(self) -> None:
        while self.down:
            await asyncio.sleep(READMIT_PERIOD_S)
            for url in sorted(self.down):
                if url not in self.workers.endpoints:
                    self.down.discard(url)  # replaced at a refit: its successor is given out
                elif await self.probe(url):
                    self.down.discard(url)
                    logger.info("generation endpoint %s answers again: re-admitted", url)

    async def close(self) -> None:
        task, self._readmit = self._readmit, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
