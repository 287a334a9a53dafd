"""The Gym HTTP server: one replica with a stable instance id, running episodes on ``/run``.

Why state in the server: multi-turn tasks keep per-episode state between turns (the
counter of ``reach_target``), as NeMo Gym's resources servers do; the trainer only sees
finished episodes. Every episode is keyed by ``EpisodeId(rollout_id, attempt)``; the server
refuses a second live run of the same id (409), answers a repeated request for a finished
episode with its stored result (a lost response can be fetched again without re-running
anything), and refuses an attempt older than one it has seen (attempt N may not change
N+1). A bad request gets a 4xx that names the problem and touches no other episode.

Routes: ``POST /run``, ``GET /episodes/{rollout_id}``, ``POST /policy``, ``GET /healthz``;
their bodies are the wire contract's models (:mod:`rolloutrun_runtime.contract.wire`).

Why a token and an announced policy: ``/run`` applies side effects and makes the Gym POST
to ``policy_url``, so every route but ``/healthz`` needs the run's bearer token, and a
``/run`` may only name a generation address the trainer announced on ``POST /policy``
(403 otherwise, and the address is never contacted): the Gym is nobody's HTTP proxy.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import ValidationError

from rolloutrun_runtime.contract.run_config import RunConfig
from rolloutrun_runtime.contract.wire import (
    CHECKPOINT_CONTROL_CAPABILITY,
    GYM_EPISODES_ROUTE,
    GYM_POLICY_ROUTE,
    GYM_RUN_ROUTE,
    HEALTHZ_ROUTE,
    MAX_ANNOUNCED_POLICIES,
    MEMBER_RESUME_CAPABILITY,
    POLICY_NOT_ANNOUNCED,
    POLICY_UNREACHABLE,
    RESUME_REFUSED,
    EpisodesAnswer,
    GymHealth,
    PolicyAnnounced,
    PolicyAnnouncement,
    RunRequest,
)
from rolloutrun_runtime.environments.gym.agent import (
    AgentLoop,
    BoundaryHook,
    HttpPolicyClient,
    PolicyCallError,
    PolicyClient,
    PolicyUnreachableError,
    SideEffectLog,
    SideEffectReplayError,
)
from rolloutrun_runtime.environments.gym.effects import (
    SideEffectStorageError,
    open_effect_store,
)
from rolloutrun_runtime.environments.gym.episode import (
    CANCELLED_REASON,
    LIVE_PHASES,
    Episode,
    EpisodeId,
    EpisodeRecordError,
    Phase,
    Sampling,
)
from rolloutrun_runtime.environments.gym.restore import member_resume_source
from rolloutrun_runtime.experience.rollout_recovery import valid_rollout_id
from rolloutrun_runtime.policy.http import authenticated, data_plane_token, json_error
from rolloutrun_runtime.policy.tokenizer import policy_tokenizer

logger = logging.getLogger(__name__)

#: Finished episodes kept in memory for repeated requests and inspection.
MAX_FINISHED_EPISODES = 50_000


def _error(status: int, message: str) -> web.Response:
    kinds = {404: "not_found", 409: "conflict", 413: "too_large", 502: "policy_error"}
    return json_error(status, message, kinds.get(status, "invalid_request_error"))


def _validation_message(error: ValidationError, route: str = GYM_RUN_ROUTE) -> str:
    problems = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(body)"
        problems.append(f"{where}: {item['msg']}")
    return f"invalid {route} request: " + "; ".join(problems)


def policy_key(url: str) -> str:
    """The form in which announced and requested generation addresses are compared."""
    return url.rstrip("/")


def remember(announced: OrderedDict[str, None], urls: Iterable[str]) -> None:
    """Add ``urls`` to ``announced`` (newest last), keeping at most the newest
    :data:`MAX_ANNOUNCED_POLICIES` (a new trainer incarnation announces a new address)."""
    for url in urls:
        announced.pop(policy_key(url), None)
        announced[policy_key(url)] = None
    while len(announced) > MAX_ANNOUNCED_POLICIES:
        announced.popitem(last=False)


class GymServer:
    """One Gym replica: build it, then serve ``self.app`` (see the module doc)."""

    def __init__(
        self,
        instance_id: str,
        run_cfg: RunConfig,
        audit_path: Path | None = None,
        *,
        audit_uri: str | None = None,
        effects: SideEffectLog | None = None,
        policy: PolicyClient | None = None,
        hooks: list[BoundaryHook] | None = None,
        token: str | None = None,
    ) -> None:
        """``audit_path`` (a JSON-lines file), ``audit_uri`` (storage objects) or a ready
        ``effects`` log says where applied side effects are kept; at most one of them.
        ``token`` (default: ``ENV_GYM_TOKEN``) is the run's bearer token: without one the
        server refuses to be built (``MissingTokenError``)."""
        self.token = data_plane_token(token, "the Gym server")
        if sum(x is not None for x in (audit_path, audit_uri, effects)) > 1:
            raise ValueError("give GymServer one of audit_path, audit_uri or effects")
        self.instance_id = instance_id
        self.cfg = run_cfg
        if effects is None:
            store = open_effect_store(instance_id, audit_file=audit_path, audit_uri=audit_uri)
            effects = SideEffectLog(instance_id, store=store)
        self.effects = effects
        self.hooks: list[BoundaryHook] = hooks if hooks is not None else []
        self._policy = policy
        self._session: aiohttp.ClientSession | None = None
        self.loop: AgentLoop | None = None
        self.episodes: OrderedDict[EpisodeId, Episode] = OrderedDict()
        #: Highest attempt seen per rollout (kept after its episodes are trimmed).
        self.latest_attempt: dict[str, int] = {}
        #: Set by the checkpoint control plane: the restored episode a ``/run`` continues.
        self.continue_restored: Callable[[EpisodeId], Episode | None] | None = None
        #: Whether a ``/run`` came yet (its first is logged: a replacement's first work).
        self.served = False
        #: Generation addresses the trainer announced (``POST /policy``), newest last.
        self.announced_policies: OrderedDict[str, None] = OrderedDict()
        self.app = web.Application(client_max_size=run_cfg.gym.request_max_bytes)
        self.app.router.add_post(GYM_RUN_ROUTE, authenticated(self.token, self._run))
        self.app.router.add_get(GYM_EPISODES_ROUTE, authenticated(self.token, self._episodes))
        self.app.router.add_post(GYM_POLICY_ROUTE, authenticated(self.token, self._announce))
        self.app.router.add_get(HEALTHZ_ROUTE, self._healthz)
        self.app.on_startup.append(self._startup)
        self.app.on_cleanup.append(self._cleanup)

    # ------------------------------------------------------------------ lifecycle
    async def _startup(self, _: web.Application) -> None:
        policy = self._policy
        if policy is None:
            # No connection cap: every live episode may be waiting on the policy at once.
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
            policy = HttpPolicyClient(
                self._session, self.cfg.rollout.rollout_timeout_seconds, self.token
            )
        self.loop = AgentLoop(
            task=self.cfg.task,
            seed=self.cfg.seed,
            max_seq_len=self.cfg.policy.max_seq_len,
            policy=policy,
            effects=self.effects,
            hooks=self.hooks,
            tokenizer=policy_tokenizer(self.cfg.policy),
        )
        logger.info("gym %s serving task %s", self.instance_id, self.cfg.task.name.value)

    async def _cleanup(self, _: web.Application) -> None:
        if self._session is not None:
            await self._session.close()
        self.effects.close()

    # ------------------------------------------------------------------ routes
    async def _healthz(self, _: web.Request) -> web.Response:
        counts = self.episode_summary()
        live = sum(counts.get(phase.value, 0) for phase in LIVE_PHASES)
        health = GymHealth(
            status="ok",
            instance_id=self.instance_id,
            task=self.cfg.task.name.value,
            live_episodes=live,
            episodes_by_phase=counts,
            # The control plane installs continue_restored (gym_main) when it serves.
            capabilities=[
                *([CHECKPOINT_CONTROL_CAPABILITY] if self.continue_restored else []),
                MEMBER_RESUME_CAPABILITY,  # a /run's resume record: _resume
            ],
        )
        return web.json_response(health.model_dump(mode="json"))

    async def _episodes(self, request: web.Request) -> web.Response:
        rollout_id = request.match_info["rollout_id"]
        found = [e for key, e in self.episodes.items() if key.rollout_id == rollout_id]
        if not found:
            return _error(404, f"no episode for rollout {rollout_id!r} on {self.instance_id}")
        found.sort(key=lambda e: e.episode_id.attempt)
        answer = EpisodesAnswer(
            rollout_id=rollout_id,
            instance_id=self.instance_id,
            applied_revision=self.effects.applied_revision(rollout_id),
            episodes=[e.to_record() for e in found],
        )
        return web.json_response(answer.model_dump(mode="json"))

    async def _announce(self, request: web.Request) -> web.Response:
        body = await self._read_object(request)
        if isinstance(body, web.Response):
            return body
        try:
            parsed = PolicyAnnouncement.model_validate(body)
        except ValidationError as error:
            return _error(400, _validation_message(error, GYM_POLICY_ROUTE))
        remember(self.announced_policies, parsed.policy_urls)
        answer = PolicyAnnounced(policy_urls=list(self.announced_policies))
        return web.json_response(answer.model_dump(mode="json"))

    async def _read_object(self, request: web.Request) -> dict[str, Any] | web.Response:
        """The body as a JSON object, or the 4xx that says why it is not one."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _error(
                413,
                f"request body is larger than gym.requestMaxBytes "
                f"({self.cfg.gym.request_max_bytes} bytes)",
            )
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            return _error(400, f"request body is not valid JSON: {error}")
        if not isinstance(body, dict):
            return _error(400, f"request body must be a JSON object, not {type(body).__name__}")
        return body

    async def _parse(self, request: web.Request) -> RunRequest | web.Response:
        body = await self._read_object(request)
        if isinstance(body, web.Response):
            return body
        try:
            parsed = RunRequest.model_validate(body)
        except ValidationError as error:
            return _error(400, _validation_message(error))
        if policy_key(parsed.policy_url) not in self.announced_policies:
            return json_error(
                403,
                f"policy_url {parsed.policy_url[:200]!r} is not a generation address the "
                f"trainer announced (POST {GYM_POLICY_ROUTE}); the Gym calls no other address",
                POLICY_NOT_ANNOUNCED,
            )
        task = self.cfg.task
        if parsed.task is not None and parsed.task != task.name.value:
            return _error(
                400, f"unknown task {parsed.task!r}: this server runs {task.name.value!r}"
            )
        if not valid_rollout_id(parsed.episode_id.rollout_id):
            return _error(400, "episode_id.rollout_id may not end in '-a<N>' (the attempt suffix)")
        if parsed.prompt_id >= task.dataset_size:
            return _error(
                400,
                f"prompt_id {parsed.prompt_id} is outside the dataset (0..{task.dataset_size - 1})",
            )
        max_new = parsed.sampling.max_new_tokens
        if max_new is not None and max_new >= self.cfg.policy.max_seq_len:
            return _error(
                400,
                f"sampling.max_new_tokens {max_new} does not fit policy.maxSeqLen "
                f"{self.cfg.policy.max_seq_len}",
            )
        return parsed

    def _conflict(self, episode_id: EpisodeId) -> web.Response | None:
        """A 409 (or the stored result) when ``episode_id`` may not start now."""
        existing = self.episodes.get(episode_id)
        if existing is not None:
            if existing.phase is Phase.FINISHED:
                self.episodes.move_to_end(episode_id)
                return web.json_response(existing.result(self.instance_id))
            if existing.phase in LIVE_PHASES:
                return _error(409, f"episode {episode_id.row_key} is already running")
            return _error(
                409,
                f"episode {episode_id.row_key} ended {existing.phase.value} "
                f"({existing.error}); run it under a new attempt",
            )
        newest = self.latest_attempt.get(episode_id.rollout_id, -1)
        if newest > episode_id.attempt:
            return _error(
                409,
                f"episode {episode_id.row_key} is superseded by attempt {newest} "
                f"of rollout {episode_id.rollout_id!r}",
            )
        return None

    async def _run(self, request: web.Request) -> web.Response:
        parsed = await self._parse(request)
        if isinstance(parsed, web.Response):
            return parsed
        assert self.loop is not None, "server not started"
        if not self.served:
            self.served = True
            logger.info("gym %s: first /run", self.instance_id)
        episode_id = EpisodeId(parsed.episode_id.rollout_id, parsed.episode_id.attempt)
        restored = self.continue_restored(episode_id) if self.continue_restored else None
        if restored is not None:
            # A new trainer incarnation serves generation at a new address.
            restored.policy_url = parsed.policy_url
            return await self._run_episode(restored)
        conflict = self._conflict(episode_id)
        if conflict is not None:
            return conflict
        if parsed.resume is not None:
            resumed = await self._resume(parsed.resume, episode_id, parsed.policy_url)
            if isinstance(resumed, web.Response):
                return resumed
            self.install(resumed)
            return await self._run_episode(resumed)
        sampling = Sampling(
            temperature=(
                parsed.sampling.temperature
                if parsed.sampling.temperature is not None
                else self.cfg.policy.temperature
            ),
            max_new_tokens=parsed.sampling.max_new_tokens or self.cfg.task.max_new_tokens,
            seed=parsed.sampling.seed,
            weight_version=parsed.sampling.weight_version,
        )
        episode = self.loop.new_episode(episode_id, parsed.prompt_id, parsed.policy_url, sampling)
        self.install(episode)
        return await self._run_episode(episode)

    async def _run_episode(self, episode: Episode) -> web.Response:
        assert self.loop is not None, "server not started"
        episode_id = episode.episode_id
        try:
            await self.loop.run(episode)
        except PolicyUnreachableError as error:  # infrastructure: the trainer redispatches
            logger.warning("episode %s: policy unreachable: %s", episode_id.row_key, error)
            message = f"episode {episode_id.row_key} failed: {error}"
            return json_error(502, message, POLICY_UNREACHABLE)
        except PolicyCallError as error:
            logger.warning("episode %s failed: %s", episode_id.row_key, error)
            return _error(502, f"episode {episode_id.row_key} failed: {error}")
        except SideEffectReplayError as error:
            logger.error("episode %s refused: %s", episode_id.row_key, error)
            return _error(409, f"episode {episode_id.row_key} failed: {error}")
        except SideEffectStorageError as error:
            logger.error("episode %s failed: %s", episode_id.row_key, error)
            return _error(503, f"episode {episode_id.row_key} failed: {error}")
        except asyncio.CancelledError:
            if episode.phase in LIVE_PHASES:
                episode.phase, episode.error = Phase.ABANDONED, CANCELLED_REASON
            raise
        return web.json_response(episode.result(self.instance_id))

    async def _resume(
        self, record: dict[str, Any], episode_id: EpisodeId, policy_url: str
    ) -> Episode | web.Response:
        """Elastic members: the episode ``record`` (another replica's, lost) continued under
        ``episode_id`` here, or 409 ``resume_refused`` naming why (the trainer restarts the
        sibling from turn 0). The run's side-effect log is read afresh first, so an effect
        the lost replica applied after the record refuses it."""
        try:
            previous = Episode.from_record(record)
        except EpisodeRecordError as error:
            return _error(400, f"resume: {error}")
        if previous.episode_id.rollout_id != episode_id.rollout_id:
            return _error(400, "resume: the record is of another rollout")
        await asyncio.to_thread(self.effects.refresh)
        source, reason = member_resume_source(
            previous,
            episode_id.attempt,
            self.episodes.get(previous.episode_id),
            self.effects.applied_revision(episode_id.rollout_id),
        )
        if source is None:
            logger.warning("gym %s: resume of %s refused: %s", self.instance_id, episode_id, reason)
            return json_error(
                409, f"resume of {episode_id.row_key} refused: {reason}", RESUME_REFUSED
            )
        episode = Episode.from_record(source, attempt=episode_id.attempt)
        episode.policy_url = policy_url  # the trainer serves generation where it says now
        logger.info(
            "gym %s: %s resumed at turn %d (revision %d)",
            self.instance_id,
            episode_id.row_key,
            episode.turn,
            episode.revision,
        )
        return episode

    def install(self, episode: Episode) -> None:
        """Hold ``episode`` (a new one, or one restored under a later attempt)."""
        key = episode.episode_id
        self.episodes[key] = episode
        self.latest_attempt[key.rollout_id] = max(
            key.attempt, self.latest_attempt.get(key.rollout_id, -1)
        )
        self._trim()

    def _trim(self) -> None:
        excess = len(self.episodes) - MAX_FINISHED_EPISODES
        if excess <= 0:
            return
        # The oldest finished ones, found from the front: episodes are held in the order they
        # came, so the scan stops after a few (a full scan cost ms per new episode at 50,000).
        finished = (key for key, e in self.episodes.items() if e.phase not in LIVE_PHASES)
        for key in list(itertools.islice(finished, excess)):
            del self.episodes[key]

    def live_episodes(self) -> list[Episode]:
        return [e for e in self.episodes.values() if e.phase in LIVE_PHASES]

    def episode_summary(self) -> dict[str, Any]:
        """Counts by phase (for logs and tests)."""
        counts: dict[str, int] = {}
        for episode in self.episodes.values():
            counts[episode.phase.value] = counts.get(episode.phase.value, 0) + 1
        return counts
