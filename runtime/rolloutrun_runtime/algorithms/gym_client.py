"""The controller's side of the Gym ``/run`` protocol: replicas, requests, result rows.

Why separate from the pumps: the wire format (an episode id, a prompt id, the policy URL
and sampling settings in; reward and token segments out) and its conversion into aligned
training arrays are pure and tested alone; the pumps only decide *when* to call a replica
and what to record in the ledger around the call.

Two kinds of failed call, told apart here because they are handled differently: the Gym
answered about the episode (an error status with its JSON error body, a malformed result,
an episode over ``rolloutTimeoutSeconds``) is a failed *sample*, retried under the sibling's
``maxAttempts``; the endpoint could not be reached at all (connection refused or reset, DNS,
connect timeout, the replica closing the connection, 502/503/504 that the Gym did not write)
is *infrastructure*: a lost member is not a sample, so the attempt backs off and stays
pending (:mod:`.gym_outages` holds these decisions), and only an endpoint unreachable for
longer than ``rollout.gymUnreachableSeconds`` stops the trainer (``GymOutageError``), for
the operator to restart it from a snapshot.

Elastic members: a replica lost under a live trainer is skipped while it is unreachable (its
attempts are redispatched to the survivors by the rollout pump) and re-admitted once its
``/healthz`` answers again; a warm standby replica (``gym.standby``), probed like the
others but picked for no new episode while the active replicas are up, takes a lost one's
share at once, for as long as it is down (:func:`pick_replica`); when the operator replaces
the pod (a new address and member generation, :meth:`GymClient.readdress`), calls still in
flight to the old generation end as unreachable at once rather than at
``rolloutTimeoutSeconds``.

Every call carries the run's bearer token, and before a replica's first ``/run`` naming a
generation address the client announces that address (``POST /policy``): a Gym calls no
address the trainer did not announce. A replica that restarted has forgotten it and answers
403 ``policy_not_announced``; the client announces again and retries that call once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
import numpy as np
from pydantic import ValidationError

from rolloutrun_runtime.algorithms.gym_outages import BACKOFF_FIRST_S as BACKOFF_FIRST_S
from rolloutrun_runtime.algorithms.gym_outages import BACKOFF_MAX_S as BACKOFF_MAX_S
from rolloutrun_runtime.algorithms.gym_outages import (
    UNREACHABLE_STATUSES as UNREACHABLE_STATUSES,
)
from rolloutrun_runtime.algorithms.gym_outages import GymCallError as GymCallError
from rolloutrun_runtime.algorithms.gym_outages import GymError as GymError
from rolloutrun_runtime.algorithms.gym_outages import GymOutageError as GymOutageError
from rolloutrun_runtime.algorithms.gym_outages import (
    GymPolicyUnreachableError as GymPolicyUnreachableError,
)
from rolloutrun_runtime.algorithms.gym_outages import (
    GymResumeRefusedError as GymResumeRefusedError,
)
from rolloutrun_runtime.algorithms.gym_outages import GymUnavailableError as GymUnavailableError
from rolloutrun_runtime.algorithms.gym_outages import GymUnreachableError as GymUnreachableError
from rolloutrun_runtime.algorithms.gym_outages import OutageBudget as OutageBudget
from rolloutrun_runtime.algorithms.gym_outages import backoff_delay as backoff_delay
from rolloutrun_runtime.algorithms.gym_outages import error_type, unless_replaced
from rolloutrun_runtime.algorithms.gym_outages import is_not_announced as is_not_announced
from rolloutrun_runtime.algorithms.gym_outages import is_resume_refused as is_resume_refused
from rolloutrun_runtime.algorithms.gym_outages import (
    is_unreachable_status as is_unreachable_status,
)
from rolloutrun_runtime.algorithms.gym_replicas import GymReplica as GymReplica
from rolloutrun_runtime.algorithms.gym_replicas import capabilities as _capabilities
from rolloutrun_runtime.algorithms.gym_replicas import health_problem as health_problem
from rolloutrun_runtime.algorithms.gym_replicas import pick_replica as pick_replica
from rolloutrun_runtime.contract.pod import MemberEndpoint
from rolloutrun_runtime.contract.wire import (
    GYM_POLICY_ROUTE,
    GYM_RUN_ROUTE,
    HEALTHZ_ROUTE,
    MEMBER_RESUME_CAPABILITY,
    POLICY_UNREACHABLE,
    PolicyAnnouncement,
    RunRequest,
)
from rolloutrun_runtime.experience.rollout_recovery import EnvironmentEpisode, PromptRef
from rolloutrun_runtime.metrics import OverheadClock
from rolloutrun_runtime.policy.http import bearer_headers, data_plane_token, is_unreachable

logger = logging.getLogger(__name__)


#: Longest wait for a connection to a replica (a blackholed address is unreachable, not an
#: episode running past ``rolloutTimeoutSeconds``).
CONNECT_TIMEOUT_S = 10.0
#: How often a lost replica's ``/healthz`` is tried (re-admission), and its timeout.
READMIT_PERIOD_S = 0.1
PROBE_TIMEOUT_S = 2.0
#: Re-admission rounds in flight at once: a round starts every period without waiting for
#: the last (a probe sent before a new pod's address was reachable hangs until its timeout,
#: while a later one finds the Gym listening).
READMIT_ROUNDS = 8
#: How often the members' addresses are read (afresh, an API read, while a replica is down).
#: Each read is a call on the trainer's one Lease pipe, which its fence before every trainer
#: checkpoint and snapshot commit waits behind: read every 0.1 s while a replica was down,
#: the reads held the pipe (each slow while the API served the replacement) and the fences
#: queued, holding back the train steps (~2.4 s of fence waiting in the 10 s after a Gym's
#: loss, issue 14). A replacement's address is read while its Gym still starts (it listens
#: 1.5-2.6 s after its pod runs), so reading it up to 0.5 s later does not delay re-admission.
MEMBERS_READ_PERIOD_S = 0.5


def rollout_seed(seed: int, prompt: PromptRef, generation_index: int) -> int:
    """A sampling seed that depends only on the run seed, the prompt and the sibling."""
    digest = hashlib.sha256(
        f"{seed}:{prompt.epoch}:{prompt.prompt_id}:{generation_index}".encode()
    ).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def segments_to_row(result: Mapping[str, Any], max_seq_len: int) -> dict[str, Any]:
    """A Gym ``/run`` result as a training row of aligned numpy arrays.

    Only ``model`` segments are trained; their logprobs are the behaviour logprobs and their
    weight versions feed ``batch_age``. Raises ``GymCallError`` on a malformed result.
    """
    ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    mask: list[int] = []
    try:
        for segment in result["segments"]:
            tokens = segment["token_ids"]
            count = len(tokens)
            ids.extend(tokens)
            if segment["kind"] == "model":
                if len(segment["logprobs"]) != count or len(segment["weight_versions"]) != count:
                    raise GymCallError("model segment: logprobs/versions do not match tokens")
                logprobs.extend(segment["logprobs"])
                versions.extend(segment["weight_versions"])
                mask.extend([1] * count)
            else:
                logprobs.extend([0.0] * count)
                versions.extend([-1] * count)
                mask.extend([0] * count)
        reward = float(result["reward"])
    except (KeyError, TypeError, ValueError) as error:
        raise GymCallError(f"malformed /run result: {error!r}") from error
    if len(ids) < 2:
        raise GymCallError("a /run result needs at least two tokens")
    if len(ids) > max_seq_len:
        raise GymCallError(f"a /run result has {len(ids)} tokens, over maxSeqLen {max_seq_len}")
    mask_array = np.asarray(mask, dtype=np.int8)
    mask_array[0] = 0  # nothing predicts the first token
    return {
        "input_ids": np.asarray(ids, dtype=np.int64),
        "behaviour_logprobs": np.asarray(logprobs, dtype=np.float32),
        "weight_versions": np.asarray(versions, dtype=np.int64),
        "loss_mask": mask_array,
        "reward": reward,
        "model_tokens": int(mask_array.sum()),
        "instance_id": str(result.get("instance_id", "")),
    }


def carries_record(record: Mapping[str, Any], request_max_bytes: int) -> bool:
    """Whether an episode record may ride in a ``/run`` (a member resume): at most half of
    ``gym.requestMaxBytes``, the rest of the body's room left to the call."""
    return len(json.dumps(record)) <= request_max_bytes // 2


def run_request_body(
    episode: EnvironmentEpisode,
    prompt_id: int,
    policy_url: str,
    sampling: Mapping[str, Any],
    prompt: Mapping[str, Any] | None = None,
    resume: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of ``POST /run`` (a :class:`RunRequest`; only the fields given are sent).

    ``prompt`` is the prompt set's row (``task.dataset``), sent only when given; ``resume``
    an earlier attempt's episode record to continue from (elastic members).
    A body the Gym would refuse fails here as the same failed sample (``GymCallError``).
    """
    body: dict[str, Any] = {
        "episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
        "prompt_id": prompt_id,
        "policy_url": policy_url,
        "sampling": dict(sampling),
    }
    if prompt is not None:
        body["prompt"] = dict(prompt)
    if resume is not None:
        body["resume"] = dict(resume)
    try:
        request = RunRequest.model_validate(body)
    except ValidationError as error:
        raise GymCallError(f"invalid /run request: {error}") from error
    return request.model_dump(mode="json", exclude_unset=True)


class GymClient:
    """HTTP calls to the Gym replicas, with round-robin placement and return-to-owner."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        timeout_s: float,
        max_seq_len: int,
        overhead: OverheadClock,
        unreachable_budget_s: float = 120.0,
        token: str | None = None,
        prompt_payload: Callable[[int], Mapping[str, Any]] | None = None,
        active: int | None = None,
    ) -> None:
        """``token``: the run's bearer token (default: ``ENV_GYM_TOKEN``; required);
        ``prompt_payload``: a prompt id's row of the run's prompt set (``task.dataset``),
        carried by every ``/run``; ``active``: how many of ``endpoints``, the first, take
        new episodes (``gym.replicas``; the rest are standbys, :func:`pick_replica`;
        default: all)."""
        self.token = data_plane_token(token, "the trainer's Gym client")
        self.prompt_payload = prompt_payload
        if not endpoints:
            raise GymUnavailableError("no Gym endpoints: set gym.endpoints or start Gym replicas")
        self.replicas = [GymReplica(url.rstrip("/"), f"gym-{i}") for i, url in enumerate(endpoints)]
        self.active = active
        self.timeout_s = timeout_s
        self.max_seq_len = max_seq_len
        self.overhead = overhead
        self.env_seconds = 0.0
        self._next = 0
        self._session: aiohttp.ClientSession | None = None
        self.outages = OutageBudget(unreachable_budget_s)
        # Its own generator: the global ``random`` state is training state (checkpointed with
        # the trainer), and a backoff must never move it.
        self._jitter = random.Random()
        #: Generation addresses announced to each replica (by replica URL).
        self._announced: dict[str, set[str]] = {}
        #: Told of each replica readdressed to a new generation, and again once it answers
        #: (its instance id known then: one down since open had none) (on the event loop).
        self.on_replaced: Callable[[GymReplica], None] | None = None
        #: Why each replica's last ``/healthz`` did not admit it (by replica URL).
        self._unanswered: dict[str, str] = {}
        #: Told of each replica found unreachable, once per outage (its error's text): a
        #: turn-level environment checkpoint stops calling it at once (on the event loop).
        self.on_down: Callable[[GymReplica, str], None] | None = None
        self.outages.on_down = self._went_down

    def _went_down(self, url: str, error: BaseException) -> None:
        for replica in self.replicas:
            if replica.url == url and replica.identified and self.on_down is not None:
                self.on_down(replica, str(error))

    def backoff(self, tries: int) -> float:
        """The delay before the next try of an attempt that found its endpoint unreachable."""
        return backoff_delay(tries, self._jitter.random())

    async def open(
        self, members: Callable[[bool], Mapping[int, MemberEndpoint]] | None = None
    ) -> None:
        """Open the HTTP session and learn each replica's instance id from ``/healthz``.

        A replica that does not answer opens as down, as a replica lost under a running
        trainer is (its instance id unknown until it answers; :meth:`watch_members` re-admits
        it, at the address ``members`` gives if the operator replaced it): one lost Gym never
        ends the trainer. Only while *no* replica answers does open wait, following
        ``members`` and re-probing, and past the unreachable budget it ends with
        ``GymOutageError`` naming every replica."""
        timeout = aiohttp.ClientTimeout(
            total=self.timeout_s, sock_connect=min(self.timeout_s, CONNECT_TIMEOUT_S)
        )
        self._session = aiohttp.ClientSession(
            timeout=timeout,
            connector=aiohttp.TCPConnector(limit=0),
            headers=bearer_headers(self.token),
        )
        started = time.monotonic()
        answered = await asyncio.gather(*(self._healthy(replica) for replica in self.replicas))
        for replica, up in zip(self.replicas, answered, strict=True):
            if not up:
                cause = GymUnreachableError(replica.url, self._unanswered.get(replica.url, "?"))
                self.outages.unreachable(replica.url, cause)
                logger.warning("Gym replica opens as down: %s", cause)
        if self.all_down():
            try:
                await self._await_any(members, started)
            except BaseException:
                await self.close()
                raise

    async def _await_any(
        self, members: Callable[[bool], Mapping[int, MemberEndpoint]] | None, started: float
    ) -> None:
        """Follow the members and re-probe until one replica answers, at most the budget."""
        watch = asyncio.ensure_future(self.watch_members(members))
        try:
            while self.all_down():
                waited = time.monotonic() - started
                if waited >= self.outages.budget_s:
                    raise GymOutageError(
                        f"no Gym replica answered {HEALTHZ_ROUTE} within {waited:.1f}s "
                        f"(rollout.gymUnreachableSeconds {self.outages.budget_s:g}): "
                        + "; ".join(
                            f"{r.url}: {self._unanswered.get(r.url, '?')}" for r in self.replicas
                        )
                    )
                await asyncio.sleep(READMIT_PERIOD_S)
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def pick(self, owner: str | None) -> GymReplica:
        """The replica that owns ``owner``'s turn state (a standby too), else the next one
        in turn among the active replicas that are up and the standbys standing in."""
        if owner is not None:
            for replica in self.replicas:
                if replica.identified and replica.instance_id == owner:
                    return replica
            unknown = [replica for replica in self.replicas if not replica.identified]
            if unknown:  # its owner has not answered since open: down, as a lost owner is
                # (its call ends unreachable unsent, :meth:`_post`, and is redispatched)
                return dataclasses.replace(unknown[0], instance_id=owner, replaced=None)
            raise GymUnavailableError(
                f"no Gym replica with instance id {owner!r} (it owns a resumed episode)"
            )
        turn = pick_replica(self.replicas, self._next, self.outages.down, self.active)
        replica = self.replicas[turn]
        self._next += 1
        return replica

    def all_down(self) -> bool:
        """Whether no replica is up (each lost and not re-admitted)."""
        return all(self.outages.down(replica.url) for replica in self.replicas)

    def readdress(self, endpoint: MemberEndpoint) -> bool:
        """The operator replaced member ``endpoint.index``: a newer generation serves at
        ``endpoint.url``. Calls in flight to the older one end as unreachable (their attempts
        are redispatched), and the replica counts as down until its ``/healthz`` answers
        (:meth:`readmit`). True when this changed anything."""
        if not 0 <= endpoint.index < len(self.replicas):
            return False
        replica = self.replicas[endpoint.index]
        url = endpoint.url.rstrip("/")
        if endpoint.generation < replica.generation:
            return False  # an older read than one already taken: never go back
        if endpoint.generation == replica.generation and url == replica.url:
            return False
        logger.warning(
            "Gym replica %s (%s) replaced: generation %d at %s",
            endpoint.index,
            replica.instance_id,
            endpoint.generation,
            url,
        )
        if replica.replaced is not None:
            replica.replaced.set()
        replica.replaced = None
        old = replica.url
        if not self.outages.down(old):
            self.outages.unreachable(old, GymUnreachableError(old, "replaced"))
        self.outages.moved(old, url)
        self._announced.pop(old, None)
        replica.url, replica.generation = url, max(endpoint.generation, replica.generation)
        if self.on_replaced is not None:
            self.on_replaced(replica)
        return True

    async def readmit(self) -> list[GymReplica]:
        """Try ``/healthz`` of each replica that is down; those answering as the same
        instance are re-admitted (picked again). Returns them."""
        down = [replica for replica in self.replicas if self.outages.down(replica.url)]
        answers = await asyncio.gather(*(self._readmit_one(replica) for replica in down))
        return [replica for replica in answers if replica is not None]

    async def _readmit_one(self, replica: GymReplica) -> GymReplica | None:
        url = replica.url
        if not await self._healthy(replica):
            return None
        if replica.url != url or not self.outages.down(url):
            return None  # readdressed meanwhile, or another round took it in first
        self.outages.answered(url)
        self._announced.pop(url, None)  # a new process knows no address
        logger.info("Gym replica %s re-admitted at %s", replica.instance_id, url)
        if self.on_replaced is not None:  # its instance id is known now
            self.on_replaced(replica)
        return replica

    async def _healthy(self, replica: GymReplica) -> bool:
        """Whether ``replica`` answers ``/healthz`` as itself (learning its instance id
        while it has none); why not is kept in ``_unanswered`` by its URL."""
        if self._session is None:
            return False
        timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
        url = replica.url
        try:
            async with self._session.get(f"{url}{HEALTHZ_ROUTE}", timeout=timeout) as response:
                body = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            self._unanswered[url] = f"{type(error).__name__}: {error}"
            return False
        named = str(body.get("instance_id") or "") if isinstance(body, dict) else ""
        problem = health_problem(response.status, body, named, replica, self.replicas)
        if problem is not None:
            self._unanswered[url] = problem
            return False
        self._unanswered.pop(url, None)
        if named and not replica.identified:
            replica.instance_id = named
        replica.identified = True
        replica.capabilities = _capabilities(body)  # a replacement may run another image
        return True

    def resumes(self) -> bool:
        """Whether some replica takes a ``/run``'s resume record (elastic members)."""
        return any(MEMBER_RESUME_CAPABILITY in r.capabilities for r in self.replicas)

    async def watch_members(
        self,
        endpoints: Callable[[bool], Mapping[int, MemberEndpoint]] | None,
        period_s: float = READMIT_PERIOD_S,
        read_period_s: float = MEMBERS_READ_PERIOD_S,
    ) -> None:
        """Forever: take the member addresses ``endpoints`` gives every ``read_period_s``
        (asked to read afresh while one is down) and, side by side so a slow read never
        holds back a probe, re-admit the replicas that answer again: a round of probes each
        ``period_s``, without waiting for the last (at most :data:`READMIT_ROUNDS` in
        flight), so one hanging probe never holds back a replica that answers."""
        async with asyncio.TaskGroup() as both:
            if endpoints is not None:
                both.create_task(self._follow(endpoints, read_period_s))
            rounds: set[asyncio.Future[list[GymReplica]]] = set()
            try:
                while True:
                    for done in [r for r in rounds if r.done()]:
                        rounds.discard(done)
                        done.result()  # a round's error ends the watch, as before
                    down = any(self.outages.down(replica.url) for replica in self.replicas)
                    if down and len(rounds) < READMIT_ROUNDS:
                        rounds.add(asyncio.ensure_future(self.readmit()))
                    await asyncio.sleep(period_s)
            finally:
                for pending in rounds:
                    pending.cancel()
                await asyncio.gather(*rounds, return_exceptions=True)

    async def _follow(self, endpoints: Callable[..., Mapping[int, Any]], period_s: float) -> None:
        while True:
            down = any(self.outages.down(replica.url) for replica in self.replicas)
            try:
                known = await asyncio.to_thread(endpoints, down)
            except Exception as error:  # the next round asks again
                logger.warning("reading the Gym members' addresses failed: %s", error)
                known = {}
            for endpoint in known.values():
                self.readdress(endpoint)
            await asyncio.sleep(period_s)

    async def run_episode(
        self,
        replica: GymReplica,
        episode: EnvironmentEpisode,
        prompt_id: int,
        policy_url: str,
        sampling: Mapping[str, Any],
        resume: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """``POST /run`` and convert the result into a training row (``GymCallError`` if not;
        ``GymResumeRefusedError`` when the replica refused to continue from ``resume``)."""
        if self._session is None:
            raise GymUnavailableError("the Gym client is not open")
        # One that never answered has no capabilities yet: its call ends unreachable unsent
        # (``_post``), and the record goes on elsewhere, as a lost replica's does.
        if (
            resume is not None
            and replica.identified
            and MEMBER_RESUME_CAPABILITY not in replica.capabilities
        ):
            raise GymResumeRefusedError(f"{replica.url} does not take a resume record")
        prompt = None if self.prompt_payload is None else self.prompt_payload(prompt_id)
        body = run_request_body(episode, prompt_id, policy_url, sampling, prompt, resume)
        await self._announce(replica, policy_url)
        status, raw = await self._post(replica, GYM_RUN_ROUTE, body)
        if is_not_announced(status, raw):  # a restarted replica forgot the announcement
            self._announced.pop(replica.url, None)
            await self._announce(replica, policy_url)
            status, raw = await self._post(replica, GYM_RUN_ROUTE, body)
        with self.overhead:
            if is_unreachable_status(status, raw):
                raise GymUnreachableError(replica.url, f"answered {status}: {raw[:300]!r}")
            self.outages.answered(replica.url)
            if status >= 400 and error_type(raw) == POLICY_UNREACHABLE:
                raise GymPolicyUnreachableError(policy_url, f"{replica.url}: {raw[:300]!r}")
            if resume is not None and is_resume_refused(status, raw):
                raise GymResumeRefusedError(f"{replica.url}/run: {raw[:300]!r}")
            if status >= 400:
                raise GymCallError(f"{replica.url}/run answered {status}: {raw[:300]!r}")
            try:
                result = json.loads(raw)
            except ValueError as error:
                raise GymCallError(f"{replica.url}/run returned invalid JSON") from error
            return segments_to_row(result, self.max_seq_len)

    async def _announce(self, replica: GymReplica, policy_url: str) -> None:
        """Tell ``replica`` that ``/run`` may name ``policy_url`` (once per replica and URL)."""
        known = self._announced.setdefault(replica.url, set())
        if policy_url in known:
            return
        try:
            body = PolicyAnnouncement(policy_urls=[policy_url]).model_dump(mode="json")
        except ValidationError as error:
            raise GymCallError(f"invalid {GYM_POLICY_ROUTE} request: {error}") from error
        status, raw = await self._post(replica, GYM_POLICY_ROUTE, body)
        if is_unreachable_status(status, raw):
            raise GymUnreachableError(replica.url, f"answered {status}: {raw[:300]!r}")
        if status >= 400:
            raise GymCallError(f"{replica.url}{GYM_POLICY_ROUTE} answered {status}: {raw[:300]!r}")
        known.add(policy_url)

    async def _post(
        self, replica: GymReplica, route: str, body: dict[str, Any]
    ) -> tuple[int, bytes]:
        """POST ``body`` to ``replica``: its status and raw answer, or the unreachable error."""
        if self._session is None:
            raise GymUnavailableError("the Gym client is not open")
        if not replica.identified:  # never answered /healthz: down, and maybe not the owner
            raise GymUnreachableError(replica.url, f"has not answered {HEALTHZ_ROUTE} yet")
        started = time.perf_counter()
        if replica.replaced is None:
            replica.replaced = asyncio.Event()
        replaced, generation = replica.replaced, replica.generation
        try:
            return await unless_replaced(
                self._send(f"{replica.url}{route}", body), replaced, replica.url, generation
            )
        except (aiohttp.ClientError, TimeoutError, OSError) as error:
            if is_unreachable(error):
                raise GymUnreachableError(
                    replica.url, f"{type(error).__name__}: {error}"
                ) from error
            self.outages.answered(replica.url)
            raise GymCallError(f"{replica.url}{route}: {error!r}") from error
        finally:
            self.env_seconds += time.perf_counter() - started

    async def _send(self, url: str, body: dict[str, Any]) -> tuple[int, bytes]:
        assert self._session is not None
        async with self._session.post(url, json=body) as response:
            return response.status, await response.read()
