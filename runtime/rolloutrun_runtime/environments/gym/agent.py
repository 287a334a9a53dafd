"""The agent loop: an explicit per-turn state machine over an episode.

Why a state machine instead of one coroutine with a ``for`` loop: turn-level recovery must
stop an episode *between* turns, export it, and continue it elsewhere. Each call to
``AgentLoop.step`` makes one transition (``AWAIT_MODEL`` → call the policy → ``AWAIT_TOOL``
→ apply the tool call → ``AWAIT_MODEL`` or ``FINISHED``), and boundary hooks run before each
model call and after each tool round, the two points where an episode holds no half-done
work. The checkpoint control plane copies episodes in those hooks. A ``/run`` cancelled
while a side effect's record is written finishes that tool round first, so a stopped
episode always rests at a boundary.

Side effects go through the ``SideEffectLog`` (effects.py): each applied effect bumps the
episode's ``revision`` and is keyed ``(rollout_id, revision)``; the log refuses a key it has
already seen, so an effect can never be applied twice, and with an audit file or storage
objects (written before the effect is applied) it proves that from durable state.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import aiohttp
from pydantic import ValidationError

from rolloutrun_runtime.contract.run_config import TaskConfig
from rolloutrun_runtime.contract.wire import (
    COMPLETIONS_ROUTE,
    HEALTHZ_ROUTE,
    CompletionRequest,
    CompletionResult,
)
from rolloutrun_runtime.environments.gym.effects import (
    SideEffectLog,
    SideEffectReplayError,
    SideEffectStorageError,
)
from rolloutrun_runtime.environments.gym.episode import (
    LIVE_PHASES,
    POLICY_FAILED_PREFIX,
    Episode,
    EpisodeId,
    Phase,
    Sampling,
    Segment,
)
from rolloutrun_runtime.environments.gym.tasks import make_env
from rolloutrun_runtime.policy.http import (
    GenerationRequest,
    GenerationResult,
    bearer_headers,
    bounded,
    data_plane_token,
    is_unreachable,
)
from rolloutrun_runtime.policy.tokenizer import TOKENIZER, PolicyTokenizer
from rolloutrun_runtime.tasks import make_problem

logger = logging.getLogger(__name__)

#: Boundary names passed to hooks.
BEFORE_MODEL = "before_model"
AFTER_TOOL = "after_tool"

BoundaryHook = Callable[[Episode, str], Awaitable[None]]


class PolicyCallError(Exception):
    """The policy endpoint failed or refused a model call."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class PolicyUnreachableError(PolicyCallError):
    """The policy endpoint could not be reached (refused, reset, a connect timeout, silent
    under probing): a lost generation worker, not the episode's fault."""


#: Longest wait for a connection to the policy endpoint, and for its ``/healthz`` while a
#: call is in flight: a dead pod's address never answers (no RST), and waiting for
#: ``rolloutTimeoutSeconds`` there stalled the trainer.
POLICY_CONNECT_TIMEOUT_S = 2.0
#: While a model call is in flight, its endpoint's ``/healthz`` is probed this often;
#: :data:`POLICY_PROBE_STRIKES` probes in a row without an answer end the call as unreachable
#: (a probe refused at once ends it at the first).
POLICY_PROBE_PERIOD_S = 0.5
POLICY_PROBE_STRIKES = 2


class PolicyClient(Protocol):
    """Calls the policy's generation service for one model turn."""

    async def complete(self, policy_url: str, request: GenerationRequest) -> GenerationResult: ...


class HttpPolicyClient:
    """``POST {policy_url}/v1/completions`` over a shared aiohttp session (the wire
    contract's :class:`CompletionRequest` in, :class:`CompletionResult` out), with the run's
    bearer ``token`` (default: ``ENV_GYM_TOKEN``). What the policy answers is quoted only as
    a bounded, printable excerpt: the error reaches the ``/run`` caller."""

    def __init__(
        self, session: aiohttp.ClientSession, timeout_s: float, token: str | None = None
    ) -> None:
        self.session = session
        self.timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=POLICY_CONNECT_TIMEOUT_S)
        self.headers = bearer_headers(data_plane_token(token, "the Gym's policy client"))
        #: The probe of each endpoint in flight: concurrent calls share it (one probe an
        #: endpoint at a time, however many episodes wait on it).
        self._probing: dict[str, asyncio.Future[tuple[bool, str]]] = {}

    async def complete(self, policy_url: str, request: GenerationRequest) -> GenerationResult:
        url = policy_url.rstrip("/") + COMPLETIONS_ROUTE
        try:
            body = CompletionRequest.model_validate(
                {
                    "prompt_token_ids": list(request.prompt_token_ids),
                    "max_tokens": request.max_tokens,
                    "temperature": request.temperature,
                    "seed": request.seed,
                    "weight_version": request.weight_version,
                    "rollout_id": request.rollout_id,
                    "call_index": request.call_index,
                }
            ).model_dump(mode="json", exclude_unset=True)
        except ValidationError as error:
            raise PolicyCallError(f"policy {url}: invalid completion request: {error}") from error
        try:
            payload = await self._watched(policy_url, self._post(url, body))
        except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as error:
            kind = PolicyUnreachableError if is_unreachable(error) else PolicyCallError
            raise kind(f"policy {url} failed: {bounded(repr(error))}") from error
        try:
            answer = CompletionResult.model_validate(payload)
        except ValidationError as error:
            raise PolicyCallError(
                f"policy {url} sent a malformed completion: {bounded(error)}"
            ) from error
        return GenerationResult(
            token_ids=answer.token_ids,
            logprobs=answer.logprobs,
            weight_versions=answer.weight_versions,
            finish_reason=answer.finish_reason,
        )

    async def _post(self, url: str, body: dict[str, object]) -> object:
        async with self.session.post(
            url, json=body, timeout=self.timeout, headers=self.headers
        ) as response:
            if response.status != 200:
                raise PolicyCallError(
                    f"policy {url} answered {response.status}: "
                    f"{_error_excerpt(await response.read())}",
                    response.status,
                )
            return await response.json(content_type=None)

    async def _watched(self, policy_url: str, call: Awaitable[object]) -> object:
        """Await ``call`` while probing ``policy_url``'s ``/healthz``: an endpoint that
        stops answering (its pod deleted: no RST) ends the call as unreachable."""
        task = asyncio.ensure_future(call)
        try:
            strikes = 0
            while True:
                done, _ = await asyncio.wait({task}, timeout=POLICY_PROBE_PERIOD_S)
                if done:
                    return task.result()
                probe = self._probing.get(policy_url)
                if probe is None or probe.done():
                    probe = self._probing[policy_url] = asyncio.ensure_future(
                        self._probe(policy_url)
                    )
                answered, refused = await asyncio.shield(probe)
                strikes = 0 if answered else strikes + 1
                if refused or strikes >= POLICY_PROBE_STRIKES:
                    raise PolicyUnreachableError(
                        f"policy {policy_url} stopped answering: {strikes} probe(s) of "
                        f"{HEALTHZ_ROUTE} failed ({refused or 'no answer'}) during a model call"
                    )
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def _probe(self, policy_url: str) -> tuple[bool, str]:
        """``(answered, refused)``: any HTTP answer is an answer; ``refused`` names a
        connection refused or reset at once (the endpoint is gone)."""
        url = policy_url.rstrip("/") + HEALTHZ_ROUTE
        timeout = aiohttp.ClientTimeout(total=POLICY_CONNECT_TIMEOUT_S)
        try:
            async with self.session.get(url, timeout=timeout) as response:
                await response.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            if isinstance(error, TimeoutError) or not is_unreachable(error):
                return False, ""
            return False, bounded(repr(error))
        return True, ""


def _error_excerpt(raw: bytes) -> str:
    """A bounded excerpt of a policy's error answer: its ``error.message`` when it has one."""
    try:
        payload = json.loads(raw)
        message = payload["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = raw[:200].decode("utf-8", "replace")
    return bounded(message)


class LocalPolicyClient:
    """Calls an in-process generation function (e.g. ``GenerationEngine.generate``).

    For tests and in-process loops that run the agent without HTTP; ``policy_url`` is
    ignored.
    """

    def __init__(
        self, generate: Callable[[GenerationRequest], Awaitable[GenerationResult]]
    ) -> None:
        self.generate = generate

    async def complete(self, policy_url: str, request: GenerationRequest) -> GenerationResult:
        return await self.generate(request)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of one turn, derived from the episode's seed."""
    digest = hashlib.sha256(f"{seed}:turn:{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & (2**63 - 1)


class AgentLoop:
    """Runs episodes of one task against a policy; see the module doc."""

    def __init__(
        self,
        task: TaskConfig,
        seed: int,
        max_seq_len: int,
        policy: PolicyClient,
        effects: SideEffectLog,
        hooks: list[BoundaryHook] | None = None,
        tokenizer: PolicyTokenizer = TOKENIZER,
    ) -> None:
        self.task = task
        self.seed = seed
        self.max_seq_len = max_seq_len
        self.policy = policy
        self.effects = effects
        self.hooks = hooks if hooks is not None else []
        self.tokenizer = tokenizer
        self.env = make_env(task)

    def new_episode(
        self, episode_id: EpisodeId, prompt_id: int, policy_url: str, sampling: Sampling
    ) -> Episode:
        """A fresh episode at turn 0: the problem's prompt is its first segment."""
        problem = make_problem(self.task, self.seed, prompt_id)
        prompt = self.tokenizer.encode_prompt(problem.prompt_text)
        return Episode(
            episode_id=episode_id,
            prompt_id=prompt_id,
            policy_url=policy_url,
            sampling=sampling,
            state=self.env.start(problem),
            segments=[Segment("prompt", prompt)],
        )

    async def run(self, episode: Episode) -> Episode:
        """Step ``episode`` until it finishes or fails (a failure is raised after marking)."""
        while episode.phase in LIVE_PHASES:
            await self.step(episode)
        return episode

    async def step(self, episode: Episode) -> None:
        """One transition of the state machine."""
        if episode.phase is Phase.AWAIT_MODEL:
            await self._boundary(episode, BEFORE_MODEL)
            await self._call_model(episode)
        elif episode.phase is Phase.AWAIT_TOOL:
            if await self._tool_round(episode):
                await self._boundary(episode, AFTER_TOOL)
        else:
            raise ValueError(f"episode {episode.episode_id} is {episode.phase.value}")

    async def _boundary(self, episode: Episode, where: str) -> None:
        for hook in self.hooks:
            await hook(episode, where)

    async def _call_model(self, episode: Episode) -> None:
        room = self.max_seq_len - episode.sequence_length()
        if room < 1:
            self._finish(episode, "length")
            return
        sampling = episode.sampling
        request = GenerationRequest(
            prompt_token_ids=tuple(episode.token_ids()),
            max_tokens=min(sampling.max_new_tokens, room),
            temperature=sampling.temperature,
            seed=None if sampling.seed is None else turn_seed(sampling.seed, episode.turn),
            weight_version=sampling.weight_version,
            rollout_id=episode.episode_id.row_key,
            call_index=episode.turn,
        )
        try:
            result = await self.policy.complete(episode.policy_url, request)
        except PolicyCallError as error:
            episode.phase, episode.error = Phase.FAILED, POLICY_FAILED_PREFIX + str(error)
            raise
        episode.segments.append(
            Segment("model", result.token_ids, result.logprobs, result.weight_versions)
        )
        text_ids, stopped = self.tokenizer.strip_eos(result.token_ids)
        episode.pending = {"text": self.tokenizer.decode(text_ids), "stopped": stopped}
        episode.phase = Phase.AWAIT_TOOL

    async def _tool_round(self, episode: Episode) -> bool:
        """Apply the pending tool call; return whether the episode goes on."""
        assert episode.pending is not None
        effect = self.env.interpret(
            episode.state, episode.pending["text"], episode.pending["stopped"]
        )
        if self.task.turn_delay_ms:
            await asyncio.sleep(self.task.turn_delay_ms / 1000)
        cancelled = False
        if effect is not None:
            try:
                # Write-ahead: the record is durable before the state changes.
                entry, cancelled = await self._record_through_cancel(episode, effect)
            except (SideEffectReplayError, SideEffectStorageError) as error:
                episode.phase, episode.error = Phase.FAILED, str(error)
                raise
            # No await between the record's return and changing the state.
            episode.revision = entry["revision"]
            episode.audit.append(entry)
        goes_on = self._apply(episode, effect)
        if cancelled:
            # The /run was cancelled while the record was written: it stops now, at the
            # boundary after this tool round, consistent with its log.
            raise asyncio.CancelledError
        return goes_on

    async def _record_through_cancel(
        self, episode: Episode, effect: dict[str, Any]
    ) -> tuple[dict[str, Any], bool]:
        """Write ``effect``'s record to the end even if the ``/run`` is cancelled meanwhile;
        return the record and whether a cancel arrived.

        Why: once the write is under way, the log counts the revision as applied whatever
        happens. Stopping the episode there would leave it behind a revision its log claims,
        which no restore may continue (its rollout would restart from turn 0, losing every
        turn it had). Finishing the write and then the state change keeps the episode
        consistent, so its trainer's successor continues it from the replica's own copy.
        """
        writing = asyncio.ensure_future(self.effects.record(episode, effect))
        cancelled = False
        while True:
            try:
                return await asyncio.shield(writing), cancelled
            except asyncio.CancelledError:
                if writing.cancelled():  # the loop itself is closing: nothing to finish
                    raise
                cancelled = True

    def _apply(self, episode: Episode, effect: dict[str, Any] | None) -> bool:
        """The state change of a tool round (no await); return whether the episode goes on."""
        outcome = self.env.apply(episode.state, effect)
        episode.turn += 1
        episode.pending = None
        if outcome.done:
            self._finish(episode, "done")
            return False
        reply = self.tokenizer.encode(outcome.observation)
        if episode.sequence_length() + len(reply) >= self.max_seq_len:
            self._finish(episode, "length")
            return False
        episode.segments.append(Segment("env", reply))
        episode.phase = Phase.AWAIT_MODEL
        return True

    def _finish(self, episode: Episode, reason: str) -> None:
        episode.reward = self.env.score(episode.state)
        episode.finish_reason = reason
        episode.phase = Phase.FINISHED
