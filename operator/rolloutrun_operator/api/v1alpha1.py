"""The RolloutRun v1alpha1 API: spec and status as pydantic models.

These models are the single source of truth for the API. The CRD in ``crds/`` (and the Helm
chart's copy) is generated from them by :mod:`rolloutrun_operator.api.crdgen`, and a test fails
when the checked-in YAML drifts. The embedded ``spec.run`` is the runtime's own
:class:`~rolloutrun_runtime.contract.run_config.RunSettings` (the pods' ``RunConfig`` less the
fields the operator derives), so the pod contract is defined once.

Rules across fields are :class:`~rolloutrun_runtime.contract.field_rules.FieldRule` objects:
the CRD carries them as CEL (``x-kubernetes-validations``, refused at admission) and the
models' validators raise the same messages.

Every field carries a description (it becomes the CRD's documentation, shown by
``kubectl explain``) and bounds; counts are integers, never floats.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ConfigDict, Field, field_validator, model_validator

from rolloutrun_operator.api.common import (
    _LABEL_VALUE,
    DNS_SUBDOMAIN_PATTERN,
    LABEL_KEY_PATTERN,
    EnvVar,
    ResourceRequirements,
    Toleration,
    _Model,
)
from rolloutrun_operator.api.gym_server import ARGS_NEED_COMMAND, UserServerSettings
from rolloutrun_operator.api.pod_template import PodTemplate
from rolloutrun_operator.api.rules import (
    RESERVED_ENV_RULE,
    STORAGE_NEEDS_CLAIM,
    grace_below_termination,
)
from rolloutrun_operator.api.status import (
    Condition as Condition,
)
from rolloutrun_operator.api.status import (
    ConditionStatus as ConditionStatus,
)
from rolloutrun_operator.api.status import (
    FailureRecord as FailureRecord,
)
from rolloutrun_operator.api.status import (
    LeaseObservation as LeaseObservation,
)
from rolloutrun_operator.api.status import (
    MemberReplacements as MemberReplacements,
)
from rolloutrun_operator.api.status import (
    MemberState as MemberState,
)
from rolloutrun_operator.api.status import (
    RolloutRunStatus as RolloutRunStatus,
)
from rolloutrun_operator.kube_names import LABEL_VALUE, LABEL_VALUE_MAX
from rolloutrun_runtime.contract.field_rules import FieldRule, cel_rules
from rolloutrun_runtime.contract.pod import (
    API_GROUP,
    DEFAULT_GENERATION_PORT,
    DEFAULT_GYM_PORT,
    RESERVED_ENV,
)
from rolloutrun_runtime.contract.run_config import (
    STORAGE_URI_PATTERN,
    CheckpointingSettings,
    RunSettings,
    WorkerBackend,
)

GROUP = API_GROUP
VERSION = "v1alpha1"
KIND = "RolloutRun"
PLURAL = "rolloutruns"
SINGULAR = "rolloutrun"
SHORT_NAMES = ["rr"]


class PodSettings(_Model):
    """Scheduling and container settings for one kind of member pod."""

    model_config = ConfigDict(json_schema_extra=cel_rules(RESERVED_ENV_RULE))

    resources: ResourceRequirements = Field(
        default_factory=ResourceRequirements, description="Container resources."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        max_length=32,
        description="Node labels the pod must land on.",
        json_schema_extra={"additionalProperties": _LABEL_VALUE},
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Taints the pod tolerates."
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=128, description="Extra environment variables."
    )
    template: PodTemplate | None = Field(
        None,
        description=(
            "A PodTemplateSpec subset merged into the pod (labels, annotations, scheduling, "
            "GPUs, pull secrets, volumes, security additions); the operator's fields are "
            "protected: a template setting one is refused, naming the field."
        ),
    )
    termination_grace_period_seconds: int = Field(
        30,
        ge=1,
        le=3600,
        description=(
            "Time between SIGTERM and SIGKILL; the trainer's forced snapshot must publish "
            "within it."
        ),
    )

    @field_validator("env")
    @classmethod
    def _no_reserved_env(cls, env: list[EnvVar]) -> list[EnvVar]:
        """The operator's own variables (incarnation, pod name, Lease name, Gym token...)
        carry fencing and identity: an entry of the user's that overrode one would win."""
        reserved = sorted({var.name for var in env} & RESERVED_ENV)
        if reserved:
            raise ValueError(f"env {', '.join(reserved)}: {RESERVED_ENV_RULE.message}")
        return env


class GymPodSettings(PodSettings, UserServerSettings):
    """Gym environment server pods: the built-in Gym, or the user's own server
    (``image``/``command``/``args``; docs/environment-contract.md)."""

    model_config = ConfigDict(json_schema_extra=cel_rules(RESERVED_ENV_RULE, ARGS_NEED_COMMAND))

    replicas: int = Field(2, ge=1, le=1024, description="Gym server replicas.")
    standby: int = Field(
        0,
        ge=0,
        le=64,
        description=(
            "Warm standby Gym pods beyond replicas (indices replicas and up): started and "
            "health-probed like the others, but handed no new episode while every active "
            "replica is up; when one is lost (recovery.elasticMembers), a standby takes its "
            "share at once, until its replacement answers again. Costs one idle Gym pod "
            "each. 0 (the default): the survivors carry a lost Gym's share until its "
            "replacement starts (docs/recovery.md)."
        ),
    )
    port: int = Field(
        DEFAULT_GYM_PORT, ge=1024, le=65_535, description="Port the Gym servers listen on."
    )

    @property
    def pods(self) -> int:
        """Gym pods the operator keeps: the active replicas and the standbys."""
        return self.replicas + self.standby


class TrainerPodSettings(PodSettings):
    """The trainer pod (single controller, policy workers)."""

    generation_port: int = Field(
        DEFAULT_GENERATION_PORT,
        ge=1024,
        le=65_535,
        description="Port of the trainer's generation endpoint.",
    )


#: Standby worker pods wait to take a lost worker pod's place: without worker pods there is
#: nothing to take.
STANDBY_NEEDS_REPLICAS = FieldRule(
    rule="self.standby == 0 || self.replicas > 0",
    message="workers.standby needs workers.replicas > 0 (standby pods stand in for worker pods)",
    field_path=".standby",
)


class WorkerPodSettings(PodSettings):
    """Generation-worker pods: Ray worker nodes joining the head the trainer starts on its
    pod address; the generation actors are placed on them (docs/runtime.md "Generation
    workers as pods")."""

    model_config = ConfigDict(
        json_schema_extra=cel_rules(RESERVED_ENV_RULE, STANDBY_NEEDS_REPLICAS)
    )

    replicas: int = Field(
        0,
        ge=0,
        le=256,
        description=(
            "Worker pods; 0 (the default): the generation workers run in the trainer pod."
        ),
    )
    standby: int = Field(
        0,
        ge=0,
        le=64,
        description=(
            "Warm standby worker pods beyond replicas: joined to the Ray cluster with their "
            "generation servers started, but handed to no Gym until a worker is lost, when "
            "one takes its place at once and a new pod refills the pool. 0 (the default): a "
            "lost worker waits for its replacement pod to start (docs/runtime.md)."
        ),
    )

    @model_validator(mode="after")
    def _standby_needs_replicas(self) -> WorkerPodSettings:
        if self.standby and not self.replicas:
            raise ValueError(f"{STANDBY_NEEDS_REPLICAS.message} (standby {self.standby})")
        return self


class Images(_Model):
    """Container images of the member pods."""

    trainer: str = Field(
        "ghcr.io/rolloutrun/runtime:0.1.0",
        min_length=1,
        max_length=512,
        description="Image of the trainer pod.",
    )
    gym: str = Field(
        "ghcr.io/rolloutrun/runtime:0.1.0",
        min_length=1,
        max_length=512,
        description="Image of the Gym server pods.",
    )
    pull_policy: str = Field(
        "IfNotPresent",
        pattern=r"^(Always|IfNotPresent|Never)$",
        max_length=16,
        description="Image pull policy: Always, IfNotPresent or Never.",
    )


class SecretReference(_Model):
    """A Secret in the run's namespace."""

    name: str = Field(
        ...,
        min_length=1,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description="Secret name.",
    )


class MatchLabels(_Model):
    """A label selector of exact matches (a NetworkPolicy peer's pod or namespace selector)."""

    match_labels: dict[str, str] = Field(
        default_factory=dict,
        max_length=32,
        description="Labels the selected objects carry; empty selects all.",
        json_schema_extra={"additionalProperties": _LABEL_VALUE},
    )

    @field_validator("match_labels")
    @classmethod
    def _labels(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if len(key) > 317 or not re.match(LABEL_KEY_PATTERN, key):
                raise ValueError(f"matchLabels key {key!r} is not a label key")
            if len(value) > LABEL_VALUE_MAX or not LABEL_VALUE.fullmatch(value):
                raise ValueError(f"matchLabels[{key!r}] value {value!r} is not a label value")
        return labels


class MetricsPeer(_Model):
    """Pods (e.g. a Prometheus) let through the run's NetworkPolicies to its member pods."""

    pod_selector: MatchLabels = Field(
        default_factory=MatchLabels, description="The pods; empty: all pods of the namespaces."
    )
    namespace_selector: MatchLabels | None = Field(
        None, description="Their namespaces; default: the run's own namespace."
    )


class NetworkSpec(_Model):
    """Who may reach the member pods besides the run itself (its NetworkPolicies)."""

    metrics_from: list[MetricsPeer] = Field(
        default_factory=list,
        max_length=16,
        description=(
            "Peers that may reach the Gym and generation ports (where only /healthz answers "
            "without the run's token); the run's trainer and Gyms are always allowed."
        ),
    )


class StorageSpec(_Model):
    """Where checkpoints and rollout snapshots are kept."""

    model_config = ConfigDict(json_schema_extra=cel_rules(STORAGE_NEEDS_CLAIM))

    uri: str = Field(
        ...,
        min_length=1,
        max_length=1024,
        pattern=STORAGE_URI_PATTERN,
        description="file:///path (a volume shared across incarnations) or gs://bucket/prefix.",
    )
    credentials_secret: SecretReference | None = Field(
        None,
        description=(
            "Secret with a key 'credentials.json' (a GCP service-account key), mounted in the "
            "trainer for gs:// storage (not in the Gyms: see gymCredentialsSecret); omit to "
            "use workload identity."
        ),
    )
    gym_credentials_secret: SecretReference | None = Field(
        None,
        description=(
            "Secret with a key 'credentials.json' mounted in the Gym pods of a gs:// run "
            "instead of credentialsSecret (never given to Gyms): the Gyms only write their "
            "side-effect records under <uri>/gym-audit/, so give it a key limited to that "
            "prefix (object create, get, list); omit to use workload identity."
        ),
    )
    volume_claim_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description=(
            "PersistentVolumeClaim (ReadWriteMany) mounted at the file:// path in the trainer "
            "and Gym pods, so incarnations share checkpoints; required with file:// storage "
            "(a path no volume holds dies with its pod), omitted with gs://."
        ),
    )


class RecoveryPolicy(_Model):
    """How the operator restarts a run after it loses a member."""

    max_restarts: int = Field(
        10,
        ge=0,
        le=10_000,
        description="Restarts after failures before the run is Failed (preemptions do not count).",
    )
    backoff_seconds: int = Field(
        5, ge=0, le=3600, description="First delay before the next incarnation starts."
    )
    max_backoff_seconds: int = Field(
        300, ge=0, le=86_400, description="Cap of the exponential backoff."
    )
    stable_period_seconds: int = Field(
        600,
        ge=0,
        le=86_400,
        description="An incarnation running this long resets the backoff.",
    )
    node_loss_timeout_seconds: int = Field(
        40,
        ge=1,
        le=3600,
        description="A member on a NotReady node for this long counts as lost.",
    )
    lease_duration_seconds: int = Field(
        15,
        ge=2,
        le=3600,
        description="Trainer lease duration; an unrenewed lease past it means a lost trainer.",
    )
    lease_acquire_timeout_seconds: int = Field(
        900,
        ge=0,
        le=86_400,
        description=(
            "A trainer container running this long without holding its lease counts as lost "
            "(hung at startup); 0 turns the check off."
        ),
    )
    elastic_members: bool = Field(
        True,
        description=(
            "A lost Gym pod is recreated under its index while the incarnation goes on (only "
            "the trainer's loss or its Lease expiring ends one); false: any lost member ends "
            "the incarnation."
        ),
    )
    max_member_failures: int = Field(
        3,
        ge=1,
        le=1000,
        description=(
            "Failures (not preemptions) of one member within an incarnation before the "
            "operator stops replacing it and ends the incarnation (MemberFailuresExhausted)."
        ),
    )


#: The forced snapshot on SIGTERM must publish before the kubelet's SIGKILL.
GRACE_BELOW_TERMINATION = grace_below_termination(
    CheckpointingSettings.model_fields["preemption_grace_seconds"].default,
    PodSettings.model_fields["termination_grace_period_seconds"].default,
)


class RolloutRunSpec(_Model):
    """The desired state of a RolloutRun."""

    model_config = ConfigDict(json_schema_extra=cel_rules(GRACE_BELOW_TERMINATION))

    images: Images = Field(default_factory=Images, description="Member pod images.")
    trainer: TrainerPodSettings = Field(
        default_factory=TrainerPodSettings, description="Trainer pod settings."
    )
    gym: GymPodSettings = Field(
        default_factory=GymPodSettings, description="Gym server pod settings."
    )
    service_account_name: str | None = Field(
        None,
        max_length=253,
        pattern=DNS_SUBDOMAIN_PATTERN,
        description=(
            "ServiceAccount of the member pods; default: one the operator creates with "
            "access to this run's Leases only."
        ),
    )
    storage: StorageSpec = Field(..., description="Checkpoint and snapshot storage.")
    run: RunSettings = Field(
        default_factory=RunSettings,
        description=(
            "The runtime's RunConfig (policy, task, GRPO, rollout, checkpointing) less what "
            "the operator derives: the storage URI (from storage.uri), the Gym replicas (from "
            "gym.replicas) and endpoints, the resume hint."
        ),
    )
    recovery: RecoveryPolicy = Field(
        default_factory=RecoveryPolicy, description="Restart policy after member loss."
    )
    suspend: bool = Field(
        False,
        description="Stop the run with a forced snapshot; set false again to resume from it.",
    )
    network: NetworkSpec = Field(
        default_factory=NetworkSpec,
        description="Ingress to the member pods beyond the run's own (NetworkPolicies).",
    )
    workers: WorkerPodSettings = Field(
        default_factory=WorkerPodSettings,
        description=(
            "Generation-worker pods (Ray worker nodes of the trainer's head; the trainer "
            "image); replicas 0: the workers run in the trainer pod."
        ),
    )

    @model_validator(mode="after")
    def _worker_pods_need_ray(self) -> RolloutRunSpec:
        if self.workers.replicas > 0:
            if self.run.workers.backend is not WorkerBackend.RAY:
                raise ValueError("workers.replicas > 0 needs run.workers.backend 'ray'")
            if self.run.workers.ray_address:
                raise ValueError(
                    "workers.replicas > 0 starts a Ray head in the trainer pod: leave "
                    "run.workers.rayAddress unset (or join that cluster without worker pods)"
                )
        return self

    @model_validator(mode="after")
    def _grace_below_termination(self) -> RolloutRunSpec:
        preemption = self.run.checkpointing.preemption_grace_seconds
        termination = self.trainer.termination_grace_period_seconds
        if preemption >= termination:
            raise ValueError(
                f"{GRACE_BELOW_TERMINATION.message} (preemptionGraceSeconds {preemption}, "
                f"terminationGracePeriodSeconds {termination})"
            )
        return self


class RolloutRun(_Model):
    """A preemption-proof RL post-training run."""

    api_version: str = Field(
        f"{GROUP}/{VERSION}", max_length=64, description="API version.", alias="apiVersion"
    )
    kind: str = Field(KIND, max_length=64, description="Kind.")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Object metadata.")
    spec: RolloutRunSpec = Field(..., description="Desired state.")
    status: RolloutRunStatus | None = Field(None, description="Observed state.")


#: Printer columns for ``kubectl get rr``.
PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "Step",
        "type": "integer",
        "jsonPath": ".status.trainStep",
        "description": "Latest trainer step.",
    },
    {"name": "Reward", "type": "number", "jsonPath": ".status.lastReward"},
    {
        "name": "Restarts",
        "type": "integer",
        "jsonPath": ".status.restarts",
        "description": "Restarts caused by failures.",
    },
    {
        "name": "Snapshot-Age",
        "type": "date",
        "jsonPath": ".status.latestManifestTime",
        "description": "Age of the latest published snapshot.",
    },
    {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
        "description": "Whether all member pods run.",
    },
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].reason',
        "description": "Why the run is (not) ready: Running, StartingGyms, PodDeleted, ...",
    },
    {
        "name": "Incarnation",
        "type": "integer",
        "jsonPath": ".status.incarnation",
        "description": "Current incarnation (one per start or restart).",
        "priority": 1,
    },
    {
        "name": "Preemptions",
        "type": "integer",
        "jsonPath": ".status.preemptions",
        "description": "Restarts caused by preemption or node loss.",
        "priority": 1,
    },
    {
        "name": "Anchor",
        "type": "integer",
        "jsonPath": ".status.anchorStep",
        "description": "Trainer checkpoint step of the latest snapshot.",
        "priority": 1,
    },
    {"name": "Steps/min", "type": "number", "jsonPath": ".status.stepRate", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]
