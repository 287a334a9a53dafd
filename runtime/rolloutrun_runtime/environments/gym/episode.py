"""Episodes: identity, per-turn phase, state, segments, and the side-effect audit.

Why records: turn-level recovery (the next issue's checkpoint control plane) parks episodes
at turn boundaries, exports them (``Episode.to_record``) and installs them elsewhere under
``attempt + 1`` (``Episode.from_record``). Everything an episode needs to continue is here
as JSON: the task state, the training segments so far, the phase and turn, and the
``revision`` that counts applied side effects. The revision makes side effects idempotent:
an effect is keyed ``(rollout_id, revision)``, the same key across attempts, so a restored
attempt can never apply a revision its predecessor already applied.
"""

from __future__ import annotations

import copy
import enum
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rolloutrun_runtime.contract.layout import EPISODE_RECORD_VERSION
from rolloutrun_runtime.contract.wire import RunResult
from rolloutrun_runtime.experience.rollout_recovery import (
    RolloutIdError,
    parse_row_key,
    row_key_for,
)

_SCALARS = (str, int, float, bool, type(None))


def copy_state(value: Any) -> Any:
    """A deep copy of a task state (JSON-shaped: dicts, lists, tuples, scalars) that shares
    nothing mutable with ``value``, several times cheaper than ``copy.deepcopy`` (no memo: a value
    reached twice is copied twice, as a JSON round trip would). A copy is taken at every
    turn boundary of every running episode while a snapshot's copy window is open, on the
    Gym's one event loop; anything not JSON-shaped still goes through ``copy.deepcopy``."""
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is dict:
        return {
            key: item if type(item) in _SCALARS else copy_state(item) for key, item in value.items()
        }
    if kind is list:
        return [item if type(item) in _SCALARS else copy_state(item) for item in value]
    if kind is tuple:
        return tuple(item if type(item) in _SCALARS else copy_state(item) for item in value)
    return copy.deepcopy(value)


class EpisodeRecordError(ValueError):
    """An episode record that cannot be installed (version, fields)."""


@dataclass(frozen=True, order=True)
class EpisodeId:
    """A rollout's episode at one attempt; attempt N+1 continues attempt N after a restore."""

    rollout_id: str
    attempt: int = 0

    @property
    def row_key(self) -> str:
        """``<rollout_id>`` at attempt 0, ``<rollout_id>-a<attempt>`` after (the ledger's key)."""
        return row_key_for(self.rollout_id, self.attempt)

    @classmethod
    def from_row_key(cls, row_key: str) -> EpisodeId:
        """``<rollout_id>`` or ``<rollout_id>-a<N>`` back to an EpisodeId."""
        try:
            rollout_id, attempt = parse_row_key(row_key)
        except RolloutIdError:  # not a row key: taken as a bare rollout id
            return cls(row_key, 0)
        return cls(rollout_id, attempt)

    def to_json(self) -> dict[str, Any]:
        return {"rollout_id": self.rollout_id, "attempt": self.attempt}


class Phase(enum.StrEnum):
    """Where an episode's agent loop stands."""

    AWAIT_MODEL = "await_model"
    """At a turn boundary: the next step calls the policy."""
    AWAIT_TOOL = "await_tool"
    """The model answered; the next step applies its tool call."""
    FINISHED = "finished"
    """Scored; the result is final."""
    FAILED = "failed"
    """Stopped by an error (e.g. the policy endpoint failed)."""
    ABANDONED = "abandoned"
    """The caller went away mid-episode; the state is kept for inspection."""


#: The error recorded on an episode whose ``/run`` was cancelled (its client went away).
CANCELLED_REASON = "request cancelled"

#: How the error of an episode whose model call failed begins (its trainer, which serves
#: the policy, vanished: the episode rests at the boundary before that call).
POLICY_FAILED_PREFIX = "model call failed: "

#: Phases from which the agent loop can continue.
LIVE_PHASES = frozenset({Phase.AWAIT_MODEL, Phase.AWAIT_TOOL})


@dataclass
class Segment:
    """A run of tokens in the training sequence: prompt, model output, or env reply."""

    kind: str  # "prompt" | "model" | "env"
    token_ids: list[int]
    logprobs: list[float] | None = None
    weight_versions: list[int] | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "token_ids": list(self.token_ids)}
        if self.kind == "model":
            out["logprobs"] = list(self.logprobs or [])
            out["weight_versions"] = list(self.weight_versions or [])
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Segment:
        return cls(
            kind=data["kind"],
            token_ids=list(data["token_ids"]),
            logprobs=data.get("logprobs"),
            weight_versions=data.get("weight_versions"),
        )


@dataclass
class Sampling:
    """How the policy samples this episode's turns."""

    temperature: float
    max_new_tokens: int
    seed: int | None = None
    weight_version: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "max_new_tokens": self.max_new_tokens,
            "seed": self.seed,
            "weight_version": self.weight_version,
        }


@dataclass
class Episode:
    """One episode's full state between turns (see the module doc)."""

    episode_id: EpisodeId
    prompt_id: int
    policy_url: str
    sampling: Sampling
    state: dict[str, Any]
    segments: list[Segment]
    phase: Phase = Phase.AWAIT_MODEL
    turn: int = 0
    revision: int = 0
    audit: list[dict[str, Any]] = field(default_factory=list)
    pending: dict[str, Any] | None = None  # the model's answer awaiting its tool round
    reward: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    started_at: float = field(default_factory=time.time)

    @property
    def side_effects(self) -> int:
        return len(self.audit)

    def sequence_length(self) -> int:
        return sum(len(segment.token_ids) for segment in self.segments)

    def token_ids(self) -> list[int]:
        return [token for segment in self.segments for token in segment.token_ids]

    def result(self, instance_id: str) -> dict[str, Any]:
        """The ``/run`` response body of a finished episode (a :class:`RunResult`)."""
        result = RunResult.model_validate(
            {
                "episode_id": self.episode_id.to_json(),
                "instance_id": instance_id,
                "reward": self.reward,
                "segments": [segment.to_json() for segment in self.segments],
                "turns": self.turn,
                "side_effects": self.side_effects,
                "finish_reason": self.finish_reason,
            }
        )
        return result.model_dump(mode="json", exclude_unset=True)

    def to_record(self) -> dict[str, Any]:
        """Everything needed to continue (or inspect) this episode, as JSON.

        The record shares nothing the episode changes later (the task state is copied), so
        a checkpoint can keep it while the episode runs on.
        """
        return {
            "version": EPISODE_RECORD_VERSION,
            "episode_id": self.episode_id.to_json(),
            "prompt_id": self.prompt_id,
            "policy_url": self.policy_url,
            "sampling": self.sampling.to_json(),
            "state": copy_state(self.state),
            "segments": [segment.to_json() for segment in self.segments],
            "phase": self.phase.value,
            "turn": self.turn,
            "revision": self.revision,
            "audit": list(self.audit),
            "pending": dict(self.pending) if self.pending is not None else None,
            "reward": self.reward,
            "finish_reason": self.finish_reason,
            "error": self.error,
            "started_at": self.started_at,
        }

    @classmethod
    def from_record(cls, record: dict[str, Any], attempt: int | None = None) -> Episode:
        """Rebuild an episode; ``attempt`` re-keys it (a restore installs attempt + 1)."""
        if record.get("version") != EPISODE_RECORD_VERSION:
            raise EpisodeRecordError(
                f"episode record version {record.get('version')!r} is not {EPISODE_RECORD_VERSION}"
            )
        try:
            ident = record["episode_id"]
            episode_id = EpisodeId(
                ident["rollout_id"], ident["attempt"] if attempt is None else attempt
            )
            return cls(
                episode_id=episode_id,
                prompt_id=int(record["prompt_id"]),
                policy_url=str(record["policy_url"]),
                sampling=Sampling(**record["sampling"]),
                state=dict(record["state"]),
                segments=[Segment.from_json(s) for s in record["segments"]],
                phase=Phase(record["phase"]),
                turn=int(record["turn"]),
                revision=int(record["revision"]),
                audit=list(record["audit"]),
                pending=record["pending"],
                reward=record["reward"],
                finish_reason=record["finish_reason"],
                error=record["error"],
                started_at=float(record["started_at"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise EpisodeRecordError(
                f"episode record is incomplete or malformed: {error}"
            ) from error


class RestingEpisodes:
    """The episodes that can rest live with no ``/run`` driving them, so the idle copy at
    prepare costs what is live, not every episode a replica keeps (up to 50,000 finished).

    Those a ``/run`` drove to a boundary or claimed from a restore, until they leave the
    live phases. The first thing a ``/run`` does is reach a boundary, so an episode that
    never did holds no turn: restarting it from turn 0 is the same as a copy.
    """

    def __init__(self, episodes: Mapping[EpisodeId, Episode]) -> None:
        self._episodes = episodes
        self._ids: dict[EpisodeId, None] = {}

    def __len__(self) -> int:
        return len(self._ids)

    def driven(self, episode_id: EpisodeId) -> None:
        self._ids[episode_id] = None

    def run_ended(self, episode_id: EpisodeId | None) -> None:
        """Its ``/run`` ended: forget the episode unless it is still live (cancelled)."""
        if episode_id is not None and self._live(episode_id) is None:
            self._ids.pop(episode_id, None)

    def live(self, also: Iterable[EpisodeId] = ()) -> list[Episode]:
        """The live ones of these and of ``also`` (the restored unclaimed); forgets the rest."""
        out = []
        for episode_id in [*self._ids, *sorted(set(also) - self._ids.keys())]:
            episode = self._live(episode_id)
            if episode is None:
                self._ids.pop(episode_id, None)
            else:
                out.append(episode)
        return out

    def _live(self, episode_id: EpisodeId) -> Episode | None:
        episode = self._episodes.get(episode_id)
        return episode if episode is not None and episode.phase in LIVE_PHASES else None
