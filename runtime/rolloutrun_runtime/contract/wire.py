"""The wire: routes and request/response models of every HTTP API between the pods.

Why one module both sides import: a Gym replica, the trainer's Gym client, the trainer's
checkpoint client and the generation service run in different processes (and pods), and
each API used to be written twice, a dict built by the client and a model validated by the
server, so a field renamed on one side failed only at run time. Here each body is a pydantic
model: the client builds it (``model_dump(mode="json", exclude_unset=True)``, so the fields
on the wire are exactly those the client sets, as before) and the server validates it with
the same model. Responses are models the server fills in the same way.

The bytes stay what they were: field names, their order and number formatting are those of
the dicts these models replace (deterministic runs compare weights bit for bit).

APIs:

- a Gym replica: ``POST /run`` (:class:`RunRequest` → :class:`RunResult`),
  ``GET /episodes/{rollout_id}`` (:class:`EpisodesAnswer`), ``POST /policy``
  (:class:`PolicyAnnouncement`), ``GET /healthz`` (:class:`GymHealth`);
- a Gym's checkpoint control plane, bearer-token routes under :data:`CONTROL_ROUTE_PREFIX`
  (:class:`CheckpointCall` and its kin → :class:`ControlState` and its kin);
- the policy's generation service: ``POST /v1/completions`` (:class:`CompletionRequest` →
  :class:`CompletionResult`), ``GET /v1/weight_version``, the token capture under
  ``/token-capture/rollouts/{rollout_id}``, ``GET /healthz``.

Every route but ``/healthz`` needs the run's bearer token (``Authorization: Bearer``, the
Gym token of ``contract.pod.ENV_GYM_TOKEN``); a call without it is answered 401.

Every error of these APIs is ``{"error": {"message", "type"?, "code"}}`` (:class:`ErrorBody`).

No model accepts ``NaN`` or ``Infinity`` (``allow_inf_nan=False`` in every model's config):
Python's JSON reader takes them, and a non-finite deadline or weight would pass every range
check and never expire.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

# ------------------------------------------------------------------------------ routes
HEALTHZ_ROUTE = "/healthz"
GYM_RUN_ROUTE = "/run"
GYM_EPISODES_ROUTE = "/episodes/{rollout_id}"
#: The trainer announces the generation addresses a ``/run`` may name (:class:`PolicyAnnouncement`).
GYM_POLICY_ROUTE = "/policy"
#: The ``error.type`` of a ``/run`` whose ``policy_url`` was not announced (the client
#: announces again and retries once: a restarted Gym forgot the announcement).
POLICY_NOT_ANNOUNCED = "policy_not_announced"
#: The ``error.type`` of a ``/run`` whose ``resume`` record the Gym will not continue (it is
#: stale: its rollout applied side effects past it, or this replica ran a later attempt);
#: the trainer restarts the sibling from turn 0 under a new rollout id.
RESUME_REFUSED = "resume_refused"
#: The ``error.type`` of a ``/run`` whose model call could not reach its ``policy_url``
#: (connection refused or reset, connect timeout, the endpoint silent: a lost generation
#: worker). Infrastructure, not a sample: the trainer redispatches the attempt (not counted
#: against ``maxAttempts``) and gives the Gyms no more calls to that endpoint until it
#: answers again or a refit replaces it.
POLICY_UNREACHABLE = "policy_unreachable"
#: The ``error.type`` of a data-plane call without the run's bearer token.
UNAUTHORIZED = "unauthorized"
CONTROL_ROUTE_PREFIX = "/ng-control/v1/checkpoint"
#: The control plane's routes: name → method (the path is ``control_route(name)``).
CONTROL_ROUTES = {
    "status": "GET",
    "prepare": "POST",
    "renew": "POST",
    "commit": "POST",
    "resume": "POST",
    "drop": "POST",
    "restore": "POST",
    "retire": "POST",
    "forget": "POST",
}
COMPLETIONS_ROUTE = "/v1/completions"
WEIGHT_VERSION_ROUTE = "/v1/weight_version"
TOKEN_CAPTURE_ROUTE = "/token-capture/rollouts/{rollout_id}"


def control_route(name: str) -> str:
    """The path of control-plane route ``name`` (``prepare``, ``commit``...)."""
    return f"{CONTROL_ROUTE_PREFIX}/{name}"


def episodes_route(rollout_id: str) -> str:
    return GYM_EPISODES_ROUTE.format(rollout_id=rollout_id)


def token_capture_route(rollout_id: str) -> str:
    return TOKEN_CAPTURE_ROUTE.format(rollout_id=rollout_id)


class _Request(BaseModel):
    """A request body: unknown fields and loose types are refused (the server names them).

    Every model here builds its validator on first use (``defer_build``): a process uses
    only some of them, and building all at import cost the trainer ~10 ms of start-up."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, defer_build=True)


class _Answer(BaseModel):
    """A response body: the server fills it in; readers ignore fields they do not know."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, defer_build=True)


class ErrorDetail(_Answer):
    message: str
    type: str | None = None
    code: int


class ErrorBody(_Answer):
    """Every API's error answer (OpenAI-style)."""

    error: ErrorDetail


# ------------------------------------------------------------------------ Gym: /run
class EpisodeRef(_Request):
    """Which episode: a rollout at one attempt (attempt N+1 continues N after a restore)."""

    rollout_id: str = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9._:~-]+$")
    attempt: int = Field(ge=0, le=1_000_000)


class SamplingParams(_Request):
    """How the policy samples the episode's turns; unset fields take the Gym's defaults."""

    temperature: float | None = Field(None, ge=0.0, le=10.0)
    max_new_tokens: int | None = Field(None, ge=1, le=65_536)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    weight_version: int | None = Field(None, ge=0)


#: A generation service's base URL, as a ``/run`` names it.
PolicyUrl = Annotated[str, Field(min_length=8, max_length=2048, pattern=r"^https?://\S+$")]
#: The most generation addresses a Gym replica keeps from announcements (oldest go first).
MAX_ANNOUNCED_POLICIES = 64


#: Longest prompt text a ``/run`` carries, in characters.
MAX_PROMPT_CHARS = 1_000_000


class PromptPayload(_Request):
    """A prompt-set row as ``/run`` carries it (``task.dataset``; see
    docs/environment-contract.md): the prompt text, the reference answer and the metadata
    fields the run's field mapping names. Sent with every attempt, so an environment server
    keeps no copy of the data."""

    text: str = Field(max_length=MAX_PROMPT_CHARS)
    answer: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class RunRequest(_Request):
    """The JSON body of ``POST /run``."""

    episode_id: EpisodeRef
    prompt_id: int = Field(ge=0)
    policy_url: PolicyUrl
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    task: str | None = Field(None, max_length=64, description="If given, must be this server's.")
    #: The row of the run's prompt set (``task.dataset``); None with the built-in tasks,
    #: which rebuild their problem from ``prompt_id``.
    prompt: PromptPayload | None = None
    #: Elastic members: the episode record (``Episode.to_record``) of an earlier attempt of
    #: this rollout, from the trainer's last published snapshot, when the replica that ran
    #: it was lost. The Gym continues the episode from that record under this attempt, or
    #: answers 409 :data:`RESUME_REFUSED` when continuing could repeat a side effect.
    resume: dict[str, Any] | None = None


class PolicyAnnouncement(_Request):
    """The body of ``POST /policy``: generation addresses a later ``/run`` may name."""

    policy_urls: list[PolicyUrl] = Field(min_length=1, max_length=MAX_ANNOUNCED_POLICIES)


class PolicyAnnounced(_Answer):
    """The answer of ``POST /policy``: every address this replica now accepts."""

    policy_urls: list[str]


class RunSegment(_Answer):
    """A run of tokens: ``prompt``, ``model`` (with logprobs and weight versions) or ``env``."""

    kind: str
    token_ids: list[int]
    logprobs: list[float] | None = None
    weight_versions: list[int] | None = None


class RunResult(_Answer):
    """The answer of ``POST /run``: a finished episode's reward and training segments."""

    episode_id: EpisodeRef
    instance_id: str
    reward: float | None
    segments: list[RunSegment]
    turns: int
    side_effects: int
    finish_reason: str | None


class EpisodesAnswer(_Answer):
    """The answer of ``GET /episodes/{rollout_id}``: every attempt held, as records."""

    rollout_id: str
    instance_id: str
    applied_revision: int
    episodes: list[dict[str, Any]]


#: The capability a Gym names in ``GymHealth.capabilities`` when it serves the checkpoint
#: control plane (:data:`CONTROL_ROUTES`); without it the trainer recovers at sibling level.
CHECKPOINT_CONTROL_CAPABILITY = "checkpoint_control"
#: A Gym that continues a ``/run``'s ``resume`` record (or refuses it, 409
#: :data:`RESUME_REFUSED`): the trainer sends a record only to a replica naming this, since
#: a server that ignored the field would restart the episode under the same rollout id.
MEMBER_RESUME_CAPABILITY = "member_resume"


class GymHealth(_Answer):
    """The answer of a Gym's ``GET /healthz`` (its ``instance_id`` is its stable id)."""

    status: str
    instance_id: str
    task: str
    live_episodes: int
    episodes_by_phase: dict[str, int]
    #: Optional features served (:data:`CHECKPOINT_CONTROL_CAPABILITY`,
    #: :data:`MEMBER_RESUME_CAPABILITY`); none when absent.
    capabilities: list[str] = Field(default_factory=list)


# ---------------------------------------------------------- Gym: checkpoint control plane
_CHECKPOINT_ID = r"^[A-Za-z0-9._:-]+$"
#: The longest deadline a control call may ask for, in seconds.
MAX_DEADLINE_S = 86_400.0


class TrainerIdentity(BaseModel):
    """Who drives the control plane: one trainer process of one incarnation."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, defer_build=True)
    id: str = Field(min_length=1, max_length=128, pattern=_CHECKPOINT_ID)
    incarnation: int = Field(ge=0)
    started_ns: int = Field(ge=0)

    @property
    def rank(self) -> tuple[int, int, str]:
        """Newer trainers rank higher: a later incarnation, else a later process start."""
        return (self.incarnation, self.started_ns, self.id)

    def describe(self) -> str:
        return f"{self.id} (incarnation {self.incarnation})"


class ControlCaller(BaseModel):
    """The part of every control call the routes share: who sends it."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, defer_build=True)
    trainer: TrainerIdentity | None = None


class CheckpointCall(BaseModel):
    """``prepare`` and ``renew``; the base of the calls below."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, defer_build=True)
    checkpoint_id: str = Field(min_length=1, max_length=128, pattern=_CHECKPOINT_ID)
    #: Seconds from receipt: the Gym adds them to its own monotonic clock, so the trainer's
    #: and the Gym's wall clocks never meet (an absolute time failed under clock skew).
    deadline_s: float = Field(ge=0, le=MAX_DEADLINE_S)
    trainer: TrainerIdentity | None = None


class CommitCall(CheckpointCall):
    #: Row keys of the episodes to export; None exports every copy.
    episodes: list[str] | None = Field(None, max_length=1_000_000)


class RestoreCall(CheckpointCall):
    """One chunk of a restore: the trainer sends a snapshot's records in bodies under the
    Gym's ``gym.requestMaxBytes``, numbered from 0, all under one ``checkpoint_id``; chunk 0
    opens the restore scope, later chunks add to it, and ``drop`` undoes every chunk."""

    records: list[dict[str, Any]] = Field(max_length=1_000_000)
    chunk: int = Field(0, ge=0, le=1_000_000)


class RetireCall(CheckpointCall):
    episodes: list[str] = Field(max_length=1_000_000)


class ForgetCall(CheckpointCall):
    rollout_ids: list[str] = Field(max_length=1_000_000)


class EndCall(BaseModel):
    """``resume`` and ``drop``: end a checkpoint (its deadline is optional)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, defer_build=True)
    checkpoint_id: str = Field(min_length=1, max_length=128)
    deadline_s: float | None = Field(None, ge=0, le=MAX_DEADLINE_S)
    trainer: TrainerIdentity | None = None


#: The body each control route validates (``status`` is a GET and has none).
CONTROL_CALLS: dict[str, type[CheckpointCall] | type[EndCall]] = {
    "prepare": CheckpointCall,
    "renew": CheckpointCall,
    "commit": CommitCall,
    "restore": RestoreCall,
    "retire": RetireCall,
    "forget": ForgetCall,
    "resume": EndCall,
    "drop": EndCall,
}


class ControlState(_Answer):
    """Every control answer: where the replica's control plane stands."""

    instance_id: str
    phase: str
    checkpoint_id: str | None
    #: Seconds until the replica resumes on its own if no call renews it (None when idle).
    lease_remaining_s: float | None
    trainer: TrainerIdentity | None
    copied: list[str]
    awaiting_copy: int
    runs_in_flight: int


class NotCopied(_Answer):
    episode: str
    state: str


class CommitAnswer(ControlState):
    """``commit``: the requested episodes' records, and those without a copy."""

    records: list[dict[str, Any]]
    not_copied: list[NotCopied] = Field(default_factory=list)


class RefusedRestore(_Answer):
    episode: str
    reason: str


class RestoreAnswer(ControlState):
    restored: list[str]
    refused: list[RefusedRestore]


class RetireAnswer(ControlState):
    retired: list[str]
    forgotten: int


class ForgetAnswer(ControlState):
    forgotten: int


#: The answer each control route sends.
CONTROL_ANSWERS: dict[str, type[ControlState]] = {
    "status": ControlState,
    "prepare": ControlState,
    "renew": ControlState,
    "commit": CommitAnswer,
    "restore": RestoreAnswer,
    "retire": RetireAnswer,
    "forget": ForgetAnswer,
    "resume": ControlState,
    "drop": ControlState,
}


# -------------------------------------------------------------------- generation API
class CompletionRequest(_Request):
    """The JSON body of ``POST /v1/completions``."""

    prompt_token_ids: list[int] = Field(min_length=1, max_length=65_536)
    max_tokens: int = Field(ge=1, le=65_536)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    weight_version: int | None = Field(None, ge=0)
    rollout_id: str | None = Field(None, min_length=1, max_length=512)
    call_index: int | None = Field(None, ge=0)
    model: str | None = Field(None, max_length=256, description="Ignored (OpenAI clients).")


class CompletionResult(_Answer):
    """The answer of ``POST /v1/completions``: per token, its logprob and weight version."""

    token_ids: list[int]
    logprobs: list[float]
    weight_versions: list[int]
    finish_reason: str  # "stop" (eos) or "length"


class WeightVersionAnswer(_Answer):
    """``GET /v1/weight_version``: the newest installed version, and the versions kept."""

    version: int
    versions: list[int]


class TokenCaptureAnswer(_Answer):
    """``GET /token-capture/rollouts/{rollout_id}``: the rollout's captured calls."""

    rollout_id: str
    calls: list[dict[str, Any]]


class TokenCaptureReleased(_Answer):
    """``DELETE /token-capture/rollouts/{rollout_id}``: how many calls were released."""

    rollout_id: str
    released: bool


class GenerationHealth(_Answer):
    status: str
    version: int
