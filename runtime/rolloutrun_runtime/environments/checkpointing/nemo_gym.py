"""GymEnvironmentCheckpoint: the trainer's side of the Gym checkpoint control plane.

Why a separate client: the controller speaks only :class:`EnvironmentCheckpoint`; this module
is the one place that knows the Gym's routes (``/ng-control/v1/checkpoint/*``), its bearer
token and its record format. It fans each phase out to every replica concurrently, routes
per-episode calls to the instance that owns the episode (a restored attempt must return to
its owner), and turns any replica's refusal into :class:`EnvironmentCheckpointError`, so the
snapshot attempt is discarded rather than published with a partial environment.

Every call names this trainer (an id, its incarnation and its start time): a replica then
ends at once a checkpoint that a killed predecessor left half done, instead of refusing this
trainer's restore and snapshots until that checkpoint's lease runs out, and refuses an older
trainer that is still calling.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from rolloutrun_runtime.environments.checkpointing.interfaces import (
    EnvironmentCheckpointError,
    EnvironmentEpisode,
    EnvironmentSnapshot,
    EpisodeRestoreOutcome,
    group_by_instance,
)

logger = logging.getLogger(__name__)

ROUTE_PREFIX = "/ng-control/v1/checkpoint"
SNAPSHOT_FORMAT = "gym-episodes/1"


def _episode_of(record: Mapping[str, Any], instance: str) -> EnvironmentEpisode:
    ident = record["episode_id"]
    return EnvironmentEpisode(str(ident["rollout_id"]), int(ident["attempt"]), instance)


@dataclass(frozen=True)
class GymSnapshot:
    """The Gym's part of a rollout snapshot: exported records by owning instance."""

    checkpoint_id: str
    records: Mapping[str, Sequence[Mapping[str, Any]]]

    def episodes(self) -> list[EnvironmentEpisode]:
        return sorted(
            _episode_of(record, instance)
            for instance, records in self.records.items()
            for record in records
        )

    def restricted_to(self, episodes: Collection[EnvironmentEpisode]) -> GymSnapshot:
        keep = set(episodes)
        return GymSnapshot(
            checkpoint_id=self.checkpoint_id,
            records={
                instance: [r for r in records if _episode_of(r, instance) in keep]
                for instance, records in self.records.items()
            },
        )

    def to_bytes(self) -> bytes:
        body = {
            "format": SNAPSHOT_FORMAT,
            "checkpoint_id": self.checkpoint_id,
            "records": {k: list(v) for k, v in sorted(self.records.items())},
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> GymSnapshot:
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise EnvironmentCheckpointError(f"Gym snapshot is not valid JSON: {error}") from error
        if not isinstance(body, dict) or body.get("format") != SNAPSHOT_FORMAT:
            found = body.get("format") if isinstance(body, dict) else type(body).__name__
            raise EnvironmentCheckpointError(
                f"Gym snapshot format {found!r} is not {SNAPSHOT_FORMAT!r}"
            )
        return cls(checkpoint_id=str(body["checkpoint_id"]), records=body["records"])


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
        #: Sent with every call (the control plane's ``trainer``): who is driving the Gym.
        self.trainer = {
            "id": uuid.uuid4().hex[:16],
            "incarnation": incarnation,
            "started_ns": time.time_ns(),
        }

    async def _post(self, instance: str, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        if instance not in self.endpoints:
            raise EnvironmentCheckpointError(f"no Gym endpoint for instance {instance!r}")
        if self._session is None:
            self._session = aiohttp.ClientSession()
        url = f"{self.endpoints[instance].rstrip('/')}{ROUTE_PREFIX}/{route}"
        try:
            async with self._session.post(
                url,
                json={**body, "trainer": self.trainer},
                headers=self._headers,
                timeout=self._timeout,
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
        return payload

    async def _fan_out(
        self, route: str, bodies: Mapping[str, Mapping[str, Any]]
    ) -> dict[str, dict[str, Any]]:
        results = await asyncio.gather(
            *(self._post(instance, route, body) for instance, body in bodies.items()),
            return_exceptions=True,
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise EnvironmentCheckpointError("; ".join(str(f) for f in failures)) from failures[0]
        return {
            instance: result
            for instance, result in zip(bodies, results, strict=True)
            if isinstance(result, dict)
        }

    async def prepare(
        self,
        checkpoint_id: str,
        deadline_ts: float,
        retire: Sequence[EnvironmentEpisode] = (),
    ) -> None:
        if retire:
            await self._retire(checkpoint_id, deadline_ts, retire)
        body = {"checkpoint_id": checkpoint_id, "deadline_ts": deadline_ts}
        await self._fan_out("prepare", {instance: body for instance in self.endpoints})

    async def commit(
        self, checkpoint_id: str, deadline_ts: float, episodes: Iterable[EnvironmentEpisode]
    ) -> EnvironmentSnapshot:
        wanted = group_by_instance(episodes)
        bodies = {
            instance: {
                "checkpoint_id": checkpoint_id,
                "deadline_ts": deadline_ts,
                "episodes": [e.row_key for e in wanted.get(instance, [])],
            }
            for instance in self.endpoints
        }
        answers = await self._fan_out("commit", bodies)
        return GymSnapshot(
            checkpoint_id=checkpoint_id,
            records={instance: answer["records"] for instance, answer in answers.items()},
        )

    async def resume(self, checkpoint_id: str) -> None:
        body = {"checkpoint_id": checkpoint_id}
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
        bodies = {
            instance: {
                "checkpoint_id": checkpoint_id,
                "deadline_ts": deadline_ts,
                "records": list(snapshot.records.get(instance, [])),
            }
            for instance in self.endpoints
        }
        answers = await self._fan_out("restore", bodies)
        # The restore's scope ends here: the restored episodes stay installed (a /run for
        # attempt + 1 continues them) and the replicas return to idle, so the next snapshot's
        # prepare is not refused as "busy with checkpoint restore-…".
        await self.resume(checkpoint_id)
        restored: list[EnvironmentEpisode] = []
        refused: list[tuple[EnvironmentEpisode, str]] = []
        for instance, answer in answers.items():
            restored.extend(
                EnvironmentEpisode.from_row_key(key, instance) for key in answer["restored"]
            )
            refused.extend(
                (EnvironmentEpisode.from_row_key(item["episode"], instance), item["reason"])
                for item in answer["refused"]
            )
        return EpisodeRestoreOutcome(restored=tuple(sorted(restored)), refused=tuple(refused))

    async def retire(self, episodes: Iterable[EnvironmentEpisode]) -> None:
        await self._retire(f"retire-{time.time_ns()}", time.time() + 30.0, list(episodes))

    async def _retire(
        self, checkpoint_id: str, deadline_ts: float, episodes: Sequence[EnvironmentEpisode]
    ) -> None:
        bodies = {
            instance: {
                "checkpoint_id": checkpoint_id,
                "deadline_ts": deadline_ts,
                "episodes": [e.row_key for e in items],
            }
            for instance, items in group_by_instance(episodes).items()
        }
        await self._fan_out("retire", bodies)

    async def forget(self, rollout_ids: Iterable[str]) -> None:
        ids = sorted(set(rollout_ids))
        if not ids:
            return
        body = {"checkpoint_id": f"forget-{time.time_ns()}", "deadline_ts": time.time() + 30.0}
        await self._fan_out(
            "forget", {instance: {**body, "rollout_ids": ids} for instance in self.endpoints}
        )

    async def close(self) -> None:
        if self._session is not None and self._owns_session:
            await self._session.close()
        self._session = None
