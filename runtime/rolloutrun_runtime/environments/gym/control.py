"""The Gym checkpoint control plane: copy, export, restore and resume episodes at turn level.

Why in the Gym: a multi-turn episode's state (the ``reach_target`` counter, the transcript so
far) lives in the Gym replica between turns, so only the Gym can freeze it at a consistent
point and continue it after a restart. The trainer drives it over bearer-token routes under
``/ng-control/v1/checkpoint/``; every call carries a ``checkpoint_id`` and ``deadline_s``
(seconds from receipt on the replica's monotonic clock: the pods' wall clocks may disagree),
and prepare, commit and restore are idempotent for the same id.

Phases: ``idle → preparing → prepared → committed``, ``idle → restored``; ``resume`` returns
any phase to ``idle``; ``drop`` returns ``restored`` to ``idle`` undoing the restore.

* **prepare** opens a copy window: every running episode, at its next turn boundary (before a
  model call, after a tool round, where it holds no half-done work), leaves a copy of its
  record (``Episode.to_record``) and goes straight on (copy-on-park). Episodes no ``/run`` is
  driving (restored, not yet claimed) are copied at once. It answers once every ``/run``
  running when it began has left a copy or ended. Nothing waits: ``/run`` admission stays
  open and no episode is held, so a snapshot costs the rollouts almost nothing. The copy is
  a consistent state at a boundary, so it is as good as a parked episode for the trainer's
  cut; what the episode does after it (more turns, side effects) is exactly what it would
  have done after a resume, and the restore rules below already cover it.
* **commit** closes the window and exports the requested episodes' latest copies in the
  response: snapshots need no storage access in the Gym pod (only its side-effect log may
  write, under ``gym-audit/``; see :mod:`rolloutrun_runtime.environments.gym.effects`). A
  requested episode without a copy (it finished before its next boundary, or its ``/run``
  has not arrived yet) is listed under ``not_copied`` with its state, not refused: the
  trainer restarts it from turn 0 if it is still out at the cut, and drops records of
  episodes that are no longer out. The answer is kept, so a repeated commit returns the
  same bytes.
* **resume** ends the checkpoint. The last 64 resumed ids are remembered, so a stale trainer
  cannot re-prepare one.
* **restore** installs records under ``attempt + 1``; a ``/run`` for that id continues the
  episode instead of starting it, from the record or from the replica's own newer state;
  a record whose continuation would repeat a side effect is refused (the rules, and why:
  :mod:`rolloutrun_runtime.environments.gym.restore`). The restore is the trainer's
  *restore scope*: ``resume`` keeps what it installed, ``drop`` (or a lease expiry, or a
  newer trainer) undoes it, so the same snapshot can be restored again. The records come
  in chunks under ``gym.requestMaxBytes`` under one id: chunk 0 opens the scope, later chunks
  join it, and a drop undoes them all.
* **retire** refuses an attempt and all earlier ones of its rollout (they stop at their next
  boundary) until **forget** drops the rollout, and forgets their episodes that no ``/run``
  drives (finished, ended, or restored and never claimed), so no later copy includes them.
* **lease**: each call extends the lease to receipt + ``deadline_s`` + grace; if the trainer
  stops calling, a watchdog resumes the Gym on its own, so a vanished trainer never wedges it.
* **trainer identity**: each call may name its trainer (``trainer``: an id, the
  incarnation and the process start time). The first call of a newer trainer ends whatever
  checkpoint an older one left open (it was killed mid-snapshot: its replacement must not
  wait out that lease to restore or snapshot), and calls of an older trainer are refused
  from then on (409), so a trainer that was replaced but still runs cannot drive the Gym.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from rolloutrun_runtime.contract.pod import ENV_GYM_TOKEN
from rolloutrun_runtime.contract.wire import (
    CONTROL_ROUTES,
    CheckpointCall,
    CommitAnswer,
    CommitCall,
    ControlState,
    EndCall,
    ForgetAnswer,
    ForgetCall,
    NotCopied,
    RefusedRestore,
    RestoreAnswer,
    RestoreCall,
    RetireAnswer,
    RetireCall,
    TrainerIdentity,
    control_route,
)
from rolloutrun_runtime.environments.gym.control_http import ControlError, fail, guard
from rolloutrun_runtime.environments.gym.episode import (
    LIVE_PHASES,
    Episode,
    EpisodeId,
    EpisodeRecordError,
    Phase,
    RestingEpisodes,
)
from rolloutrun_runtime.environments.gym.restore import (
    Installed,
    choose_restore_source,
    restore_records,
    resumable_phase,
    undo_installs,
)

__all__ = [
    "ControlError",
    "ControlPhase",
    "EpisodeRetiredError",
    "GymCheckpointControl",
    "TrainerIdentity",
    "choose_restore_source",
    "resumable_phase",
]

logger = logging.getLogger(__name__)

REMEMBERED_RESUMES = 64


class ControlPhase(enum.StrEnum):
    IDLE = "idle"
    PREPARING = "preparing"
    PREPARED = "prepared"
    COMMITTED = "committed"
    RESTORED = "restored"


class EpisodeRetiredError(Exception):
    """The episode's attempt was retired by the trainer; it stops at this boundary."""


class GymCheckpointControl:
    """The control plane of one Gym replica (see the module doc).

    ``server`` is a :class:`~rolloutrun_runtime.environments.gym.server.GymServer`; the
    control plane adds its boundary hook, a middleware that tracks each ``/run`` and its routes.
    """

    def __init__(
        self,
        server: Any,
        token: str | None = None,
        *,
        grace_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        watchdog_interval_s: float = 0.5,
    ) -> None:
        self.server = server
        self.token = token if token is not None else os.environ.get(ENV_GYM_TOKEN) or None
        self.grace_s = (
            float(grace_s)
            if grace_s is not None
            else float(server.cfg.gym.checkpoint_lease_grace_seconds)
        )
        self.clock = clock
        self.watchdog_interval_s = watchdog_interval_s
        self.phase = ControlPhase.IDLE
        self.checkpoint_id: str | None = None
        self.lease_deadline: float | None = None
        #: The newest trainer that called (None until one names itself).
        self.trainer: TrainerIdentity | None = None
        self.resumed: collections.deque[str] = collections.deque(maxlen=REMEMBERED_RESUMES)
        #: The resumed ids whose restore was dropped rather than kept.
        self.dropped: collections.deque[str] = collections.deque(maxlen=REMEMBERED_RESUMES)
        #: What the open restore installed (undone by a drop).
        self._installed: list[Installed] = []
        self.retired: dict[str, int] = {}  # rollout_id -> highest refused attempt
        self.restored_unclaimed: set[EpisodeId] = set()
        #: The copy window's records, the newest per episode (prepare until commit).
        self.copies: dict[EpisodeId, dict[str, Any]] = {}
        #: Each running ``/run`` and the episode it drives (known from its first boundary).
        self._runs: dict[asyncio.Task[Any], EpisodeId | None] = {}
        #: What the idle copy looks at (with the restored unclaimed), not every kept episode.
        self.resting = RestingEpisodes(server.episodes)
        #: The ``/run``s that were running when prepare began and have not left a copy.
        self._awaiting: set[asyncio.Task[Any]] = set()
        self._changed = asyncio.Event()
        self._commit_result: CommitAnswer | None = None
        #: The open restore's answer per chunk (a repeated chunk gets the same answer).
        self._restore_results: dict[int, RestoreAnswer] = {}
        self._watchdog: asyncio.Task[None] | None = None
        server.hooks.append(self._boundary_hook)
        server.app.middlewares.append(self._run_middleware)
        handlers = {
            "status": self._status,
            "prepare": self._prepare,
            "renew": self._renew,
            "commit": self._commit,
            "resume": self._resume,
            "drop": self._drop,
            "restore": self._restore,
            "retire": self._retire,
            "forget": self._forget,
        }
        for name, method in CONTROL_ROUTES.items():
            server.app.router.add_route(
                method, control_route(name), guard(lambda: self.token, self._admit, handlers[name])
            )
        server.app.on_startup.append(self._start_watchdog)
        server.app.on_cleanup.append(self._stop_watchdog)

    # ------------------------------------------------------------------ episode side
    @property
    def runs_in_flight(self) -> int:
        return len(self._runs)

    @property
    def copying(self) -> bool:
        """Whether episodes leave a copy at their boundaries (prepare until commit)."""
        return self.phase in (ControlPhase.PREPARING, ControlPhase.PREPARED)

    async def _boundary_hook(self, episode: Episode, where: str) -> None:
        self._stop_if_retired(episode)
        task = asyncio.current_task()
        if task is not None and task in self._runs:
            self._runs[task] = episode.episode_id
            self.resting.driven(episode.episode_id)
        if self.copying:
            self.copies[episode.episode_id] = episode.to_record()
            self._copied(task)

    def _stop_if_retired(self, episode: Episode) -> None:
        episode_id = episode.episode_id
        refused = self.retired.get(episode_id.rollout_id)
        if refused is not None and episode_id.attempt <= refused:
            episode.phase, episode.error = Phase.ABANDONED, "retired by the trainer"
            raise EpisodeRetiredError(
                f"episode {episode_id.row_key} was retired (attempts up to {refused} of "
                f"rollout {episode_id.rollout_id!r} are refused)"
            )

    @web.middleware
    async def _run_middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if request.path != "/run" or request.method != "POST":
            return await handler(request)
        task = asyncio.current_task()
        assert task is not None
        self._runs[task] = None
        try:
            return await handler(request)
        except EpisodeRetiredError as error:
            return fail(409, str(error))
        finally:
            self.resting.run_ended(self._runs.pop(task))
            self._copied(task)

    def _copied(self, task: asyncio.Task[Any] | None) -> None:
        """``task``'s ``/run`` left its copy or ended: a prepare wakes once all did, not at each."""
        if task in self._awaiting:
            self._awaiting.discard(task)
            if not self._awaiting:
                self._changed.set()

    def _copy_idle_episodes(self) -> None:
        """Copy the live episodes no ``/run`` drives: they rest at a boundary already."""
        driven = {episode_id for episode_id in self._runs.values() if episode_id is not None}
        for episode in self.resting.live(also=self.restored_unclaimed):
            if episode.episode_id not in driven and not self._is_retired(episode.episode_id):
                self.copies[episode.episode_id] = episode.to_record()

    def _is_retired(self, episode_id: EpisodeId) -> bool:
        refused = self.retired.get(episode_id.rollout_id)
        return refused is not None and episode_id.attempt <= refused

    # ------------------------------------------------------------------ plumbing
    def _admit(self, trainer: TrainerIdentity | None) -> None:
        """Let ``trainer`` drive the control plane: refuse an older trainer's call; a newer
        trainer's first call ends the checkpoint its predecessor left open."""
        if trainer is None:
            return
        current = self.trainer
        if current is not None and trainer.id != current.id:
            if trainer.rank < current.rank:
                raise ControlError(
                    409,
                    f"trainer {trainer.describe()} was superseded by trainer {current.describe()}",
                )
            if self.phase is not ControlPhase.IDLE and self.checkpoint_id is not None:
                self._reopen(
                    self.checkpoint_id,
                    why=f"ended: trainer {trainer.describe()} superseded {current.describe()}",
                    drop_restore=True,
                )
        if current is None or trainer.id != current.id:
            logger.info("gym %s: driven by trainer %s", self.server.instance_id, trainer.describe())
        self.trainer = trainer

    def _deadline(self, deadline_s: float) -> float:
        """The call's deadline on this replica's clock: ``deadline_s`` from now (its receipt)."""
        return self.clock() + deadline_s

    def _extend_lease(self, deadline: float) -> None:
        self.lease_deadline = deadline + self.grace_s

    def _lease_remaining(self) -> float | None:
        left = None if self.lease_deadline is None else self.lease_deadline - self.clock()
        return None if left is None else round(max(left, 0.0), 3)

    def _check_id(self, checkpoint_id: str, *, allowed: set[ControlPhase]) -> bool:
        """Whether this call repeats the current id (idempotent); refuse conflicts."""
        if checkpoint_id in self.resumed:
            raise ControlError(409, f"checkpoint {checkpoint_id} was already resumed")
        if self.phase is ControlPhase.IDLE:
            return False
        if self.checkpoint_id != checkpoint_id:
            raise ControlError(
                409, f"busy with checkpoint {self.checkpoint_id} ({self.phase.value})"
            )
        if self.phase not in allowed:
            raise ControlError(409, f"checkpoint {checkpoint_id} is {self.phase.value}")
        return True

    def _state(self) -> dict[str, Any]:
        """The fields of every answer (:class:`ControlState`)."""
        return {
            "instance_id": self.server.instance_id,
            "phase": self.phase.value,
            "checkpoint_id": self.checkpoint_id,
            "lease_remaining_s": self._lease_remaining(),
            "trainer": self.trainer,
            "copied": sorted(e.row_key for e in self.copies),
            "awaiting_copy": len(self._awaiting),
            "runs_in_flight": self.runs_in_flight,
        }

    def _answer(self) -> ControlState:
        return ControlState(**self._state())

    # ------------------------------------------------------------------ routes
    async def _status(self, _: dict[str, Any]) -> ControlState:
        return self._answer()

    async def _prepare(self, body: dict[str, Any]) -> ControlState:
        call = CheckpointCall.model_validate(body)
        repeat = self._check_id(
            call.checkpoint_id, allowed={ControlPhase.PREPARING, ControlPhase.PREPARED}
        )
        if not repeat:
            self.phase, self.checkpoint_id = ControlPhase.PREPARING, call.checkpoint_id
            self.copies = {}
            self._awaiting = set(self._runs)
            self._copy_idle_episodes()
            logger.info(
                "gym %s: preparing checkpoint %s (%d runs to copy)",
                self.server.instance_id,
                call.checkpoint_id,
                len(self._awaiting),
            )
        deadline = self._deadline(call.deadline_s)
        self._extend_lease(deadline)
        while self._awaiting and self.checkpoint_id == call.checkpoint_id:
            remaining = deadline - self.clock()
            if remaining <= 0:
                raise ControlError(
                    503,
                    f"checkpoint {call.checkpoint_id}: {len(self._awaiting)} episodes did not "
                    "reach a turn boundary before the deadline",
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 0.5))
            except TimeoutError:
                pass
        if self.checkpoint_id != call.checkpoint_id:
            # Ended while we waited (lease expired, or a newer trainer took over): never
            # mark another checkpoint, or none, as prepared.
            raise ControlError(409, f"checkpoint {call.checkpoint_id} ended while preparing")
        self.phase = ControlPhase.PREPARED
        return self._answer()

    async def _renew(self, body: dict[str, Any]) -> ControlState:
        call = CheckpointCall.model_validate(body)
        if self.phase is ControlPhase.IDLE or self.checkpoint_id != call.checkpoint_id:
            raise ControlError(409, f"checkpoint {call.checkpoint_id} is not in progress")
        self._extend_lease(self._deadline(call.deadline_s))
        return self._answer()

    async def _commit(self, body: dict[str, Any]) -> CommitAnswer:
        call = CommitCall.model_validate(body)
        repeat = self._check_id(
            call.checkpoint_id, allowed={ControlPhase.PREPARED, ControlPhase.COMMITTED}
        )
        if not repeat:
            raise ControlError(409, f"checkpoint {call.checkpoint_id} was not prepared")
        self._extend_lease(self._deadline(call.deadline_s))
        if self._commit_result is not None:  # the window is closed: the same answer again
            return self._commit_result
        self.phase = ControlPhase.COMMITTED  # closes the copy window
        copies = self.copies
        wanted = (
            {EpisodeId.from_row_key(key) for key in call.episodes}
            if call.episodes is not None
            else set(copies)
        )
        self._commit_result = CommitAnswer(
            **self._state(),
            records=[copies[e] for e in sorted(wanted & copies.keys())],
            not_copied=[
                NotCopied(episode=e.row_key, state=self._not_copied_state(e))
                for e in sorted(wanted - copies.keys())
            ],
        )
        return self._commit_result

    def _not_copied_state(self, episode_id: EpisodeId) -> str:
        """Why a requested episode has no record: the trainer restarts it from turn 0."""
        episode = self.server.episodes.get(episode_id)
        if episode is None:
            return "unknown here (its /run has not arrived)"
        if episode.phase in LIVE_PHASES:
            return f"{episode.phase.value}, no boundary reached since prepare"
        return episode.phase.value

    async def _resume(self, body: dict[str, Any]) -> ControlState:
        call = EndCall.model_validate(body)
        if call.checkpoint_id in self.resumed:
            return self._answer()
        if self.phase is not ControlPhase.IDLE and self.checkpoint_id != call.checkpoint_id:
            raise ControlError(
                409, f"busy with checkpoint {self.checkpoint_id}, not {call.checkpoint_id}"
            )
        self._reopen(call.checkpoint_id, why="resumed")
        return self._answer()

    async def _drop(self, body: dict[str, Any]) -> ControlState:
        """End a restore scope undoing it: the trainer's restore failed after this one."""
        call = EndCall.model_validate(body)
        if call.checkpoint_id in self.resumed:
            if call.checkpoint_id in self.dropped:
                return self._answer()
            raise ControlError(409, f"restore {call.checkpoint_id} was already kept")
        if self.phase is not ControlPhase.RESTORED or self.checkpoint_id != call.checkpoint_id:
            raise ControlError(
                409,
                f"{call.checkpoint_id} is not an open restore "
                f"(phase {self.phase.value}, checkpoint {self.checkpoint_id})",
            )
        self._reopen(call.checkpoint_id, why="dropped", drop_restore=True)
        return self._answer()

    def _reopen(self, checkpoint_id: str, why: str, *, drop_restore: bool = False) -> None:
        """Return to idle; an open restore is kept, or undone with ``drop_restore``."""
        self.resumed.append(checkpoint_id)
        previous = self.phase
        if previous is ControlPhase.RESTORED and drop_restore:
            self._undo_restore()
            self.dropped.append(checkpoint_id)
        self._installed = []
        self.phase, self.checkpoint_id, self.lease_deadline = ControlPhase.IDLE, None, None
        self.copies, self._awaiting = {}, set()
        self._commit_result = None
        self._restore_results = {}
        logger.info(
            "gym %s: checkpoint %s %s (was %s)",
            self.server.instance_id,
            checkpoint_id,
            why,
            previous.value,
        )

    async def _restore(self, body: dict[str, Any]) -> RestoreAnswer:
        """Install one chunk of a restore (see :class:`RestoreCall`): chunk 0 opens the
        restore scope, a later chunk joins it, so a ``drop`` undoes every chunk together."""
        call = RestoreCall.model_validate(body)
        repeat = self._check_id(call.checkpoint_id, allowed={ControlPhase.RESTORED})
        if call.chunk > 0 and not repeat:
            # Its earlier chunks were dropped (lease, newer trainer) or never arrived:
            # installing this one alone would leave the restore half installed.
            raise ControlError(
                409,
                f"restore {call.checkpoint_id}: chunk {call.chunk} arrived but the restore is "
                "not open (chunk 0 opens it; a dropped restore's later chunks are refused)",
            )
        self._extend_lease(self._deadline(call.deadline_s))
        if repeat and call.chunk in self._restore_results:
            return self._restore_results[call.chunk]
        self.phase, self.checkpoint_id = ControlPhase.RESTORED, call.checkpoint_id
        if not repeat:
            self._installed = []
        # Decide against every effect the run applied, on any replica, up to now.
        await asyncio.to_thread(self.server.effects.refresh)
        if self.checkpoint_id != call.checkpoint_id:  # the lease or a newer trainer ended it
            raise ControlError(409, f"restore {call.checkpoint_id} ended while restoring")
        try:
            restored, refused = restore_records(
                self.server, self.retired, self.restored_unclaimed, self._installed, call.records
            )
        except EpisodeRecordError as error:
            raise ControlError(
                400, f"checkpoint {call.checkpoint_id} chunk {call.chunk}: {error}"
            ) from error
        answer = RestoreAnswer(
            **self._state(),
            restored=restored,
            refused=[RefusedRestore(episode=key, reason=why) for key, why in refused],
        )
        self._restore_results[call.chunk] = answer
        logger.info(
            "gym %s: restored %d episodes (%d refused) for checkpoint %s chunk %d",
            self.server.instance_id,
            len(restored),
            len(refused),
            call.checkpoint_id,
            call.chunk,
        )
        return answer

    def _undo_restore(self) -> None:
        """Remove what the open restore installed; the replaced attempts are as before."""
        undo_installs(
            self.server.episodes,
            self.retired,
            self.restored_unclaimed,
            self._installed,
            self.server.instance_id,
        )

    def claim_restored(self, episode_id: EpisodeId) -> Episode | None:
        """The restored episode a ``/run`` for ``episode_id`` continues, once."""
        if episode_id not in self.restored_unclaimed:
            return None
        self.restored_unclaimed.discard(episode_id)
        self.resting.driven(episode_id)  # claimed: it may rest again if its /run ends early
        episode: Episode = self.server.episodes[episode_id]
        return episode

    async def _retire(self, body: dict[str, Any]) -> RetireAnswer:
        call = RetireCall.model_validate(body)
        if self.phase is not ControlPhase.IDLE:
            self._extend_lease(self._deadline(call.deadline_s))
        forgotten = 0
        for key in call.episodes:
            episode_id = EpisodeId.from_row_key(key)
            refused = max(self.retired.get(episode_id.rollout_id, -1), episode_id.attempt)
            self.retired[episode_id.rollout_id] = refused
            forgotten += self._forget_retired(episode_id.rollout_id, refused)
        # Running retired episodes stop at their next boundary.
        return RetireAnswer(**self._state(), retired=sorted(call.episodes), forgotten=forgotten)

    def _forget_retired(self, rollout_id: str, refused: int) -> int:
        """Drop the episodes of ``rollout_id`` up to attempt ``refused`` that no ``/run``
        drives (ended, or restored and never claimed); returns how many."""
        forgotten = 0
        for key in [k for k in self.server.episodes if k.rollout_id == rollout_id]:
            if key.attempt > refused:
                continue
            unclaimed = key in self.restored_unclaimed
            if self.server.episodes[key].phase in LIVE_PHASES and not unclaimed:
                continue  # its /run stops it at the next boundary
            self.restored_unclaimed.discard(key)
            self.copies.pop(key, None)
            del self.server.episodes[key]
            forgotten += 1
        return forgotten

    async def _forget(self, body: dict[str, Any]) -> ForgetAnswer:
        call = ForgetCall.model_validate(body)
        forgotten = 0
        for rollout_id in call.rollout_ids:
            self.retired.pop(rollout_id, None)
            for key in [k for k in self.server.episodes if k.rollout_id == rollout_id]:
                if self.server.episodes[key].phase not in LIVE_PHASES:
                    del self.server.episodes[key]
                    forgotten += 1
            self.restored_unclaimed = {
                e for e in self.restored_unclaimed if e.rollout_id != rollout_id
            }
        return ForgetAnswer(**self._state(), forgotten=forgotten)

    # ------------------------------------------------------------------ lease watchdog
    async def _start_watchdog(self, _: web.Application) -> None:
        self._watchdog = asyncio.create_task(self._watch_lease())

    async def _stop_watchdog(self, _: web.Application) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            try:
                await self._watchdog
            except asyncio.CancelledError:
                pass

    async def _watch_lease(self) -> None:
        while True:
            await asyncio.sleep(self.watchdog_interval_s)
            self.expire_lease_if_due()

    def expire_lease_if_due(self) -> bool:
        """Resume on our own when the trainer stopped renewing; return whether it did."""
        if (
            self.phase is not ControlPhase.IDLE
            and self.lease_deadline is not None
            and self.clock() > self.lease_deadline
            and self.checkpoint_id is not None
        ):
            logger.warning(
                "gym %s: checkpoint lease of %s expired; resuming on our own",
                self.server.instance_id,
                self.checkpoint_id,
            )
            self._reopen(self.checkpoint_id, why="lease expired", drop_restore=True)
            return True
        return False
