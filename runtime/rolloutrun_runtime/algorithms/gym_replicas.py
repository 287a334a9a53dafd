"""The Gym replicas as the trainer's client sees them, and its pure decisions on them.

Why apart from :mod:`.gym_client`: which replica takes a new attempt (round robin over the
active replicas that are up, warm standbys standing in one for one for those that are down)
and whether a ``/healthz`` answer re-admits a replica are decisions, tested alone; the
client only asks them with its outage state.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from rolloutrun_runtime.contract.wire import HEALTHZ_ROUTE


def capabilities(health: Any) -> frozenset[str]:
    """The capabilities a ``/healthz`` answer names (none when it names none)."""
    named = health.get("capabilities") if isinstance(health, dict) else None
    return frozenset(str(c) for c in named) if isinstance(named, list) else frozenset()


@dataclasses.dataclass
class GymReplica:
    """One Gym server: its base URL and the instance id the ledger records."""

    url: str
    instance_id: str
    generation: int = 0
    """Its member generation (the operator's replacement count of this index)."""
    replaced: asyncio.Event | None = None
    """Set when this generation was replaced: its calls in flight end as unreachable."""
    capabilities: frozenset[str] = frozenset()
    """What its ``/healthz`` named (:data:`MEMBER_RESUME_CAPABILITY`: it takes a record)."""
    identified: bool = False
    """Whether ``instance_id`` is what the replica answered (until it has: a placeholder)."""


def pick_replica(
    replicas: list[GymReplica], turn: int, down: Callable[[str], bool], active: int | None = None
) -> int:
    """The index of the replica for round-robin turn ``turn``.

    The first ``active`` replicas (default: all) take the new episodes, those that are up
    (not lost, or re-admitted). The ones after them are warm standbys: as many of those that
    are up, in index order, as active replicas are down stand in for them, so a lost
    replica's share moves to a standby at once and back when it is re-admitted. Every
    replica down: all are chosen from (the calls find out, and the outage budget ends the
    run)."""
    count = len(replicas) if active is None else min(active, len(replicas))
    up = [i for i, replica in enumerate(replicas) if not down(replica.url)]
    active_up = [i for i in up if i < count]
    standbys_up = [i for i in up if i >= count]
    choices = active_up + standbys_up[: count - len(active_up)]
    choices = choices or list(range(len(replicas)))
    return choices[turn % len(choices)]


def health_problem(
    status: int, body: Any, named: str, replica: GymReplica, replicas: list[GymReplica]
) -> str | None:
    """Why a ``/healthz`` answer does not re-admit ``replica`` (None: it does). A replica
    not identified yet takes the id it names, unless another replica already holds it."""
    if status != 200 or not isinstance(body, dict):
        return f"{HEALTHZ_ROUTE} answered {status}"
    if replica.identified and named and named != replica.instance_id:
        return f"answers as {named!r}, not {replica.instance_id!r}"
    if not replica.identified and any(
        other is not replica and other.identified and other.instance_id == named
        for other in replicas
    ):
        return f"answers as {named!r}, the id of another replica"
    return None
