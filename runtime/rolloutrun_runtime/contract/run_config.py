"""RunConfig: the pod contract between the operator and the runtime.

One pydantic model describes a whole run: the policy, the task and its dataset, GRPO,
rollout dispatch, checkpointing and the Gym replicas. The operator embeds it verbatim in the
RolloutRun CRD (``spec.run``), renders it into a ConfigMap, and the trainer and Gym pods read
it back; ``rolloutrun train`` reads the same model from an example's ``spec.run``. Keeping it
one model means one source of truth for field names, defaults, bounds and documentation: the
CRD schema is generated from it (see ``rolloutrun_operator.api.crdgen``).

Rules for fields: every field has a description and bounds (``ge``/``le`` for numbers,
``max_length`` or a pattern for strings, ``max_length`` for lists), a camelCase alias for
YAML, and no float where a count is meant. Unknown fields are rejected (``extra="forbid"``)
so a typo in a RolloutRun fails loudly instead of being ignored.

This module imports only pydantic and the standard library: the operator image has no torch.
"""

from __future__ import annotations

import enum
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field, StringConstraints, model_validator

from rolloutrun_runtime.contract.config_base import ConfigSection as _Model
from rolloutrun_runtime.contract.config_fingerprint import fingerprint_of, flatten
from rolloutrun_runtime.contract.field_rules import FieldRule, cel_rules
from rolloutrun_runtime.contract.layout import DEFAULT_STORAGE_DIR
from rolloutrun_runtime.contract.policy_config import HEADS_DIVIDE_WIDTH as HEADS_DIVIDE_WIDTH
from rolloutrun_runtime.contract.policy_config import Device as Device
from rolloutrun_runtime.contract.policy_config import PolicyConfig as PolicyConfig
from rolloutrun_runtime.contract.policy_config import PolicyDtype as PolicyDtype
from rolloutrun_runtime.contract.prompt_set import DatasetConfig as DatasetConfig
from rolloutrun_runtime.contract.prompt_set import DatasetFormat as DatasetFormat

#: Storage URIs the runtime can write checkpoints to (see ``rolloutrun_runtime.storage``).
STORAGE_URI_PATTERN = (
    r"^(file://(/[^\s]*)?|gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?|/[^\s]*)$"
)


#: The trainer's exit code when no durable entry can ever be restored (every candidate was
#: refused for a reason a restart cannot change: an incompatible config, a corrupt or
#: foreign checkpoint), or when the policy's model or the prompt file (``task.dataset``)
#: cannot be loaded; the Gym exits with it too when its ``policy.model`` is unusable. The
#: operator maps a trainer's to ``Failed`` instead of restarting into the same refusal until
#: ``maxRestarts`` (78 is ``EX_CONFIG`` of sysexits.h: a configuration error).
UNRESTORABLE_EXIT_CODE = 78


#: A base URL such as ``http://127.0.0.5:8000``.
EndpointUrl = Annotated[
    str, StringConstraints(max_length=512, pattern=r"^https?://[^\s/]+(:[0-9]+)?(/[^\s]*)?$")
]


#: Only a multi-turn task has turns to resume at.
TURN_NEEDS_MULTI_TURN = FieldRule(
    rule=(
        "!has(self.checkpointing) || self.checkpointing.targetLevel != 'turn' || "
        "(has(self.task) && (self.task.name == 'reach_target' || self.task.name == 'external'))"
    ),
    message=(
        "checkpointing.targetLevel 'turn' needs a multi-turn task "
        "(task.name: reach_target, or external: the user's environment server)"
    ),
)
#: A prompt set feeds the user's environment server; the built-in tasks make their own.
DATASET_NEEDS_EXTERNAL = FieldRule(
    rule="!has(self.dataset) || self.name == 'external'",
    message="task.dataset needs task.name: external (the built-in tasks make their own prompts)",
)


class TaskName(enum.StrEnum):
    """The environment tasks the Gym servers implement."""

    ARITHMETIC = "arithmetic"
    """Single turn: answer ``a+b=`` with the sum."""
    REACH_TARGET = "reach_target"
    """Multi turn: move a counter to a target with ``add(k)`` tool calls, one per turn."""
    EXTERNAL = "external"
    """The user's own environment server (``spec.gym.image``/``command``), reached through
    the HTTP contract of docs/environment-contract.md; its prompts come from ``dataset``."""


class TargetLevel(enum.StrEnum):
    """How much in-flight work a rollout snapshot keeps (rollout recovery granularity)."""

    NONE = "none"
    """No rollout recovery: restart from trainer checkpoints only."""
    PROMPT_GROUP = "prompt_group"
    """Finished groups survive; an unfinished group restarts all its siblings."""
    SIBLING = "sibling"
    """Finished siblings survive; unfinished siblings restart from turn 0."""
    TURN = "turn"
    """Unfinished multi-turn episodes resume at their last committed turn."""


class WorkerBackend(enum.StrEnum):
    """Where the policy workers run."""

    RAY = "ray"
    """Ray actors: ``ray.init`` locally, or join ``workers.rayAddress``."""
    INPROCESS = "inprocess"
    """In the trainer process itself: no Ray, used by fast tests and tiny runs."""


class TaskConfig(_Model):
    """The task the Gym servers run and the dataset of prompts the trainer draws from."""

    model_config = ConfigDict(json_schema_extra=cel_rules(DATASET_NEEDS_EXTERNAL))

    name: TaskName = Field(TaskName.ARITHMETIC, description="Environment task.")
    dataset_size: int = Field(
        512, ge=1, le=10_000_000, description="Number of prompts in one epoch of the dataset."
    )
    max_operand: int = Field(
        9, ge=1, le=1_000_000, description="Largest operand (arithmetic) or target (reach_target)."
    )
    max_turns: int = Field(
        4, ge=1, le=256, description="Most model turns in one episode (multi-turn tasks)."
    )
    max_new_tokens: int = Field(
        8, ge=1, le=4096, description="Most tokens the model may generate in one turn."
    )
    turn_delay_ms: int = Field(
        0,
        ge=0,
        le=600_000,
        description=(
            "Simulated tool latency per turn, in milliseconds (makes rollouts long enough to "
            "be caught in flight by a snapshot or a kill)."
        ),
    )
    dataset: DatasetConfig | None = Field(
        None,
        description=(
            "Prompts from a JSONL or Parquet file (task.name: external); its row count "
            "replaces datasetSize."
        ),
    )

    @model_validator(mode="after")
    def _dataset_needs_external(self) -> TaskConfig:
        if self.dataset is not None and self.name is not TaskName.EXTERNAL:
            raise ValueError(f"{DATASET_NEEDS_EXTERNAL.message}, not {self.name.value!r}")
        return self


class GRPOConfig(_Model):
    """Group-relative policy optimization with a PPO-clip loss."""

    group_size: int = Field(
        8, ge=2, le=1024, description="Generations per prompt (siblings in one prompt group)."
    )
    prompts_per_step: int = Field(
        8, ge=1, le=65_536, description="Prompt groups consumed by one optimizer step."
    )
    max_steps: int = Field(20, ge=1, le=10_000_000, description="Optimizer steps in the run.")
    learning_rate: float = Field(3e-3, gt=0.0, le=1.0, description="Adam learning rate.")
    clip_epsilon: float = Field(
        0.2, gt=0.0, le=1.0, description="PPO clip range for the importance ratio."
    )
    max_staleness: int = Field(
        1,
        ge=0,
        le=1024,
        description=(
            "Most policy versions a group's generation may lag the step that trains it; "
            "0 makes the run synchronous."
        ),
    )
    drop_zero_variance_groups: bool = Field(
        True,
        description=(
            "Drop groups whose rewards are all equal (no learning signal) and replace them "
            "from the spare-prompt pool."
        ),
    )
    min_step_batch_fraction: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description=(
            "Smallest share of promptsPerStep a step may close with after shortfall "
            "(groups given up)."
        ),
    )


class RolloutConfig(_Model):
    """Rollout dispatch: concurrency, the recovery ledger and the spare-prompt pool."""

    max_in_flight_groups: int = Field(
        16, ge=1, le=65_536, description="Most prompt groups generating at once."
    )
    replay_capacity: int = Field(
        64,
        ge=1,
        le=1_000_000,
        description="Most finished groups the replay buffer holds (one capacity permit each).",
    )
    ledger_dispatch: bool = Field(
        True,
        description=(
            "Record every prompt group in the recovery ledger (needed for rollout recovery; "
            "forced on when checkpointing.targetLevel is not none)."
        ),
    )
    spare_low_water: int = Field(
        2,
        ge=0,
        le=65_536,
        description="Refill the spare-prompt pool when it holds fewer prompts than this.",
    )
    rollout_timeout_seconds: int = Field(
        120, ge=1, le=86_400, description="Give up an attempt that runs longer than this."
    )
    max_attempts: int = Field(
        3,
        ge=1,
        le=100,
        description="Attempts per sibling before its group is given up (counted as shortfall).",
    )
    gym_unreachable_seconds: int = Field(
        120,
        ge=1,
        le=86_400,
        description=(
            "How long a Gym replica may stay unreachable (connection refused or reset, DNS, "
            "connect timeout, 502/503/504 not answered by the Gym) before the trainer fails "
            "naming it. Attempts against it back off meanwhile and do not count against "
            "maxAttempts: a lost member is not a failed sample."
        ),
    )


class CheckpointingSettings(_Model):
    """Trainer checkpoints and rollout snapshots: what a RolloutRun's ``spec.run`` may set."""

    save_period: int = Field(
        5, ge=1, le=1_000_000, description="Save a trainer checkpoint every this many steps."
    )
    snapshot_interval_seconds: int = Field(
        10,
        ge=0,
        le=86_400,
        description=(
            "Attempt a rollout snapshot this often, independent of savePeriod; 0 turns "
            "periodic snapshots off."
        ),
    )
    snapshot_every_steps: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Also attempt a rollout snapshot right after every this many train steps, "
            "independent of savePeriod (1: after every step); 0 snapshots by time only."
        ),
    )
    snapshot_every_rollouts: int = Field(
        0,
        ge=0,
        le=1_000_000,
        description=(
            "Also attempt a rollout snapshot once this many rollout attempts were dispatched "
            "since the last attempt began, whatever the step time (a kill loses what was "
            "dispatched after the last snapshot's cut); 0 turns this trigger off."
        ),
    )
    keep_latest: int = Field(
        3,
        ge=1,
        le=1000,
        description="Snapshots and trainer checkpoints kept; the newest valid one is always kept.",
    )
    target_level: TargetLevel = Field(
        TargetLevel.SIBLING, description="How much in-flight work a snapshot keeps."
    )
    trace: bool = Field(True, description="Append rollout events to <logDir>/rollout_trace.jsonl.")
    deterministic: bool = Field(
        False,
        description=(
            "Seed sampling per (seed, prompt, generation, turn), pin each rollout to the "
            "weight version its target step fixes and order groups deterministically, so a "
            "resumed run ends bit-identical to an uninterrupted one."
        ),
    )
    preemption_grace_seconds: int = Field(
        25,
        ge=1,
        le=3600,
        description="On SIGTERM, the forced snapshot must publish within this many seconds.",
    )
    defer_finalize: bool = Field(
        False,
        description="Finalize (publish) a trainer checkpoint at the next step boundary.",
    )
    resume_from: str | None = Field(
        None,
        max_length=2048,
        description=(
            "Pin: the snapshot manifest or step_<N> URI to resume from, at every start while "
            "set; if it cannot be restored the run fails. Default: the newest restorable "
            "entry of the storage."
        ),
    )


class CheckpointingConfig(CheckpointingSettings):
    """Trainer checkpoints, rollout snapshots and their storage, as the pods receive them:
    the settings plus what the operator derives (``spec.storage.uri``, the latest manifest)."""

    storage_uri: str | None = Field(
        None,
        max_length=1024,
        pattern=STORAGE_URI_PATTERN,
        description=(
            "Where checkpoints and snapshots go: file:///path or gs://bucket/prefix. "
            "Default: <logDir>/checkpoints."
        ),
    )
    resume_hint: str | None = Field(
        None,
        max_length=2048,
        description=(
            "Set by the operator (the latest published manifest it knows of): a hint only; "
            "the runtime still resumes from the newest restorable entry."
        ),
    )


class GymSettings(_Model):
    """The Gym environment servers: what a RolloutRun's ``spec.run`` may set."""

    request_max_bytes: int = Field(
        1_048_576,
        ge=1024,
        le=1_073_741_824,
        description="Largest request body a Gym server accepts.",
    )
    checkpoint_lease_grace_seconds: int = Field(
        30,
        ge=1,
        le=3600,
        description=(
            "If the trainer stops renewing a checkpoint phase for deadline plus this, the "
            "Gym resumes on its own."
        ),
    )


class GymConfig(GymSettings):
    """The Gym environment servers as the pods receive them: the settings plus the
    replicas and standbys (``spec.gym`` in a RolloutRun) and their endpoints (rendered by
    the operator once pods have addresses)."""

    replicas: int = Field(2, ge=1, le=1024, description="Gym server replicas.")
    standby: int = Field(
        0,
        ge=0,
        le=64,
        description=(
            "Warm standby Gym replicas, endpoints[replicas:]: no new episode while the active "
            "ones are up, a lost one's share until it is re-admitted (spec.gym.standby)."
        ),
    )
    endpoints: list[EndpointUrl] = Field(
        default_factory=list,
        max_length=1088,
        description=(
            "Base URLs of the Gym replicas, active then standby (rendered by the operator "
            "once pods have addresses); empty in local mode, where the launcher starts them."
        ),
    )

    @property
    def servers(self) -> int:
        """Gym servers: the active replicas and the standbys."""
        return self.replicas + self.standby


class WorkersConfig(_Model):
    """Where the policy workers (generation and training) run."""

    backend: WorkerBackend = Field(WorkerBackend.RAY, description="Worker backend.")
    ray_address: str | None = Field(
        None,
        max_length=512,
        description=(
            "Ray cluster to join: a GCS address host:port (the trainer joins as a node) or "
            "ray://host:port (Ray Client); default: a Ray of the trainer's own (with "
            "worker pods, a head on the pod address)."
        ),
    )
    generation_workers: int = Field(
        1, ge=1, le=256, description="Generation server workers behind the policy endpoint."
    )


class WorkerPlacement(WorkersConfig):
    """:class:`WorkersConfig` plus what the operator derives from ``spec.workers``."""

    worker_nodes: int = Field(
        0,
        ge=0,
        le=256,
        description=(
            "Ray worker nodes offering the generation resource (rolloutrun.dev/generation) "
            "the generation actors are placed on (the operator sets it from "
            "spec.workers.replicas); 0: the actors run on the trainer's own node."
        ),
    )
    standby_workers: int = Field(
        0,
        ge=0,
        le=1024,
        description=(
            "Warm standby generation actors: started and serving, but handed to no Gym "
            "until an active one is lost, when one is admitted in its place at once (the "
            "operator sets it from spec.workers.standby times the slots of a worker pod)."
        ),
    )


class RunSettings(_Model):
    """One RL post-training run as a user states it (a RolloutRun's ``spec.run``): the
    policy, task, GRPO, rollout, checkpointing, Gym and worker settings.

    Why apart from :class:`RunConfig`: the fields the operator derives (the storage URI from
    ``spec.storage``, the Gym replicas from ``spec.gym`` and their endpoints, the latest
    manifest as a resume hint) are not the user's to set, so the CRD does not offer them."""

    model_config = ConfigDict(json_schema_extra=cel_rules(TURN_NEEDS_MULTI_TURN))

    name: str = Field(
        "run",
        min_length=1,
        max_length=63,
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        description="Run name (a DNS label); tags logs, traces and snapshot manifests.",
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seed for every random choice.")
    log_dir: str = Field(
        "runs/run",
        min_length=1,
        max_length=1024,
        description="Directory for metrics, traces and (by default) checkpoints.",
    )
    policy: PolicyConfig = Field(default_factory=PolicyConfig, description="The policy model.")
    task: TaskConfig = Field(default_factory=TaskConfig, description="Task and dataset.")
    grpo: GRPOConfig = Field(default_factory=GRPOConfig, description="GRPO settings.")
    rollout: RolloutConfig = Field(
        default_factory=RolloutConfig, description="Rollout dispatch settings."
    )
    checkpointing: CheckpointingSettings = Field(
        default_factory=CheckpointingSettings, description="Checkpoints and rollout snapshots."
    )
    gym: GymSettings = Field(default_factory=GymSettings, description="Gym environment servers.")
    workers: WorkersConfig = Field(
        default_factory=WorkersConfig, description="Policy worker placement."
    )

    @model_validator(mode="after")
    def _turn_needs_multi_turn(self) -> RunSettings:
        if self.checkpointing.target_level is TargetLevel.TURN and self.task.name not in (
            TaskName.REACH_TARGET,
            TaskName.EXTERNAL,
        ):
            raise ValueError(f"{TURN_NEEDS_MULTI_TURN.message}, not {self.task.name.value!r}")
        return self

    def to_yaml_dict(self) -> dict[str, Any]:
        """The config as the camelCase mapping a RolloutRun's ``spec.run`` holds."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


#: RunConfig fields the operator derives, as dotted camelCase paths of ``spec.run``.
OPERATOR_OWNED_FIELDS: dict[str, str] = {
    "checkpointing.storageUri": "spec.storage.uri",
    "checkpointing.resumeHint": "the latest published snapshot manifest",
    "gym.replicas": "spec.gym.replicas",
    "gym.standby": "spec.gym.standby",
    "gym.endpoints": "the Gym pods' addresses",
    "workers.workerNodes": "spec.workers.replicas",
    "workers.standbyWorkers": "spec.workers.standby",
}


class RunConfig(RunSettings):
    """One RL post-training run: everything the trainer and Gym pods need to know (the
    settings plus what the operator derives; ``rolloutrun train`` sets those itself)."""

    checkpointing: CheckpointingConfig = Field(
        default_factory=CheckpointingConfig, description="Checkpoints and rollout snapshots."
    )
    gym: GymConfig = Field(default_factory=GymConfig, description="Gym environment servers.")
    workers: WorkerPlacement = Field(
        default_factory=WorkerPlacement, description="Policy worker placement."
    )

    @model_validator(mode="after")
    def _endpoints_match_replicas(self) -> RunConfig:
        if self.gym.endpoints and len(self.gym.endpoints) != self.gym.servers:
            raise ValueError(
                f"gym.endpoints lists {len(self.gym.endpoints)} URLs but gym.replicas plus "
                f"gym.standby is {self.gym.servers}"
            )
        return self

    def settings_yaml_dict(self) -> dict[str, Any]:
        """The config as a RolloutRun's ``spec.run`` may state it: without the fields the
        operator derives (:data:`OPERATOR_OWNED_FIELDS`)."""
        data = self.to_yaml_dict()
        for dotted in OPERATOR_OWNED_FIELDS:
            section, _, key = dotted.partition(".")
            data.get(section, {}).pop(key, None)
        return data

    # ----------------------------------------------------------------- derived values
    @property
    def uses_ledger(self) -> bool:
        """Whether dispatch records prompt groups in the recovery ledger."""
        return self.rollout.ledger_dispatch or self.checkpointing.target_level is not (
            TargetLevel.NONE
        )

    def resolved_storage_uri(self) -> str:
        """The checkpoint storage URI, defaulting to ``file://<logDir>/checkpoints``."""
        uri = self.checkpointing.storage_uri
        if uri is None:
            return "file://" + str((Path(self.log_dir) / DEFAULT_STORAGE_DIR).resolve())
        if uri.startswith("/"):
            return "file://" + uri
        return uri

    def fingerprint(self, exclude: frozenset[str] = frozenset()) -> str:
        """sha256 over the canonical JSON of the config, minus the dotted keys in ``exclude``."""
        return fingerprint_of(flatten(self.to_yaml_dict(), exclude))


class ConfigError(ValueError):
    """A run config (or the RolloutRun around it) is invalid; the message names the field."""


def _format_validation_error(source: str, error: Exception) -> str:
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return f"{source}: {error}"
    lines = [f"{source}: invalid run config ({error.error_count()} problem(s))"]
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(root)"
        lines.append(f"  {where}: {item['msg']}")
    return "\n".join(lines)


def parse_run_config(data: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a ``spec.run`` mapping (or a bare RunConfig mapping) into a RunConfig."""
    from pydantic import ValidationError

    try:
        return RunConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_format_validation_error(source, error)) from error


def load_run_config(path: str | Path) -> RunConfig:
    """Load a RunConfig from a YAML file: a RolloutRun (its ``spec.run``) or a bare RunConfig.

    A RolloutRun's ``metadata.name`` becomes the run name unless ``spec.run.name`` is set,
    and its ``spec.gym`` replicas and standby the Gym's (as the operator renders them)."""
    from rolloutrun_runtime.contract.kube_yaml import YAMLError, load_yaml

    path = Path(path)
    try:
        document = load_yaml(path.read_text())
    except FileNotFoundError as error:
        raise ConfigError(f"{path}: no such file") from error
    except YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(document, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if document.get("kind") == "RolloutRun":
        spec = document.get("spec")
        if not isinstance(spec, dict) or not isinstance(spec.get("run", {}), dict):
            raise ConfigError(f"{path}: a RolloutRun needs a mapping at spec.run")
        run = dict(spec.get("run") or {})
        name = (document.get("metadata") or {}).get("name")
        if name and "name" not in run:
            run["name"] = name
        for field in ("replicas", "standby"):
            count = (spec.get("gym") or {}).get(field)
            if count is not None and isinstance(run.get("gym", {}), dict):
                run["gym"] = {**run.get("gym", {}), field: count}
        return parse_run_config(run, source=f"{path}: spec.run")
    return parse_run_config(document, source=str(path))
