"""Names of a run's children, and the pod contract the operator writes onto them.

Why one module: the builders write these names, the reconcile reads them back from what it
observes, and the handlers select on them. Every child name derives from the run name, so a
run's children are found without any state beyond the run itself. The pod contract (labels,
Lease annotations, environment variables, paths, ports, the Lease's name and holder
identity) is shared with the runtime and spelled in ``rolloutrun_runtime.contract.pod``;
it is re-exported here so the operator's code reads every name from one place.
"""

from __future__ import annotations

from rolloutrun_operator.api.v1alpha1 import GROUP
from rolloutrun_runtime.contract.pod import (
    ANNOTATION_ANCHOR_STEP,
    ANNOTATION_LATEST_MANIFEST,
    ANNOTATION_LATEST_MANIFEST_TIME,
    ANNOTATION_MEMBER_ENDPOINTS_PREFIX,
    ANNOTATION_REWARD,
    ANNOTATION_TRAIN_STEP,
    CONFIG_DIR,
    CONFIG_KEY,
    CONFIG_PATH,
    ENV_GENERATION_PORT,
    ENV_GOOGLE_CREDENTIALS,
    ENV_GYM_INSTANCE_ID,
    ENV_GYM_TOKEN,
    ENV_INCARNATION,
    ENV_LEASE_DURATION,
    ENV_LEASE_NAME,
    ENV_POD_IP,
    ENV_POD_NAME,
    ENV_POD_NAMESPACE,
    ENV_RUN_NAME,
    GCS_CREDENTIALS_DIR,
    GCS_CREDENTIALS_KEY,
    GYM_CONFIG_KEY,
    GYM_TOKEN_KEY,
    LABEL_GYM_INDEX,
    LABEL_INCARNATION,
    LABEL_MANAGED_BY,
    LABEL_MEMBER_GENERATION,
    LABEL_ROLE,
    LABEL_RUN,
    MANAGED_BY,
    PORT_NAME_GENERATION,
    PORT_NAME_GYM,
    WORK_DIR,
    MemberEndpoint,
    Role,
    format_member_endpoints,
    gym_instance_id,
    gym_pod_name,
    holder_identity,
    holder_incarnation,
    lease_name,
    member_endpoints_annotation,
    parse_member_endpoints,
    trainer_pod_name,
)

__all__ = [
    "ANNOTATION_ALLOW_RUNS",
    "ANNOTATION_ANCHOR_STEP",
    "ANNOTATION_CONFIG_INCARNATION",
    "ANNOTATION_LATEST_MANIFEST",
    "ANNOTATION_LATEST_MANIFEST_TIME",
    "ANNOTATION_MEMBER_ENDPOINTS_PREFIX",
    "ANNOTATION_REWARD",
    "ANNOTATION_TRAIN_STEP",
    "CONFIG_DIR",
    "CONFIG_KEY",
    "CONFIG_PATH",
    "ENV_GENERATION_PORT",
    "ENV_GOOGLE_CREDENTIALS",
    "ENV_GYM_INSTANCE_ID",
    "ENV_GYM_TOKEN",
    "ENV_INCARNATION",
    "ENV_LEASE_DURATION",
    "ENV_LEASE_NAME",
    "ENV_POD_IP",
    "ENV_POD_NAME",
    "ENV_POD_NAMESPACE",
    "ENV_RUN_NAME",
    "GCS_CREDENTIALS_DIR",
    "GCS_CREDENTIALS_KEY",
    "GYM_CONFIG_KEY",
    "GYM_TOKEN_KEY",
    "KOPF_ANNOTATION_PREFIX",
    "LABEL_GYM_INDEX",
    "LABEL_INCARNATION",
    "LABEL_MANAGED_BY",
    "LABEL_MEMBER_GENERATION",
    "LABEL_ROLE",
    "LABEL_RUN",
    "MANAGED_BY",
    "PORT_NAME_GENERATION",
    "PORT_NAME_GYM",
    "WORK_DIR",
    "MemberEndpoint",
    "Role",
    "config_map_name",
    "format_member_endpoints",
    "gym_instance_id",
    "gym_pod_name",
    "gym_service_name",
    "gym_token_secret_name",
    "holder_identity",
    "holder_incarnation",
    "lease_name",
    "member_account_name",
    "member_endpoints_annotation",
    "metrics_token_secret_name",
    "parse_member_endpoints",
    "run_selector",
    "trainer_pod_name",
    "trainer_service_name",
]

#: Kopf keeps its progress and diff-base in annotations with this prefix (``status.kopf``
#: would be pruned by the structural schema).
KOPF_ANNOTATION_PREFIX = f"kopf.{GROUP}"
ANNOTATION_CONFIG_INCARNATION = f"{GROUP}/incarnation"
"""On the ConfigMap: the incarnation whose trainer config ``run.yaml`` holds."""
ANNOTATION_ALLOW_RUNS = f"{GROUP}/allow-runs"
"""On a ServiceAccount: which runs may name it in ``spec.serviceAccountName`` (``"true"``
or ``"*"``: every run of its namespace; else a comma-separated list of run names)."""


# ------------------------------------------------------------------------ child names
def config_map_name(run: str) -> str:
    return f"{run}-config"


def gym_token_secret_name(run: str) -> str:
    return f"{run}-gym-token"


def metrics_token_secret_name(run: str) -> str:
    """The run's metrics token (only ``/metrics``): a PodMonitor's ``bearerTokenSecret``."""
    return f"{run}-metrics-token"


def member_account_name(run: str) -> str:
    """ServiceAccount, Role and RoleBinding of the member pods."""
    return f"{run}-member"


def trainer_service_name(run: str) -> str:
    return f"{run}-trainer"


def gym_service_name(run: str) -> str:
    return f"{run}-gym"


def gym_network_policy_name(run: str) -> str:
    return f"{run}-gym-ingress"


def generation_network_policy_name(run: str) -> str:
    return f"{run}-generation-ingress"


def worker_network_policy_name(run: str) -> str:
    return f"{run}-worker-ingress"


def run_selector(run: str) -> str:
    """Label selector of every child of a run."""
    return f"{LABEL_RUN}={run}"
