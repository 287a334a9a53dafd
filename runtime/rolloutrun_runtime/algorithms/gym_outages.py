"""The Gym client's vocabulary of failure: its errors, which failed call is infrastructure,
the backoff against an unreachable endpoint and the per-endpoint outage budget.

Why a module of its own: these are pure decisions (no session, no sockets) that the client,
the rollout pump and the member following all share and that are tested alone, while
:mod:`.gym_client` keeps the I/O (the session, ``/run``, ``/healthz``, the members' addresses).
Moved out of ``gym_client`` unchanged (with the refusals a ``/run`` answer names and the
race of a call against its replica's replacement); ``gym_client`` still exports every name.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from rolloutrun_runtime.aio import EventFirst, unless_set
from rolloutrun_runtime.contract.wire import POLICY_NOT_ANNOUNCED, RESUME_REFUSED


class GymError(RuntimeError):
    """Base of the Gym client's errors."""


class GymCallError(GymError):
    """A Gym ``/run`` call failed or returned something unusable (the attempt fails)."""


class GymResumeRefusedError(GymCallError):
    """The Gym would not continue an episode from the record a ``/run`` carried (stale: a
    side effect past it, or a later attempt there): restart the sibling from turn 0."""


class GymUnavailableError(GymError):
    """A Gym replica cannot be used at all (unhealthy, unknown owner, client not open)."""


class GymUnreachableError(GymUnavailableError):
    """A ``/run`` call never reached a Gym that could answer it (infrastructure, not a sample)."""

    def __init__(self, endpoint: str, detail: str) -> None:
        super().__init__(f"Gym replica {endpoint} is unreachable: {detail}")
        self.endpoint = endpoint


class GymOutageError(GymUnavailableError):
    """A Gym replica stayed unreachable past ``rollout.gymUnreachableSeconds`` (member lost)."""


class GymPolicyUnreachableError(GymError):
    """The Gym answered that its model call could not reach ``policy_url`` (a lost
    generation worker): the attempt is redispatched, never a failed sample."""

    def __init__(self, policy_url: str, detail: str) -> None:
        super().__init__(f"generation endpoint {policy_url} is unreachable: {detail}")
        self.policy_url = policy_url


#: Statuses a proxy or a replica going away answers with; only the Gym's own JSON error body
#: (its 502 for a policy error, its 503 for side-effect storage) makes them about the episode.
UNREACHABLE_STATUSES = frozenset({502, 503, 504})
#: Backoff between attempts against an unreachable endpoint: the first delay, and the most.
BACKOFF_FIRST_S = 0.25
BACKOFF_MAX_S = 5.0


def is_unreachable_status(status: int, body: bytes) -> bool:
    """Whether an HTTP error status came from something other than the Gym (a proxy, a replica
    going away): 502/503/504 without the Gym's ``{"error": {...}}`` body."""
    if status not in UNREACHABLE_STATUSES:
        return False
    try:
        document = json.loads(body)
    except ValueError:
        return True
    return not (isinstance(document, dict) and isinstance(document.get("error"), dict))


def backoff_delay(tries: int, unit: float) -> float:
    """Seconds to wait before try ``tries + 1`` against an unreachable endpoint.

    Exponential from ``BACKOFF_FIRST_S``, capped at ``BACKOFF_MAX_S``, with jitter: ``unit``
    (a draw in [0, 1)) picks a point in the upper half, so siblings that failed together do
    not come back together.
    """
    if tries < 1:
        raise ValueError(f"tries must be at least 1, not {tries}")
    if not 0.0 <= unit < 1.0:
        raise ValueError(f"unit must be in [0, 1), not {unit}")
    ceiling = min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** min(tries - 1, 32))
    return ceiling * (0.5 + 0.5 * unit)


class OutageBudget:
    """Per endpoint: since when it has been unreachable with no answer in between.

    ``unreachable`` raises ``GymOutageError`` once an endpoint's outage has lasted
    ``budget_s``; any answer from it (even an error about an episode) ends the outage.
    """

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if budget_s <= 0:
            raise ValueError(f"the unreachable budget must be positive, not {budget_s}")
        self.budget_s = budget_s
        self._clock = clock
        self._since: dict[str, float] = {}
        #: Told once per outage, when it begins (the endpoint, the error that began it).
        self.on_down: Callable[[str, BaseException], None] | None = None

    def unreachable(self, endpoint: str, error: BaseException) -> float:
        """Record a failed reach; the seconds the outage has lasted (raises when spent)."""
        now = self._clock()
        began = endpoint not in self._since
        spent = now - self._since.setdefault(endpoint, now)
        if began and self.on_down is not None:
            self.on_down(endpoint, error)
        if spent >= self.budget_s:
            raise GymOutageError(
                f"Gym replica {endpoint} has been unreachable for {spent:.1f}s "
                f"(rollout.gymUnreachableSeconds {self.budget_s:g}); last error: {error}. "
                "A member is lost: restart from the latest snapshot"
            ) from error
        return spent

    def answered(self, endpoint: str) -> None:
        self._since.pop(endpoint, None)

    def moved(self, old: str, new: str) -> None:
        """The replica at ``old`` now serves at ``new`` (replaced): an outage goes on under
        the new address from when it began, so a replacement never resets the budget."""
        since = self._since.pop(old, None)
        if since is not None:
            self._since[new] = since

    def down(self, endpoint: str) -> bool:
        return endpoint in self._since

    def outages(self) -> dict[str, float]:
        """The endpoints unreachable now, and since when (the clock's time)."""
        return dict(self._since)


def is_not_announced(status: int, body: bytes) -> bool:
    """Whether a ``/run`` was refused because its ``policy_url`` was not announced."""
    return status == 403 and error_type(body) == POLICY_NOT_ANNOUNCED


def is_resume_refused(status: int, body: bytes) -> bool:
    """Whether a ``/run`` was refused because its ``resume`` record is stale."""
    return status == 409 and error_type(body) == RESUME_REFUSED


def error_type(body: bytes) -> str | None:
    try:
        return str(json.loads(body)["error"]["type"])
    except (ValueError, KeyError, TypeError):
        return None


async def unless_replaced(
    call: Any, replaced: asyncio.Event, url: str, generation: int
) -> tuple[int, bytes]:
    """Await ``call`` unless the replica's generation is replaced first: then the call is
    cancelled and ends as :class:`GymUnreachableError` (its attempt is redispatched)."""
    try:
        result: tuple[int, bytes] = await unless_set(call, replaced)
    except EventFirst:
        raise GymUnreachableError(url, f"member generation {generation} was replaced") from None
    return result
