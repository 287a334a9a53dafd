"""The controller's side of the Gym ``/run`` protocol: replicas, requests, result rows.

Why separate from the pumps: the wire format (an episode id, a prompt id, the policy URL
and sampling settings in; reward and token segments out) and its conversion into aligned
training arrays are pure and tested alone; the pumps only decide *when* to call a replica
and what to record in the ledger around the call.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import numpy as np

from rolloutrun_runtime.experience.rollout_recovery import EnvironmentEpisode, PromptRef
from rolloutrun_runtime.metrics import OverheadClock


class GymError(RuntimeError):
    """Base of the Gym client's errors."""


class GymCallError(GymError):
    """A Gym ``/run`` call failed or returned something unusable (the attempt fails)."""


class GymUnavailableError(GymError):
    """A Gym replica cannot be used at all (unhealthy, unknown owner, client not open)."""


@dataclass
class GymReplica:
    """One Gym server: its base URL and the instance id the ledger records."""

    url: str
    instance_id: str


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


class GymClient:
    """HTTP calls to the Gym replicas, with round-robin placement and return-to-owner."""

    def __init__(
        self,
        endpoints: list[str],
        *,
        timeout_s: float,
        max_seq_len: int,
        overhead: OverheadClock,
    ) -> None:
        if not endpoints:
            raise GymUnavailableError("no Gym endpoints: set gym.endpoints or start Gym replicas")
        self.replicas = [GymReplica(url.rstrip("/"), f"gym-{i}") for i, url in enumerate(endpoints)]
        self.timeout_s = timeout_s
        self.max_seq_len = max_seq_len
        self.overhead = overhead
        self.env_seconds = 0.0
        self._next = 0
        self._session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        """Open the HTTP session and learn each replica's instance id from ``/healthz``."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        self._session = aiohttp.ClientSession(
            timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
        )
        for replica in self.replicas:
            try:
                async with self._session.get(f"{replica.url}/healthz") as response:
                    body = await response.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as error:
                await self.close()
                raise GymUnavailableError(
                    f"Gym replica {replica.url} is unhealthy: {error}"
                ) from error
            if isinstance(body, dict) and body.get("instance_id"):
                replica.instance_id = str(body["instance_id"])

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def pick(self, owner: str | None) -> GymReplica:
        """The replica that owns ``owner``'s turn state, else the next one in turn."""
        if owner is not None:
            for replica in self.replicas:
                if replica.instance_id == owner:
                    return replica
            raise GymUnavailableError(
                f"no Gym replica with instance id {owner!r} (it owns a resumed episode)"
            )
        replica = self.replicas[self._next % len(self.replicas)]
        self._next += 1
        return replica

    async def run_episode(
        self,
        replica: GymReplica,
        episode: EnvironmentEpisode,
        prompt_id: int,
        policy_url: str,
        sampling: Mapping[str, Any],
    ) -> dict[str, Any]:
        """``POST /run`` and convert the result into a training row (``GymCallError`` if not)."""
        if self._session is None:
            raise GymUnavailableError("the Gym client is not open")
        body = {
            "episode_id": {"rollout_id": episode.rollout_id, "attempt": episode.attempt},
            "prompt_id": prompt_id,
            "policy_url": policy_url,
            "sampling": dict(sampling),
        }
        started = time.perf_counter()
        try:
            async with self._session.post(f"{replica.url}/run", json=body) as response:
                raw = await response.read()
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as error:
            raise GymCallError(f"{replica.url}/run: {error!r}") from error
        finally:
            self.env_seconds += time.perf_counter() - started
        with self.overhead:
            if status >= 400:
                raise GymCallError(f"{replica.url}/run answered {status}: {raw[:300]!r}")
            try:
                result = json.loads(raw)
            except ValueError as error:
                raise GymCallError(f"{replica.url}/run returned invalid JSON") from error
            return segments_to_row(result, self.max_seq_len)
