"""GymEnvironmentCheckpoint: the trainer's side of the Gym checkpoint control plane.

Why a separate client: the controller speaks only :class:`EnvironmentCheckpoint`; this module
is the one place that calls the Gym's control routes (their bodies and answers are the
models of :mod:`rolloutrun_runtime.contract.wire`), with its bearer token. It fans each
phase out to every replica concurrently, routes per-episode calls to the instance that owns
the episode (a restored attempt must return to its owner). A snapshot's phases (retire,
prepare, commit) report a replica that fails as *unavailable* instead of failing the whole
attempt: a lost Gym pod costs only its own episodes' turns (they restart from turn 0), not
the rest of the rollout state. A restore likewise leaves out a replica that fails (one
down while the trainer starts): its chunks are dropped and its episodes come back as
``unavailable`` with their records, to take a lost replica's path (go on from the record on
its replacement or a survivor, or restart from turn 0), while the others' episodes are
restored; only when every replica fails does the restore fail. The other calls still turn
any replica's refusal into :class:`EnvironmentCheckpointError`. A restore goes to each
replica in chunks under its ``gym.requestMaxBytes``
(:mod:`~rolloutrun_runtime.environments.checkpointing.restore_chunks`), and a record too big
for any body is refused alone, naming the episode and the sizes.

Every call names this trainer (an id, its incarnation and its start time): a replica then
ends at once a checkpoint that a killed predecessor left half done, instead of refusing this
trainer's restore and snapshots until that checkpoint's lease runs out, and refuses an older
trainer that is still calling.

Deadlines: the controller names them on the trainer's wall clock (``deadline_ts``); each
call sends what is left of it as ``deadline_s`` at the moment it is sent (:func:`as_duration`),
never the absolute time, which a Gym whose clock runs ahead would read as already past.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from pydantic import ValidationError

from rolloutrun_runtime.aio import EventFirst, unless_set
from rolloutrun_runtime.contract.layout import GYM_SNAPSHOT_FORMAT
from rolloutrun_runtime.contract.run_config import GymConfig
from rolloutrun_runtime.contract.wire import (
    CONTROL_ANSWERS,
    CONTROL_CALLS,
    MAX_DEADLINE_S,
    CommitAnswer,
    ControlState,
    RestoreAnswer,
    control_route,
)
from rolloutrun_runtime.environments.checkpointing.interfaces import (
    EnvironmentCheckpointError,
    EnvironmentEpisode,
    EnvironmentSnapshot,
    EpisodeRestoreOutcome,
    group_by_instance,
)
from rolloutrun_runtime.environments.checkpointing.restore_chunks import (
    ChunkPlan,
    json_size,
    plan_chunks,
)

logger = logging.getLogger(__name__)

#: Seconds a replica may take to answer ``resume``: one that hangs must not hold a
#: preemption snapshot past its grace (its checkpoint lease resumes it anyway).
RESUME_TIMEOUT_S = 5.0


def as_duration(body: Mapping[str, Any], now: float) -> dict[str, Any]:
    """``body`` with its ``deadline_ts`` (this trainer's wall clock, as the controller
    spells every deadline) sent as ``deadline_s``, the seconds left at ``now``: the Gym times
    it on its own clock from receipt, so a skew between the pods' clocks costs nothing."""
    out = {key: value for key, value in body.items() if key != "deadline_ts"}
    if body.get("deadline_ts") is not None:
        out["deadline_s"] = round(max(float(body["deadline_ts"]) - now, 0.0), 3)
    return out


def _episode_of(record: Mapping[str, Any], instance: str) -> EnvironmentEpisode:
    ident = record["episode_id"]
    return EnvironmentEpisode(str(ident["rollout_id"]), int(ident["attempt"]), instance)


_Answer = TypeVar("_Answer", bound=ControlState)


def _as(kind: type[_Answer], answer: ControlState) -> _Answer:
    """``answer`` as the route's answer model (``_post`` validated it as that model)."""
    if not isinstance(answer, kind):
        raise EnvironmentCheckpointError(
            f"Gym answered {type(answer).__name__}, not {kind.__name__}"
        )
    return answer


@dataclass(frozen=True)
class GymSnapshot:
    """The Gym's part of a rollout snapshot: exported records by owning instance.

    ``unavailable`` (instance → why) names the replicas whose phase failed (their episodes
    have no record); ``not_copied`` the requested episodes a replica had no copy of. Only the
    records and ``unavailable`` are written (``not_copied`` matters only to the cut check).
    """

    checkpoint_id: str
    records: Mapping[str, Sequence[Mapping[str, Any]]]
    unavailable: Mapping[str, str] = field(default_factory=dict)
    copy_missing: tuple[EnvironmentEpisode, ...] = ()

    def not_copied(self) -> list[EnvironmentEpisode]:
        return sorted(self.copy_missing)

    def episodes(self) -> list[EnvironmentEpisode]:
        return sorted(
            _episode_of(record, instance)
            for instance, records in self.records.items()
            for record in records
        )

    def record_of(self, episode: EnvironmentEpisode) -> Mapping[str, Any] | None:
        for records in self.records.values():
            for record in records:
                ident = record.get("episode_id") or {}
                if (ident.get("rollout_id"), ident.get("attempt")) == (
                    episode.rollout_id,
                    episode.attempt,
                ):
                    return record
        return None

    def restricted_to(self, episodes: Collection[EnvironmentEpisode]) -> GymSnapshot:
        keep = set(episodes)
        return GymSnapshot(
            checkpoint_id=self.checkpoint_id,
            records={
                instance: [r for r in records if _episode_of(r, instance) in keep]
                for instance, records in self.records.items()
            },
            unavailable=self.unavailable,
            copy_missing=tuple(e for e in self.copy_missing if e in keep),
        )

    def to_bytes(self) -> bytes:
        body: dict[str, Any] = {
            "format": GYM_SNAPSHOT_FORMAT,
            "checkpoint_id": self.checkpoint_id,
            "records": {k: list(v) for k, v in sorted(self.records.items())},
        }
        if self.unavailable:  # absent when every replica answered (the bytes stay as before)
            body["unavailable"] = dict(sorted(self.unavailable.items()))
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> GymSnapshot:
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise EnvironmentCheckpointError(f"Gym snapshot is not valid JSON: {error}") from error
        if not isinstance(body, dict) or body.get("format") != GYM_SNAPSHOT_FORMAT:
            found = body.get("format") if isinstance(body, dict) else type(body).__name__
            raise EnvironmentCheckpointError(
                f"Gym snapshot format {found!r} is not {GYM_SNAPSHOT_FORMAT!r}"
            )
        unavailable = body.get("unavailable", {})
        if not isinstance(unavailable, dict):
            raise EnvironmentCheckpointError("Gym snapshot: unavailable must be an object")
        return cls(
            checkpoint_id=str(body["checkpoint_id"]),
            records=body["records"],
            unavailable={str(k): str(v) for k, v in unavailable.items()},
        )


class GymEnvironmentCheckpoint:
    """Drives every Gym replica's control plane (see the module doc)."""

    holds_rollout_state = True

    def __init__(
        self,
        endpoints: Mapping[str, str],
        token: str,
        *,
        request_timeout_s: float = 30.0,
        session: aiohttp.ClientSession | None = None,
        incarnation: int = 0,
        request_max_bytes: int | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("GymEnvironmentCheckpoint needs at least one Gym endpoint")
        if not token:
            raise ValueError("GymEnvironmentCheckpoint needs the Gym control token")
        self.endpoints = dict(sorted(endpoints.items()))
        self._headers = {"Authorization": f"Bearer {token}"}
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._session = session
        self._owns_session = session is None
        #: The Gym's body limit (the run's ``gym.requestMaxBytes``): restores fit under it.
        self.request_max_bytes = (
            request_max_bytes
            if request_max_bytes is not None
            else GymConfig.model_fields["request_max_bytes"].default
        )
        #: Replicas left out of an open restore (down at start), by its checkpoint id.
        self._left_out: dict[str, set[str]] = {}
        #: Replicas lost (:meth:`lost`) and not readdressed since: why, by instance id.
        self._down: dict[str, str] = {}
        #: Per replica, set when it is lost or readdressed: its calls in flight end then.
        self._gone: dict[str, asyncio.Event] = {}
        #: Sent with every call (the control plane's ``trainer``): who is driving the Gym.
        self.trainer = {
            "id": uuid.uuid4().hex[:16],
            "incarnation": incarnation,
            "started_ns": time.time_ns(),
        }

    async def _post(self, instance: str, route: str, body: Mapping[str, Any]) -> ControlState:
        """``POST`` control route ``route`` to ``instance``: the body and the answer are the
        wire contract's models (``CONTROL_CALLS``, ``CONTROL_ANSWERS``)."""
        if instance not in self.endpoints:
            raise EnvironmentCheckpointError(f"no Gym endpoint for instance {instance!r}")
        if instance in self._down:  # a lost replica: not sent (an address gone may never answer)
            raise EnvironmentCheckpointError(
                f"Gym {instance} {route}: not sent, the replica is lost ({self._down[instance]})"
            )
        gone = self._gone.setdefault(instance, asyncio.Event())
        try:
            return await unless_set(self._send(instance, route, body), gone)
        except EventFirst:
            why = self._down.get(instance, "replaced")
            raise EnvironmentCheckpointError(
                f"Gym {instance} {route} failed: the replica was lost mid-call ({why})"
            ) from None

    async def _send(self, instance: str, route: str, body: Mapping[str, Any]) -> ControlState:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        url = f"{self.endpoints[instance].rstrip('/')}{control_route(route)}"
        try:
            call = CONTROL_CALLS[route].model_validate(
                {**as_duration(body, time.time()), "trainer": self.trainer}
            )
        except ValidationError as error:
            raise EnvironmentCheckpointError(f"Gym {instance} {route}: {error}") from error
        timeout = self._timeout
        if call.deadline_s is not None and self._timeout.total is not None:
            # A replica that hangs must not hold the phase past its deadline (a preemption
            # snapshot has only its grace period); a second more lets the replica say why.
            left = call.deadline_s + 1.0
            timeout = aiohttp.ClientTimeout(total=min(self._timeout.total, left))
        try:
            async with self._session.post(
                url,
                json=call.model_dump(mode="json", exclude_unset=True),
                headers=self._headers,
                timeout=timeout,
            ) as response:
                payload = await response.json(content_type=None)
                if response.status != 200:
                    message = (payload.get("error") or {}).get("message", payload)
                    raise EnvironmentCheckpointError(
                        f"Gym {instance} {route} answered {response.status}: {message}"
                    )
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as error:
            raise EnvironmentCheckpointError(f"Gym {instance} {route} failed: {error!r}") from error
        if not isinstance(payload, dict):
            raise EnvironmentCheckpointError(f"Gym {instance} {route}: malformed answer")
        try:
            return CONTROL_ANSWERS[route].model_validate(payload)
        except ValidationError as error:
            raise EnvironmentCheckpointError(f"Gym {instance} {route}: malformed answer") from error

    async def _fan_out_each(
        self, route: str, bodies: Mapping[str, Mapping[str, Any]]
    ) -> tuple[dict[str, ControlState], dict[str, str]]:
        """Each replica's answer, and each failed replica's error (instance → message)."""
        results = await asyncio.gather(
            *(self._post(instance, route, body) for instance, body in bodies.items()),
            return_exceptions=True,
        )
        answers: dict[str, ControlState] = {}
        failures: dict[str, str] = {}
        for instance, result in zip(bodies, results, strict=True):
            if isinstance(result, ControlState):
                answers[instance] = result
            elif isinstance(result, EnvironmentCheckpointError):
                failures[instance] = str(result)
            elif isinstance(result, BaseException):
                raise result  # a bug or a cancel, not a replica's failure
        return answers, failures

    async def _fan_out(
        self, route: str, bodies: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, ControlState]:
        answers, failures = await self._fan_out_each(route, bodies)
        if failures:
            raise EnvironmentCheckpointError("; ".join(failures.values()))
        return answers

    async def prepare(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        retire: Sequence[EnvironmentEpisode] = (),
    ) -> dict[str, str]:
        failed: dict[str, str] = {}
        # An abandoned attempt of an instance this run no longer has needs no retiring.
        known = [e for e in retire if e.instance_id in self.endpoints]
        if known:
            _, failed = await self._fan_out_each(
                "retire", self._retire_bodies(checkpoint_id, deadline_ts, known)
            )
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        _, not_prepared = await self._fan_out_each(
            "prepare", {instance: body for instance in self.endpoints if instance not in failed}
        )
        failed.update(not_prepared)
        for instance, why in sorted(failed.items()):
            logger.warning(
                "Gym %s is unavailable to checkpoint %s: %s", instance, checkpoint_id, why
            )
        return failed

    async def commit(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        episodes: Iterable[EnvironmentEpisode],
        unavailable: Mapping[str, str] | None = None,
    ) -> EnvironmentSnapshot:
        wanted = group_by_instance(episodes)
        failed = dict(unavailable or {})
        for instance in wanted:
            if instance not in self.endpoints:
                failed[instance] = f"no Gym endpoint for instance {instance!r}"
        bodies = {
            instance: {
                "checkpoint_id": checkpoint_id,
                "deadline_ts": deadline_ts,
                "episodes": [e.row_key for e in wanted.get(instance, [])],
            }
            for instance in self.endpoints
            if instance not in failed
        }
        answered, not_committed = await self._fan_out_each("commit", bodies)
        failed.update(not_committed)
        answers = {instance: _as(CommitAnswer, answer) for instance, answer in answered.items()}
        return GymSnapshot(
            checkpoint_id=checkpoint_id,
            records={instance: answer.records for instance, answer in answers.items()},
            unavailable=failed,
            copy_missing=tuple(
                EnvironmentEpisode.from_row_key(item.episode, instance)
                for instance, answer in answers.items()
                for item in answer.not_copied
            ),
        )

    async def resume(self, checkpoint_id: str) -> None:
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + RESUME_TIMEOUT_S}
        await self._fan_out("resume", {instance: body for instance in self.endpoints})

    async def restore(
        self, checkpoint_id: str, deadline_ts: float, snapshot_bytes: bytes
    ) -> EpisodeRestoreOutcome:
        snapshot = GymSnapshot.from_bytes(snapshot_bytes)
        unknown = sorted(set(snapshot.records) - set(self.endpoints))
        if unknown:
            raise EnvironmentCheckpointError(
                f"snapshot holds episodes of Gym instances {unknown} that this run does not "
                f"have (it has {sorted(self.endpoints)}); a restored episode must return to "
                "its owner"
            )
        envelope = self._restore_envelope_bytes(checkpoint_id)
        try:
            plans = {
                instance: plan_chunks(
                    snapshot.records.get(instance, []), self.request_max_bytes, envelope
                )
                for instance in self.endpoints
            }
        except ValueError as too_small:
            raise EnvironmentCheckpointError(f"restore {checkpoint_id}: {too_small}") from too_small
        results = await asyncio.gather(
            *(
                self._restore_chunks(instance, checkpoint_id, deadline_ts, plan)
                for instance, plan in plans.items()
            ),
            return_exceptions=True,
        )
        failed = {
            instance: result
            for instance, result in zip(plans, results, strict=True)
            if isinstance(result, BaseException)
        }
        bugs = [e for e in failed.values() if not isinstance(e, EnvironmentCheckpointError)]
        if bugs or len(failed) == len(plans):
            # Nothing to restore onto (or a bug): every chunk any replica installed is dropped.
            await self._end_restore_quietly(checkpoint_id)
            if bugs:
                raise bugs[0]
            raise EnvironmentCheckpointError("; ".join(str(e) for e in failed.values()))
        # A replica that failed (down at start) is left out, as a snapshot's phases leave out
        # a replica that fails: its earlier chunks are dropped, its episodes handed back with
        # their records (``unavailable``), the others' restore goes on.
        await self._drop_left_out(checkpoint_id, {i: str(e) for i, e in failed.items()})
        # The restore scope stays open (``end_restore`` keeps or drops what it installed); a
        # trainer that dies inside it leaves it to the replicas' lease, which drops it.
        restored: list[EnvironmentEpisode] = []
        refused: list[tuple[EnvironmentEpisode, str]] = []
        for (instance, plan), answers in zip(plans.items(), results, strict=True):
            if instance in failed:
                continue
            assert isinstance(answers, list)
            for too_big in plan.oversized:
                episode = _episode_of(too_big.record, instance)
                why = too_big.reason(self.request_max_bytes)
                logger.warning(
                    "restore of episode %s on Gym %s refused: %s", episode.row_key, instance, why
                )
                refused.append((episode, why))
            for answer in answers:
                restored.extend(
                    EnvironmentEpisode.from_row_key(key, instance) for key in answer.restored
                )
                refused.extend(
                    (EnvironmentEpisode.from_row_key(item.episode, instance), item.reason)
                    for item in answer.refused
                )
        unavailable = tuple(
            (_episode_of(record, instance), record)
            for instance in sorted(failed)
            for record in snapshot.records.get(instance, [])
        )
        return EpisodeRestoreOutcome(
            restored=tuple(sorted(restored)), refused=tuple(refused), unavailable=unavailable
        )

    async def _drop_left_out(self, checkpoint_id: str, failed: Mapping[str, str]) -> None:
        """Drop what the replicas in ``failed`` installed of restore ``checkpoint_id`` (a
        down one answers nothing: its lease drops it), and leave them out of its end."""
        if not failed:
            return
        self._left_out[checkpoint_id] = set(failed)
        for instance, why in sorted(failed.items()):
            logger.warning(
                "Gym %s is unavailable to restore %s; its episodes go on from their records "
                "on its replacement or a survivor: %s",
                instance,
                checkpoint_id,
                why,
            )
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + RESUME_TIMEOUT_S}
        await self._fan_out_each("drop", {instance: body for instance in failed})

    def _restore_envelope_bytes(self, checkpoint_id: str) -> int:
        """Bytes of a restore body without its records (the largest chunk number, and the
        widest deadline the wire allows: ``_post`` turns ``deadline_ts`` into a duration at
        send time, so the envelope is measured with the longest one it can carry)."""
        widest = MAX_DEADLINE_S - 0.001
        body = {"checkpoint_id": checkpoint_id, "deadline_s": widest, "records": []}
        call = CONTROL_CALLS["restore"].model_validate(
            {**body, "chunk": 1_000_000, "trainer": self.trainer}
        )
        return json_size(call.model_dump(mode="json", exclude_unset=True))

    async def _restore_chunks(
        self, instance: str, checkpoint_id: str, deadline_ts: float, plan: ChunkPlan
    ) -> list[RestoreAnswer]:
        """Send ``instance`` its chunks in order (chunk 0 opens the restore scope)."""
        answers: list[RestoreAnswer] = []
        for index, records in enumerate(plan.chunks):
            body: dict[str, Any] = {
                "checkpoint_id": checkpoint_id,
                "deadline_ts": deadline_ts,
                "records": list(records),
            }
            if index:  # chunk 0 is the body a one-chunk restore always was
                body["chunk"] = index
            try:
                answer = await self._post(instance, "restore", body)
            except EnvironmentCheckpointError as error:
                raise EnvironmentCheckpointError(
                    f"{error} (restore chunk {index} of {len(plan.chunks)}, numbered from 0)"
                ) from error
            answers.append(_as(RestoreAnswer, answer))
        return answers

    async def end_restore(self, checkpoint_id: str, *, keep: bool) -> None:
        left_out = self._left_out.pop(checkpoint_id, set())
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": time.time() + RESUME_TIMEOUT_S}
        # The restored episodes stay installed (a /run for attempt + 1 continues them) and
        # the replicas return to idle (resume), so the next snapshot's prepare may follow.
        route = "resume" if keep else "drop"
        await self._fan_out(
            route, {instance: body for instance in self.endpoints if instance not in left_out}
        )

    async def _end_restore_quietly(self, checkpoint_id: str) -> None:
        try:
            await self.end_restore(checkpoint_id, keep=False)
        except EnvironmentCheckpointError as error:
            logger.warning(
                "dropping restore %s failed (its lease drops it): %s", checkpoint_id, error
            )

    async def retire(self, episodes: Iterable[EnvironmentEpisode]) -> None:
        bodies = self._retire_bodies(f"retire-{time.time_ns()}", time.time() + 30.0, episodes)
        await self._fan_out("retire", bodies)

    def _retire_bodies(
        self, checkpoint_id: str, deadline_ts: float, episodes: Iterable[EnvironmentEpisode]
    ) -> dict[str, dict[str, Any]]:
        """One retire call per instance that holds some of ``episodes``."""
        return {
            instance: {
                "checkpoint_id": checkpoint_id,
                "deadline_ts": deadline_ts,
                "episodes": [e.row_key for e in items],
            }
            for instance, items in group_by_instance(episodes).items()
        }

    async def forget(self, rollout_ids: Iterable[str]) -> None:
        ids = sorted(set(rollout_ids))
        if not ids:
            return
        body = {"checkpoint_id": f"forget-{time.time_ns()}", "deadline_ts": time.time() + 30.0}
        await self._fan_out(
            "forget", {instance: {**body, "rollout_ids": ids} for instance in self.endpoints}
        )

    def readdress(self, instance_id: str, url: str) -> None:
        """Calls go to ``url`` from now on; those in flight to another address end at once."""
        if instance_id in self.endpoints:
            if self.endpoints[instance_id] != url:
                self._end_calls(instance_id)
            self.endpoints[instance_id] = url
            self._down.pop(instance_id, None)

    def lost(self, instance_id: str, why: str) -> None:
        """The replica ``instance_id`` stopped answering (the Gym client found it unreachable):
        its calls in flight end now and none is sent until it is readdressed, each as that
        replica being unavailable to the phase, instead of waiting out the phase's deadline
        on an address that may never answer (a deleted pod's)."""
        if instance_id in self.endpoints:
            self._down[instance_id] = why
            self._end_calls(instance_id)

    def _end_calls(self, instance_id: str) -> None:
        gone = self._gone.pop(instance_id, None)
        if gone is not None:
            gone.set()

    async def close(self) -> None:
        if self._session is not None and self._owns_session:
            await self._session.close()
        self._session = None
