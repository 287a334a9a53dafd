"""What the controller needs from an environment that keeps rollout state between turns.

Why a protocol: the single controller and the recovery ledger must not know Gym's routes or
record formats (the seed's rule: backend-specific code lives in the backend's module). A
snapshot attempt drives an environment through the same phases whatever the backend:

1. ``prepare`` — (after ``retire``-ing attempts the ledger has abandoned) take a copy of
   every live episode at its next turn boundary, a consistent state, without holding it:
   episodes run on and new ones are admitted (copy-on-park);
2. ``commit`` — export the requested episodes' copies (returned, so environment pods need no
   storage access). Episodes run on after their copy, so under the trainer's cut the
   snapshot keeps only the records of episodes the ledger still has out
   (``EnvironmentSnapshot.restricted_to``);
3. ``resume`` — end the checkpoint; the snapshot is written after this, so rollouts never
   wait for disk. A failed resume after a successful commit is only a warning: the
   environment's checkpoint lease ends it by itself.

A restore hands the records back (``restore``); each restored episode continues under
``attempt + 1`` on the instance that owned it.

:class:`EnvironmentEpisode` is the backend-neutral name of one episode attempt. Its row key
(``<rollout_id>`` at attempt 0, ``<rollout_id>-a<attempt>`` after) is Gym's format, and a new
backend must use it; the ledger stores it as ``gym_instance_id``/``gym_attempt``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

_ROW_KEY = re.compile(r"^(?P<rollout>.+?)(?:-a(?P<attempt>\d+))?$")


class EnvironmentCheckpointError(RuntimeError):
    """An environment phase failed; the snapshot attempt must be discarded."""


@dataclasses.dataclass(frozen=True, order=True)
class EnvironmentEpisode:
    """One attempt of one rollout's episode, on the instance that owns its state."""

    rollout_id: str
    attempt: int
    instance_id: str

    @property
    def row_key(self) -> str:
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    def next_attempt(self) -> EnvironmentEpisode:
        return dataclasses.replace(self, attempt=self.attempt + 1)

    @classmethod
    def from_row_key(cls, row_key: str, instance_id: str) -> EnvironmentEpisode:
        match = _ROW_KEY.match(row_key)
        if match is None:
            raise ValueError(f"not an episode row key: {row_key!r}")
        return cls(match["rollout"], int(match["attempt"] or 0), instance_id)


@dataclasses.dataclass(frozen=True)
class EpisodeRestoreOutcome:
    """What a restore did with each record."""

    restored: tuple[EnvironmentEpisode, ...]
    """Episodes installed under attempt + 1 (ready to be dispatched again)."""
    refused: tuple[tuple[EnvironmentEpisode, str], ...]
    """Episodes that cannot continue (and why): their siblings restart from turn 0."""


@runtime_checkable
class EnvironmentSnapshot(Protocol):
    """The environment's part of one rollout snapshot."""

    @property
    def checkpoint_id(self) -> str:
        """The id the environment phase ran under."""
        ...

    def episodes(self) -> list[EnvironmentEpisode]:
        """The episodes whose records this snapshot holds."""
        ...

    def to_bytes(self) -> bytes:
        """Deterministic bytes for the snapshot's sidecar."""
        ...

    def restricted_to(self, episodes: Collection[EnvironmentEpisode]) -> EnvironmentSnapshot:
        """The same snapshot holding only the records of ``episodes``."""
        ...


@runtime_checkable
class EnvironmentCheckpoint(Protocol):
    """An environment backend's checkpoint participant (see the module doc)."""

    @property
    def holds_rollout_state(self) -> bool:
        """Whether snapshots must capture this environment (turn-level recovery)."""
        ...

    async def prepare(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        retire: Sequence[EnvironmentEpisode] = (),
    ) -> None:
        """Retire ``retire``, then copy every running episode at a boundary by the deadline."""
        ...

    async def commit(
        self, checkpoint_id: str, deadline_ts: float, episodes: Iterable[EnvironmentEpisode]
    ) -> EnvironmentSnapshot:
        """Export the copies of ``episodes``; one without a copy is left out (turn 0)."""
        ...

    async def resume(self, checkpoint_id: str) -> None:
        """End the checkpoint (the environment may prepare the next one)."""
        ...

    async def restore(
        self, checkpoint_id: str, deadline_ts: float, snapshot_bytes: bytes
    ) -> EpisodeRestoreOutcome:
        """Install a snapshot's records under attempt + 1 on their owning instances.

        The environment is idle again when this returns: the next ``prepare`` may follow.
        """
        ...

    async def retire(self, episodes: Iterable[EnvironmentEpisode]) -> None:
        """Refuse and stop these attempts and every earlier attempt of their rollouts."""
        ...

    async def forget(self, rollout_ids: Iterable[str]) -> None:
        """Drop every trace of these rollouts (after their group is trained or dropped)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


@dataclasses.dataclass(frozen=True)
class EmptyEnvironmentSnapshot:
    """The snapshot of an environment that keeps nothing."""

    checkpoint_id: str

    def episodes(self) -> list[EnvironmentEpisode]:
        return []

    def to_bytes(self) -> bytes:
        return b'{"episodes":[],"kind":"none"}'

    def restricted_to(self, episodes: Collection[EnvironmentEpisode]) -> EmptyEnvironmentSnapshot:
        return self


class NoEnvironmentCheckpoint:
    """The backend for environments that keep no state between turns: every phase is free."""

    holds_rollout_state = False

    async def prepare(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        retire: Sequence[EnvironmentEpisode] = (),
    ) -> None:
        return None

    async def commit(
        self, checkpoint_id: str, deadline_ts: float, episodes: Iterable[EnvironmentEpisode]
    ) -> EnvironmentSnapshot:
        pending = list(episodes)
        if pending:
            raise EnvironmentCheckpointError(
                f"{len(pending)} episodes need turn state, but this environment keeps none"
            )
        return EmptyEnvironmentSnapshot(checkpoint_id)

    async def resume(self, checkpoint_id: str) -> None:
        return None

    async def restore(
        self, checkpoint_id: str, deadline_ts: float, snapshot_bytes: bytes
    ) -> EpisodeRestoreOutcome:
        return EpisodeRestoreOutcome(restored=(), refused=())

    async def retire(self, episodes: Iterable[EnvironmentEpisode]) -> None:
        return None

    async def forget(self, rollout_ids: Iterable[str]) -> None:
        return None

    async def close(self) -> None:
        return None


def group_by_instance(
    episodes: Iterable[EnvironmentEpisode],
) -> Mapping[str, list[EnvironmentEpisode]]:
    """Episodes by owning instance, each list sorted (stable request order)."""
    grouped: dict[str, list[EnvironmentEpisode]] = {}
    for episode in episodes:
        grouped.setdefault(episode.instance_id, []).append(episode)
    return {instance: sorted(items) for instance, items in sorted(grouped.items())}


def episode_json(episode: EnvironmentEpisode) -> dict[str, Any]:
    return {
        "rollout_id": episode.rollout_id,
        "attempt": episode.attempt,
        "instance_id": episode.instance_id,
    }
