"""Names, labels, annotations and environment variables of a run's children: the pod contract.

Why one module: the builders write these names, the reconcile reads them back from what it
observes, the handlers select on them, and the runtime (which may not import the operator)
repeats the lease annotation names in ``rolloutrun_runtime.coordination``; a test checks the
two copies agree. Every child name derives from the run name, so a run's children are found
without any state beyond the run itself.
"""

from __future__ import annotations

import enum

from rolloutrun_operator.api.v1alpha1 import GROUP

# ------------------------------------------------------------------------------- labels
LABEL_RUN = f"{GROUP}/run"
"""The owning RolloutRun's name, on every child (pods, Services, Leases, ConfigMap...)."""
LABEL_ROLE = f"{GROUP}/role"
"""``trainer`` or ``gym`` on member pods."""
LABEL_INCARNATION = f"{GROUP}/incarnation"
"""The incarnation a member pod belongs to (decimal)."""
LABEL_GYM_INDEX = f"{GROUP}/gym-index"
"""The Gym replica's index (decimal); its stable instance id is :func:`gym_instance_id`."""
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "rolloutrun-operator"


class Role(enum.StrEnum):
    """What a member pod does."""

    TRAINER = "trainer"
    GYM = "gym"


# -------------------------------------------------------------------- lease annotations
ANNOTATION_TRAIN_STEP = f"{GROUP}/train-step"
ANNOTATION_ANCHOR_STEP = f"{GROUP}/anchor-step"
ANNOTATION_LATEST_MANIFEST = f"{GROUP}/latest-manifest"
ANNOTATION_LATEST_MANIFEST_TIME = f"{GROUP}/latest-manifest-time"
#: Kopf keeps its progress and diff-base in annotations with this prefix (``status.kopf``
#: would be pruned by the structural schema).
KOPF_ANNOTATION_PREFIX = f"kopf.{GROUP}"

# ------------------------------------------------------------------ environment of pods
ENV_INCARNATION = "ROLLOUTRUN_INCARNATION"
ENV_LEASE_NAME = "ROLLOUTRUN_LEASE_NAME"
ENV_LEASE_DURATION = "ROLLOUTRUN_LEASE_DURATION_SECONDS"
ENV_RUN_NAME = "ROLLOUTRUN_RUN"
ENV_GYM_TOKEN = "ROLLOUTRUN_GYM_CONTROL_TOKEN"
"""The Gym control-plane token (the runtime reads it: ``environments.gym.control.TOKEN_ENV``)."""
ENV_GENERATION_PORT = "ROLLOUTRUN_GENERATION_PORT"
ENV_GYM_INSTANCE_ID = "ROLLOUTRUN_GYM_INSTANCE_ID"
ENV_POD_NAME = "POD_NAME"
ENV_POD_NAMESPACE = "POD_NAMESPACE"
ENV_POD_IP = "POD_IP"
ENV_GOOGLE_CREDENTIALS = "GOOGLE_APPLICATION_CREDENTIALS"

# ------------------------------------------------------------------- files in the pods
CONFIG_DIR = "/etc/rolloutrun"
CONFIG_KEY = "run.yaml"
"""ConfigMap key of the trainer's RunConfig (Gym endpoints and ``resumeFrom`` filled in)."""
GYM_CONFIG_KEY = "gym.yaml"
"""ConfigMap key of the Gym's RunConfig (no endpoints: written before the Gym pods exist)."""
CONFIG_PATH = f"{CONFIG_DIR}/{CONFIG_KEY}"
GCS_CREDENTIALS_DIR = "/var/run/secrets/rolloutrun/gcs"
GCS_CREDENTIALS_KEY = "credentials.json"
WORK_DIR = "/var/lib/rolloutrun"
"""Writable working directory (an emptyDir): relative ``logDir`` paths land here."""
GYM_TOKEN_KEY = "token"
ANNOTATION_CONFIG_INCARNATION = f"{GROUP}/incarnation"
"""On the ConfigMap: the incarnation whose trainer config ``run.yaml`` holds."""

MAX_RUN_NAME = 52
"""Longest run name: leaves room for ``-i<N>-gym-<k>`` in pod names that are DNS labels."""


# ------------------------------------------------------------------------ child names
def config_map_name(run: str) -> str:
    return f"{run}-config"


def gym_token_secret_name(run: str) -> str:
    return f"{run}-gym-token"


def lease_name(run: str) -> str:
    return f"{run}-trainer"


def member_account_name(run: str) -> str:
    """ServiceAccount, Role and RoleBinding of the member pods."""
    return f"{run}-member"


def trainer_service_name(run: str) -> str:
    return f"{run}-trainer"


def gym_service_name(run: str) -> str:
    return f"{run}-gym"


def trainer_pod_name(run: str, incarnation: int) -> str:
    return f"{run}-i{incarnation}-trainer"


def gym_pod_name(run: str, incarnation: int, index: int) -> str:
    return f"{run}-i{incarnation}-gym-{index}"


def gym_instance_id(run: str, index: int) -> str:
    """The Gym replica's id: stable across incarnations, so recovery records stay meaningful."""
    return f"{run}-gym-{index}"


def holder_identity(pod: str, incarnation: int) -> str:
    """The trainer lease's holder identity: ``<pod>/<incarnation>``."""
    return f"{pod}/{incarnation}"


def holder_incarnation(identity: str | None) -> int | None:
    """The incarnation in a holder identity, or None when it has none."""
    if not identity or "/" not in identity:
        return None
    tail = identity.rsplit("/", 1)[1]
    return int(tail) if tail.isdigit() else None


def run_selector(run: str) -> str:
    """Label selector of every child of a run."""
    return f"{LABEL_RUN}={run}"
