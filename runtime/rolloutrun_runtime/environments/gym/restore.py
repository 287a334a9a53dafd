"""Turn-level restore: which state an episode continues from, how it is installed, undone.

Why apart from the control plane: the decision is the one place where a restore could repeat
a side effect, so it is a pure function of the snapshot's record, the replica's own copy of
the episode and the revision the run's side-effect log has applied, tested as a table. The
control plane (:mod:`rolloutrun_runtime.environments.gym.control`) only gathers those
inputs and calls :func:`install_successor` and, for a dropped restore, :func:`undo_installs`.

The rules: a record is installed under ``attempt + 1``. A record whose rollout already
applied side effects past the record's revision (an older attempt ran on after the
snapshot) is refused: continuing it would repeat a side effect, so its sibling restarts from
turn 0 under a new rollout id. An episode that ran on after its copy is continued from the
replica's own newer state when that state is consistent (:func:`choose_restore_source`): at
the boundary where its trainer vanished, or finished (the successor returns its result).
A dropped restore (the trainer's restore failed later, e.g. its ledger refused the episodes)
removes the installed attempts and undoes the retirement of the ones they replaced. A restore
arrives in chunks that fit the Gym's request limit; :func:`restore_records` installs one
chunk and adds to the one list of installs a drop undoes, so a restore is all or nothing
across its chunks.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import MutableMapping
from typing import Any

from rolloutrun_runtime.environments.gym.episode import (
    CANCELLED_REASON,
    LIVE_PHASES,
    POLICY_FAILED_PREFIX,
    Episode,
    EpisodeId,
    Phase,
)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Installed:
    """What one restored record changed, so a dropped restore can undo it."""

    previous: EpisodeId
    successor: EpisodeId
    retired_before: int | None
    previous_state: tuple[Phase, str | None] | None


def resumable_phase(episode: Episode) -> Phase | None:
    """The live phase an episode can continue from, or None.

    An episode whose ``/run`` was cancelled (its trainer vanished), or whose model call failed
    (``POLICY_FAILED_PREFIX``: the trainer serving the policy vanished first), is still
    consistent: a cancel lands only at an await, there is none between a side effect's
    record returning and the state change, and a cancel while the record is written waits
    for the tool round to finish (``AgentLoop._tool_round``). An episode still behind the
    revision its log claims (the write failed, or another replica ran the rollout on) is
    refused by :func:`choose_restore_source` (the revisions differ). Its pending tool call
    tells which boundary it was at.
    """
    if episode.phase in LIVE_PHASES:
        return episode.phase
    if episode.phase is Phase.ABANDONED and episode.error == CANCELLED_REASON:
        return Phase.AWAIT_TOOL if episode.pending is not None else Phase.AWAIT_MODEL
    # A failed model call (the trainer serving the policy vanished) changed nothing: the
    # episode rests at the boundary before that call.
    failed_call = episode.phase is Phase.FAILED and episode.pending is None
    if failed_call and (episode.error or "").startswith(POLICY_FAILED_PREFIX):
        return Phase.AWAIT_MODEL
    return None


def choose_restore_source(
    snapshot: Episode,
    in_memory: Episode | None,
    applied_revision: int,
    *,
    successor_exists: bool,
) -> tuple[dict[str, Any] | None, str]:
    """Which record a restore continues from: ``(record, "")`` or ``(None, reason)``.

    Prefer the replica's own copy of the same attempt when it survived and got further than
    the snapshot (no progress lost), finished included (its ``/run`` returns the result);
    otherwise the snapshot's record, unless a side effect
    was applied after it (continuing would repeat that effect).
    """
    if successor_exists:
        return None, f"attempt {snapshot.episode_id.attempt + 1} already ran here"
    if snapshot.phase not in LIVE_PHASES:
        return None, f"episode was {snapshot.phase.value} at the snapshot"
    if in_memory is not None and in_memory.revision >= snapshot.revision:
        if in_memory.phase is Phase.FINISHED and in_memory.revision == applied_revision:
            # It finished here after the snapshot (its result died with the trainer): the
            # successor hands that result back at once, nothing redone, no effect repeated.
            return in_memory.to_record(), ""
        phase = resumable_phase(in_memory)
        if phase is not None and in_memory.revision == applied_revision:
            record = in_memory.to_record()
            record["phase"], record["error"] = phase.value, None
            return record, ""
    if applied_revision > snapshot.revision:
        return None, (
            f"rollout already applied side effects up to revision {applied_revision}, past "
            f"the snapshot's {snapshot.revision}; continuing would repeat one"
        )
    return snapshot.to_record(), ""


def member_resume_source(
    record: Episode,
    attempt: int,
    in_memory: Episode | None,
    applied_revision: int,
) -> tuple[dict[str, Any] | None, str]:
    """Elastic members: which record a ``/run`` that carries ``record`` (the lost replica's
    last published copy) continues from under ``attempt``, or ``(None, reason)``.

    Only a later attempt of the same rollout may continue a record (an attempt number is
    never reused for a relaunch from an earlier turn); then the restore rules hold as for a
    trainer's restore (:func:`choose_restore_source`): never past a side effect applied
    after the record was copied.
    """
    if attempt <= record.episode_id.attempt:
        return None, (
            f"attempt {attempt} does not follow the record's attempt {record.episode_id.attempt}"
        )
    return choose_restore_source(record, in_memory, applied_revision, successor_exists=False)


def install_successor(
    episodes: MutableMapping[EpisodeId, Episode],
    retired: dict[str, int],
    unclaimed: set[EpisodeId],
    previous: EpisodeId,
    episode: Episode,
) -> Installed:
    """Retire ``previous`` (and stop it if still running), install ``episode`` unclaimed;
    what changed, so :func:`undo_installs` can put it back."""
    rollout_id = previous.rollout_id
    old = episodes.get(previous)
    installed = Installed(
        previous=previous,
        successor=episode.episode_id,
        retired_before=retired.get(rollout_id),
        previous_state=(old.phase, old.error) if old is not None else None,
    )
    retired[rollout_id] = max(retired.get(rollout_id, -1), previous.attempt)
    if old is not None and old.phase in LIVE_PHASES:
        old.phase, old.error = Phase.ABANDONED, "superseded by a restore"
    episodes[episode.episode_id] = episode
    unclaimed.add(episode.episode_id)
    return installed


def restore_records(
    server: Any,
    retired: dict[str, int],
    unclaimed: set[EpisodeId],
    installs: list[Installed],
    records: list[dict[str, Any]],
) -> tuple[list[str], list[tuple[str, str]]]:
    """Install each record's successor on ``server`` (a ``GymServer``), or refuse it.

    Returns the row keys restored and ``(row key, reason)`` of those refused; what was
    installed is appended to ``installs`` (one list per restore, across its chunks, so a drop
    undoes them all). Raises :class:`EpisodeRecordError` for a malformed record: the
    records before it stay in ``installs`` and the trainer drops the restore.
    """
    restored: list[str] = []
    refused: list[tuple[str, str]] = []
    for record in records:
        previous = Episode.from_record(record)
        successor = EpisodeId(previous.episode_id.rollout_id, previous.episode_id.attempt + 1)
        if successor in unclaimed:  # a repeated restore of the same record
            restored.append(successor.row_key)
            continue
        source, reason = choose_restore_source(
            previous,
            server.episodes.get(previous.episode_id),
            server.effects.applied_revision(previous.episode_id.rollout_id),
            successor_exists=successor in server.episodes,
        )
        if source is None:
            logger.warning(
                "gym %s: restore of %s refused: %s",
                server.instance_id,
                previous.episode_id.row_key,
                reason,
            )
            refused.append((previous.episode_id.row_key, reason))
            continue
        episode = Episode.from_record(source, attempt=successor.attempt)
        installs.append(
            install_successor(server.episodes, retired, unclaimed, previous.episode_id, episode)
        )
        restored.append(episode.episode_id.row_key)
    return restored, refused


def undo_installs(
    episodes: MutableMapping[EpisodeId, Episode],
    retired: dict[str, int],
    unclaimed: set[EpisodeId],
    installs: list[Installed],
    instance_id: str,
) -> None:
    """Remove what ``installs`` installed; the replaced attempts are as before."""
    for installed in reversed(installs):
        successor = installed.successor
        if successor not in unclaimed:
            # A /run already continues it (or a retire refused it): nothing to undo.
            logger.warning(
                "gym %s: restored episode %s is no longer unclaimed; kept",
                instance_id,
                successor.row_key,
            )
            continue
        unclaimed.discard(successor)
        episodes.pop(successor, None)
        rollout_id = installed.previous.rollout_id
        if installed.retired_before is None:
            retired.pop(rollout_id, None)
        else:
            retired[rollout_id] = installed.retired_before
        old = episodes.get(installed.previous)
        if old is not None and installed.previous_state is not None:
            old.phase, old.error = installed.previous_state
    logger.info("gym %s: dropped %d restored episodes", instance_id, len(installs))
