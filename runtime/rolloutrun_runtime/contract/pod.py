"""The pod contract: what the operator puts on a member pod and the runtime reads back.

Why one module: the operator's builders write these names (environment variables, mount
paths, ports, the Lease and its annotations) and the trainer and the Gym read them in their
pods; the operator's reconcile reads the Lease annotations the trainer writes. Both sides
used to spell them (the operator's ``naming``, the runtime's ``coordination`` and ``pod``),
kept equal by a test that left parts out. Now each name is spelled here once, and both
sides import it (``rolloutrun_operator.naming`` re-exports what the operator's code uses).

Names only the operator reads (its child objects' names, the ConfigMap's annotation, Kopf's
annotation prefix) stay in ``rolloutrun_operator.naming``.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass

#: The API group of the RolloutRun CRD; labels and annotations are prefixed with it.
API_GROUP = "rolloutrun.dev"

# ------------------------------------------------------------------------------- labels
LABEL_RUN = f"{API_GROUP}/run"
"""The owning RolloutRun's name, on every child (pods, Services, Leases, ConfigMap...)."""
LABEL_ROLE = f"{API_GROUP}/role"
"""``trainer`` or ``gym`` on member pods."""
LABEL_INCARNATION = f"{API_GROUP}/incarnation"
"""The incarnation a member pod belongs to (decimal)."""
LABEL_GYM_INDEX = f"{API_GROUP}/gym-index"
"""The Gym replica's index (decimal); its stable instance id is :func:`gym_instance_id`."""
LABEL_WORKER_INDEX = f"{API_GROUP}/worker-index"
"""A generation-worker pod's index (decimal), kept when the pod is replaced."""
LABEL_MEMBER_GENERATION = f"{API_GROUP}/member-generation"
"""Which replacement of its member (role and index) a pod is within its incarnation
(decimal; 0 for the pod the incarnation started with): the operator recreates a lost Gym
under the same index with the next generation, and the trainer re-admits it by it."""
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "rolloutrun-operator"


class Role(enum.StrEnum):
    """What a member pod does."""

    TRAINER = "trainer"
    GYM = "gym"
    WORKER = "worker"


# -------------------------------------------------------------------- lease annotations
#: Written by the trainer on its Lease, read by the operator into the RolloutRun's status.
ANNOTATION_TRAIN_STEP = f"{API_GROUP}/train-step"
ANNOTATION_ANCHOR_STEP = f"{API_GROUP}/anchor-step"
ANNOTATION_LATEST_MANIFEST = f"{API_GROUP}/latest-manifest"
ANNOTATION_LATEST_MANIFEST_TIME = f"{API_GROUP}/latest-manifest-time"
ANNOTATION_REWARD = f"{API_GROUP}/reward"
"""The mean reward of the trainer's last step (decimal), written with its train step."""
ANNOTATION_MEMBER_ENDPOINTS_PREFIX = f"{API_GROUP}/endpoints-"
"""Written by the operator on the Lease, read by the trainer at each renewal: per role
(``<prefix><role>``, :func:`member_endpoints_annotation`), the serving address and member
generation of each index (:func:`format_member_endpoints`). How a trainer learns the
address of a replaced member without restarting (pod IPs change; no DNS is assumed)."""
LEASE_ANNOTATIONS = (
    ANNOTATION_TRAIN_STEP,
    ANNOTATION_ANCHOR_STEP,
    ANNOTATION_LATEST_MANIFEST,
    ANNOTATION_LATEST_MANIFEST_TIME,
    ANNOTATION_REWARD,
)

# ------------------------------------------------------------------ environment of pods
ENV_INCARNATION = "ROLLOUTRUN_INCARNATION"
ENV_LEASE_NAME = "ROLLOUTRUN_LEASE_NAME"
ENV_LEASE_DURATION = "ROLLOUTRUN_LEASE_DURATION_SECONDS"
ENV_RUN_NAME = "ROLLOUTRUN_RUN"
ENV_GYM_TOKEN = "ROLLOUTRUN_GYM_CONTROL_TOKEN"
"""The Gym control-plane bearer token (from the run's Secret, in trainer and Gym pods)."""
ENV_GENERATION_PORT = "ROLLOUTRUN_GENERATION_PORT"
ENV_GYM_INSTANCE_ID = "ROLLOUTRUN_GYM_INSTANCE_ID"
ENV_GYM_PORT = "ROLLOUTRUN_GYM_PORT"
"""The port a Gym pod's server listens on (``spec.gym.port``), on ``$POD_IP``: what a
user's environment server (``spec.gym.command``) binds (docs/environment-contract.md)."""
ENV_METRICS_PORT = "ROLLOUTRUN_METRICS_PORT"
"""The trainer's Prometheus ``/metrics`` port (unset: no metrics server)."""
ENV_METRICS_TOKEN = "ROLLOUTRUN_METRICS_TOKEN"
"""The bearer token the trainer's ``/metrics`` requires (from the run's metrics Secret, in
the trainer pod only): it opens ``/metrics`` and nothing else, so a scraper holding it
cannot drive the Gyms or the generation API, and a data-plane token does not open it."""
ENV_POD_NAME = "POD_NAME"
ENV_POD_NAMESPACE = "POD_NAMESPACE"
ENV_POD_IP = "POD_IP"
ENV_GOOGLE_CREDENTIALS = "GOOGLE_APPLICATION_CREDENTIALS"
ENV_LOCALCLUSTER_ROOT = "ROLLOUTRUN_LOCALCLUSTER_ROOT"
"""Set by the local cluster's kubelet: the pod's root, where its volumes are linked."""
RESERVED_ENV = frozenset(
    {
        ENV_INCARNATION,
        ENV_LEASE_NAME,
        ENV_LEASE_DURATION,
        ENV_RUN_NAME,
        ENV_GYM_TOKEN,
        ENV_GENERATION_PORT,
        ENV_GYM_INSTANCE_ID,
        ENV_GYM_PORT,
        ENV_METRICS_PORT,
        ENV_METRICS_TOKEN,
        ENV_POD_NAME,
        ENV_POD_NAMESPACE,
        ENV_POD_IP,
        ENV_GOOGLE_CREDENTIALS,
        ENV_LOCALCLUSTER_ROOT,
    }
)
"""Every variable above: set by the operator (or the kubelet) on member pods, so a user's
``env`` entry may not name one (a later entry wins in Kubernetes, and an overridden
incarnation, pod name or Lease name breaks fencing). A new ``ENV_*`` name joins this set."""

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
"""Key of the Gym token in the run's Secret (exposed as :data:`ENV_GYM_TOKEN`)."""
METRICS_TOKEN_KEY = "token"
"""Key of the metrics token in the run's metrics Secret (exposed as
:data:`ENV_METRICS_TOKEN`; a PodMonitor's ``bearerTokenSecret`` names this key)."""

# ------------------------------------------------------------------------------- ports
#: Container port names (Services and probes refer to them).
PORT_NAME_GENERATION = "generation"
PORT_NAME_GYM = "gym"
PORT_NAME_METRICS = "metrics"
#: Defaults of ``spec.gym.port`` and ``spec.trainer.generationPort``.
DEFAULT_GYM_PORT = 8000
DEFAULT_GENERATION_PORT = 8100
#: The trainer container's Prometheus ``/metrics`` port (its own network namespace).
TRAINER_METRICS_PORT = 9464

# -------------------------------------------------------------------------------- Ray
#: The GCS port of the Ray head the trainer starts on its pod address when the run has
#: worker pods (``spec.workers.replicas``); KubeRay's default head port, so a GCS address
#: reads the same in both worlds.
RAY_GCS_PORT = 6379
#: The custom Ray resource a worker node offers and each generation actor asks one unit
#: of: what places the actors on worker nodes and never on the trainer's (head) node.
RAY_GENERATION_RESOURCE = f"{API_GROUP}/generation"


def generation_slots(generation_workers: int, worker_nodes: int) -> int:
    """Units of :data:`RAY_GENERATION_RESOURCE` each worker node offers: enough that the
    ``generation_workers`` actors fit on ``worker_nodes`` nodes, spread evenly."""
    if worker_nodes < 1 or generation_workers < 1:
        raise ValueError("generation_slots needs at least one worker node and one worker")
    return -(-generation_workers // worker_nodes)


def ray_auth_token(run_token: str) -> str:
    """The token of a run's Ray cluster (``RAY_AUTH_MODE=token``), derived from the run's
    data-plane token: the head and every worker pod derive the same one, and a process
    holding it (any Ray process) can neither call the Gym control plane nor the generation
    API with it."""
    return hashlib.sha256(f"rolloutrun-ray:{run_token}".encode()).hexdigest()


def ray_worker_node_argv(
    head_address: str,
    node_ip: str,
    slots: int,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
) -> list[str]:
    """``ray start`` arguments (after ``ray``) of a worker node joining ``head_address``
    (``host:port``) as ``node_ip``, offering ``slots`` generation slots; blocks until the
    node ends. Spelled once: the operator's worker pods and the runtime's entry point
    (``python -m rolloutrun_runtime.workers.ray_node``) both run it."""
    argv = [
        "start",
        f"--address={head_address}",
        f"--node-ip-address={node_ip}",
        f"--resources={json.dumps({RAY_GENERATION_RESOURCE: slots})}",
        "--disable-usage-stats",
        "--block",
        # no log monitor: the trainer's driver takes no worker logs (log_to_driver=False),
        # so it would only cost each new worker pod a Python process and its polling
        "--include-log-monitor=false",
    ]
    if num_cpus is not None:
        argv.append(f"--num-cpus={num_cpus}")
    if num_gpus is not None:  # default: the GPUs Ray detects on the node
        argv.append(f"--num-gpus={num_gpus}")
    return argv


# ------------------------------------------------------------------------------ Lease
#: Seconds a trainer's Lease stays valid without renewal when the pod does not say.
DEFAULT_LEASE_DURATION_S = 15


def lease_duration_from(environ: Mapping[str, str]) -> int:
    """The trainer's Lease duration as its pod environment says (``ENV_LEASE_DURATION``)."""
    return int(environ.get(ENV_LEASE_DURATION) or DEFAULT_LEASE_DURATION_S)


def lease_name(run: str) -> str:
    """The run's trainer Lease: one per run, held by one trainer at a time."""
    return f"{run}-trainer"


def holder_identity(pod: str, incarnation: int) -> str:
    """The trainer lease's holder identity: ``<pod>/<incarnation>``."""
    return f"{pod}/{incarnation}"


def holder_incarnation(identity: str | None) -> int | None:
    """The incarnation in a holder identity, or None when it has none."""
    if not identity or "/" not in identity:
        return None
    tail = identity.rsplit("/", 1)[1]
    return int(tail) if tail.isdigit() else None


@dataclass(frozen=True)
class MemberEndpoint:
    """Where member ``index`` of a role serves, and which generation of it serves there."""

    index: int
    url: str
    generation: int


def member_endpoints_annotation(role: str) -> str:
    """The Lease annotation holding the endpoints of ``role``'s members."""
    return f"{ANNOTATION_MEMBER_ENDPOINTS_PREFIX}{role}"


def format_member_endpoints(incarnation: int, endpoints: list[MemberEndpoint]) -> str:
    """``{"incarnation": n, "members": [[index, url, generation], ...]}`` as compact JSON,
    sorted by index: the incarnation, so a later trainer never takes an earlier one's."""
    rows = [[e.index, e.url, e.generation] for e in sorted(endpoints, key=lambda e: e.index)]
    return json.dumps({"incarnation": incarnation, "members": rows}, separators=(",", ":"))


def parse_member_endpoints(text: str | None, incarnation: int) -> dict[int, MemberEndpoint]:
    """The endpoints by index written for ``incarnation``; an absent or garbled annotation
    (or row), or one of another incarnation, reads as none: the trainer then keeps the
    addresses it has."""
    try:
        document = json.loads(text or "{}")
    except ValueError:
        return {}
    if not isinstance(document, dict) or document.get("incarnation") != incarnation:
        return {}
    rows = document.get("members")
    found: dict[int, MemberEndpoint] = {}
    for row in rows if isinstance(rows, list) else []:
        if (
            isinstance(row, list)
            and len(row) == 3
            and all(type(v) is int and v >= 0 for v in (row[0], row[2]))
            and isinstance(row[1], str)
            and row[1].startswith(("http://", "https://"))
        ):
            found[row[0]] = MemberEndpoint(row[0], row[1], row[2])
    return found


# ------------------------------------------------------------------------- pod names
def trainer_pod_name(run: str, incarnation: int) -> str:
    return f"{run}-i{incarnation}-trainer"


def gym_pod_name(run: str, incarnation: int, index: int) -> str:
    return f"{run}-i{incarnation}-gym-{index}"


def worker_pod_name(run: str, incarnation: int, index: int) -> str:
    return f"{run}-i{incarnation}-worker-{index}"


def gym_instance_id(run: str, index: int) -> str:
    """The Gym replica's id: stable across incarnations, so recovery records stay meaningful."""
    return f"{run}-gym-{index}"
