"""What the controller needs from an environment that keeps rollout state between turns.

Why a protocol: the single controller and the recovery ledger must not know Gym's routes or
record formats (the seed's rule: backend-specific code lives in the backend's module). A
snapshot attempt drives an environment through the same phases whatever the backend:

1. ``prepare`` — (after ``retire``-ing attempts the ledger has abandoned, so the environment
   forgets their episodes) take a copy of every live episode at its next turn boundary, a
   consistent state, without holding it: episodes run on and new ones are admitted
   (copy-on-park);
2. ``commit`` — export the requested episodes' copies (returned, so environment pods need no
   storage access). Episodes run on after their copy, so under the trainer's cut the export
   is *checked* against the ledger (:func:`check_export`): a record of an episode the
   trainer never had out, or a missing one the cut expects, discards the snapshot; records
   of episodes that finished since their copy are dropped;
3. ``resume`` — end the checkpoint; the snapshot is written after this, so rollouts never
   wait for disk. A failed resume after a successful commit is only a warning: the
   environment's checkpoint lease ends it by itself.

Why replicas may fail one by one: an instance that is gone (its pod deleted at a preemption)
must not cost the snapshot the rest of the rollout state. ``prepare`` and ``commit`` report
the instances that failed (:attr:`EnvironmentSnapshot.unavailable`) instead of raising;
their episodes get no record and restart from turn 0 under a new attempt on restore.
:class:`EnvironmentCheckpointError` is left for a phase that cannot run at all.

A restore hands the records back inside the environment's restore scope
(:func:`restore_scope`): each restored episode continues under ``attempt + 1`` on the
instance that owned it, and if anything later in the restore fails, the scope drops what it
installed, so the next incarnation can restore the same snapshot again.

:class:`EnvironmentEpisode` is the backend-neutral name of one episode attempt. Its row key
(``<rollout_id>`` at attempt 0, ``<rollout_id>-a<attempt>`` after) is Gym's format, and a new
backend must use it; the ledger stores it as ``gym_instance_id``/``gym_attempt``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rolloutrun_runtime.experience.rollout_recovery import parse_row_key, row_key_for

logger = logging.getLogger(__name__)


class EnvironmentCheckpointError(RuntimeError):
    """An environment phase failed as a whole; the snapshot attempt must be discarded."""


class ExportMismatchError(EnvironmentCheckpointError):
    """The environment's export does not match the trainer's cut (the message names how)."""


@dataclasses.dataclass(frozen=True, order=True)
class EnvironmentEpisode:
    """One attempt of one rollout's episode, on the instance that owns its state."""

    rollout_id: str
    attempt: int
    instance_id: str

    @property
    def row_key(self) -> str:
        return row_key_for(self.rollout_id, self.attempt)

    def next_attempt(self) -> EnvironmentEpisode:
        return dataclasses.replace(self, attempt=self.attempt + 1)

    @classmethod
    def from_row_key(cls, row_key: str, instance_id: str) -> EnvironmentEpisode:
        rollout_id, attempt = parse_row_key(row_key)  # a RolloutIdError is a ValueError
        return cls(rollout_id, attempt, instance_id)


@dataclasses.dataclass(frozen=True)
class EpisodeRestoreOutcome:
    """What a restore did with each record."""

    restored: tuple[EnvironmentEpisode, ...]
    """Episodes installed under attempt + 1 (ready to be dispatched again)."""
    refused: tuple[tuple[EnvironmentEpisode, str], ...]
    """Episodes that cannot continue (and why): their siblings restart from turn 0."""
    unavailable: tuple[tuple[EnvironmentEpisode, Mapping[str, Any]], ...] = ()
    """Episodes of replicas that did not take the restore (down at start), each with its
    record: as a lost replica's episodes mid-run, each goes on from its record on the
    owner's replacement or a survivor (the ``/run`` carries it), or restarts from turn 0."""


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

    @property
    def unavailable(self) -> Mapping[str, str]:
        """Instances whose phase failed (instance → why): their episodes have no record."""
        ...

    def not_copied(self) -> list[EnvironmentEpisode]:
        """Requested episodes the environment said it has no copy of (they restart at turn 0)."""
        ...

    def record_of(self, episode: EnvironmentEpisode) -> Mapping[str, Any] | None:
        """The record this snapshot holds of ``episode`` (rollout id and attempt), or None:
        what a member replacement continues the episode from (elastic members)."""
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
    ) -> dict[str, str]:
        """Retire ``retire``, then copy every running episode at a boundary by the deadline.

        Returns the instances that failed either (instance → why); the others prepared.
        """
        ...

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        episodes: Iterable[EnvironmentEpisode],
        unavailable: Mapping[str, str] | None = None,
    ) -> EnvironmentSnapshot:
        """Export the copies of ``episodes`` from every instance not in ``unavailable`` (the
        failures ``prepare`` returned); one without a copy is left out (turn 0), and an
        instance whose commit fails joins the snapshot's ``unavailable``."""
        ...

    async def resume(self, checkpoint_id: str) -> None:
        """End the checkpoint (the environment may prepare the next one)."""
        ...

    async def restore(
        self, checkpoint_id: str, deadline_ts: float, snapshot_bytes: bytes
    ) -> EpisodeRestoreOutcome:
        """Install a snapshot's records under attempt + 1 on their owning instances, and open
        the restore scope (use :func:`restore_scope`). A failed restore installs nothing."""
        ...

    async def end_restore(self, checkpoint_id: str, *, keep: bool) -> None:
        """Close the restore scope: keep what it installed, or drop it (and undo the
        retirement of the attempts it replaced). Either way the environment is idle again."""
        ...

    async def retire(self, episodes: Iterable[EnvironmentEpisode]) -> None:
        """Refuse and stop these attempts and every earlier attempt of their rollouts."""
        ...

    async def forget(self, rollout_ids: Iterable[str]) -> None:
        """Drop every trace of these rollouts (after their group is trained or dropped)."""
        ...

    def readdress(self, instance_id: str, url: str) -> None:
        """The replica ``instance_id`` was replaced and serves at ``url`` now (elastic
        members: same instance id, new pod address)."""
        ...

    def lost(self, instance_id: str, why: str) -> None:
        """The replica ``instance_id`` is unreachable (lost): calls to it end now, none is
        sent until it is readdressed."""
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

    @property
    def unavailable(self) -> Mapping[str, str]:
        return {}

    def not_copied(self) -> list[EnvironmentEpisode]:
        return []

    def record_of(self, episode: EnvironmentEpisode) -> Mapping[str, Any] | None:
        return None


class NoEnvironmentCheckpoint:
    """The backend for environments that keep no state between turns: every phase is free."""

    holds_rollout_state = False

    async def prepare(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        retire: Sequence[EnvironmentEpisode] = (),
    ) -> dict[str, str]:
        return {}

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        episodes: Iterable[EnvironmentEpisode],
        unavailable: Mapping[str, str] | None = None,
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

    async def end_restore(self, checkpoint_id: str, *, keep: bool) -> None:
        return None

    async def retire(self, episodes: Iterable[EnvironmentEpisode]) -> None:
        return None

    async def forget(self, rollout_ids: Iterable[str]) -> None:
        return None

    def readdress(self, instance_id: str, url: str) -> None:
        return None

    def lost(self, instance_id: str, why: str) -> None:
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


@contextlib.asynccontextmanager
async def restore_scope(
    environment: EnvironmentCheckpoint,
    checkpoint_id: str,
    deadline_ts: float,
    snapshot_bytes: bytes,
) -> AsyncIterator[EpisodeRestoreOutcome]:
    """Restore a snapshot's episodes for the ``async with`` body: kept when it completes,
    dropped when it raises (the seed's restore scope).

    Why: a restore that fails after the environment installed its episodes (e.g. the ledger
    refuses them) would leave their ``attempt + 1`` installed, and the next incarnation's
    restore of the same snapshot would then be refused ("already ran here") and lose their
    turns. A failed drop is only a warning: the environment's lease drops it by itself.
    """
    outcome = await environment.restore(checkpoint_id, deadline_ts, snapshot_bytes)
    try:
        yield outcome
    except GeneratorExit:
        raise  # abandoned without an exit: the environment's lease drops it
    except BaseException:
        try:
            await environment.end_restore(checkpoint_id, keep=False)
        except EnvironmentCheckpointError as error:
            logger.warning(
                "dropping restore %s failed (its lease drops it): %s", checkpoint_id, error
            )
        raise
    try:
        await environment.end_restore(checkpoint_id, keep=True)
    except EnvironmentCheckpointError as error:
        # Its lease ran out first and dropped the episodes: a /run for attempt + 1 then
        # finds nothing to continue and the environment refuses or restarts it safely.
        logger.warning("keeping restore %s failed: %s", checkpoint_id, error)


@dataclasses.dataclass(frozen=True)
class ExportCheck:
    """An export checked against the cut (:func:`check_export`)."""

    kept: EnvironmentSnapshot
    """The records of the episodes still out at the cut."""
    finished_since_copy: int
    """Records dropped because their episode is not out any more (it finished or was given
    up after its copy; its result, if any, is in the capture)."""
    without_record: tuple[EnvironmentEpisode, ...]
    """Episodes out at the cut with no record: on restore they restart from turn 0."""


def check_export(
    snapshot: EnvironmentSnapshot,
    requested: Collection[EnvironmentEpisode],
    still_out: Collection[EnvironmentEpisode],
) -> ExportCheck:
    """Check ``snapshot`` (exported for ``requested``) against the episodes ``still_out`` at the
    cut; raise :class:`ExportMismatchError` when they disagree.

    Episodes run on after their copy, so two differences are expected and kept apart: a record
    whose episode finished since (dropped), and an episode dispatched after the commit or
    reported ``not_copied`` (no record, restarts from turn 0). Anything else is a mismatch
    that a restore would turn into a wrong episode, so the snapshot is discarded:

    * a record of an episode the trainer did not ask for (the cut does not know it: another
      attempt, another instance, a rollout the ledger never had out), or a record twice;
    * an episode the cut expects (asked for, still out, on an instance that answered) that
      the export neither holds nor reports as not copied.
    """
    wanted = set(requested)
    out = set(still_out)
    counts = Counter(snapshot.episodes())
    unknown = sorted(e for e in counts if e not in wanted)
    if unknown:
        raise ExportMismatchError(
            f"the export holds {len(unknown)} episodes the cut does not know, e.g. "
            f"{unknown[0].row_key} on {unknown[0].instance_id}"
        )
    twice = sorted(e for e, n in counts.items() if n > 1)
    if twice:
        raise ExportMismatchError(
            f"the export holds {twice[0].row_key} on {twice[0].instance_id} "
            f"{counts[twice[0]]} times"
        )
    explained = set(counts) | set(snapshot.not_copied())
    missing = sorted(
        e for e in wanted & out if e not in explained and e.instance_id not in snapshot.unavailable
    )
    if missing:
        raise ExportMismatchError(
            f"the export is missing {len(missing)} episodes the cut expects, e.g. "
            f"{missing[0].row_key} on {missing[0].instance_id} (neither a record nor reported "
            "not copied)"
        )
    kept = snapshot.restricted_to(out)
    held = set(kept.episodes())
    return ExportCheck(
        kept=kept,
        finished_since_copy=len(counts) - len(held),
        without_record=tuple(sorted(out - held)),
    )
