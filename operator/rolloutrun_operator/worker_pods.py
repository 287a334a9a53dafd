"""Generation-worker pods: Ray worker nodes that join the head the trainer starts on its pod
address, and the pure decisions that keep them there.

Why its own module: the workers are a third kind of member (``spec.workers.replicas``),
created once the trainer pod has an address (the head's GCS is ``<trainer IP>:<RAY_GCS_PORT>``
and no DNS is assumed), recreated under their index with the next member generation when
lost (:func:`members.replace_members`, as a Gym), and gone with the incarnation when the
trainer is lost (the next trainer is a new head: its workers are new pods). The pods run the
trainer's image (one Ray and Python version in the cluster) as
``python -m rolloutrun_runtime.workers.ray_node``, which waits for the head and joins it
offering generation slots; ``/dev/shm`` is an in-memory emptyDir sized, as KubeRay sizes
it, by the container's memory limit (Ray's object store lives there; a container's default
is 64 MiB).
"""

from __future__ import annotations

from rolloutrun_operator import builders, naming
from rolloutrun_operator.api.v1alpha1 import RolloutRun
from rolloutrun_operator.losses import pod_loss
from rolloutrun_operator.members import member_state, replace_members, seen_member
from rolloutrun_operator.observe import PodView
from rolloutrun_operator.plan import Loss, Pass
from rolloutrun_runtime.contract.pod import (
    LABEL_WORKER_INDEX,
    RAY_GCS_PORT,
    Role,
    generation_slots,
    worker_pod_name,
)

Manifest = builders.Manifest
SHM_VOLUME = "shm"
SHM_PATH = "/dev/shm"
#: The worker node's entry point (:mod:`rolloutrun_runtime.workers.ray_node`).
WORKER_COMMAND = ["python", "-m", "rolloutrun_runtime.workers.ray_node"]


def head_address(trainer_ip: str) -> str:
    host = f"[{trainer_ip}]" if ":" in trainer_ip else trainer_ip
    return f"{host}:{RAY_GCS_PORT}"


def shm_volume(run: RolloutRun) -> Manifest:
    """``/dev/shm`` in memory, limited to the worker container's memory limit (KubeRay's
    convention); unlimited (the node's) when the container has none."""
    empty_dir: Manifest = {"medium": "Memory"}
    limit = run.spec.workers.resources.limits.get("memory")
    if limit:
        empty_dir["sizeLimit"] = limit
    return {"name": SHM_VOLUME, "emptyDir": empty_dir}


def worker_pod(
    run: RolloutRun, incarnation: int, index: int, generation: int, trainer_ip: str
) -> Manifest:
    """Worker ``index`` of ``incarnation`` (member ``generation``), joining the head at
    ``trainer_ip``."""
    settings = run.spec.workers
    name = builders.run_name(run)
    slots = generation_slots(run.spec.run.workers.generation_workers, settings.replicas)
    container: Manifest = {
        "name": "worker",
        "image": run.spec.images.trainer,
        "imagePullPolicy": run.spec.images.pull_policy,
        "command": [
            *WORKER_COMMAND,
            f"--address={head_address(trainer_ip)}",
            f"--slots={slots}",
        ],
        "workingDir": naming.WORK_DIR,
        "env": [
            {"name": naming.ENV_RUN_NAME, "value": name},
            {"name": naming.ENV_INCARNATION, "value": str(incarnation)},
            builders._field_env(naming.ENV_POD_NAME, "metadata.name"),
            builders._field_env(naming.ENV_POD_IP, "status.podIP"),
            # only to derive the cluster's Ray token (ray_node removes it before Ray starts)
            builders._common_env(run, incarnation)[-1],
            *(v.model_dump(mode="json", by_alias=True, exclude_none=True) for v in settings.env),
        ],
        "resources": builders._resources(settings),
        "volumeMounts": [
            {"name": "work", "mountPath": naming.WORK_DIR},
            {"name": "tmp", "mountPath": "/tmp"},  # Ray's session files
            {"name": SHM_VOLUME, "mountPath": SHM_PATH},
        ],
        "securityContext": builders.CONTAINER_SECURITY,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    spec: Manifest = {
        "restartPolicy": "Never",
        "serviceAccountName": builders.member_account(run),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": settings.termination_grace_period_seconds,
        "securityContext": builders.POD_SECURITY,
        "containers": [container],
        "volumes": [
            {"name": "work", "emptyDir": {}},
            {"name": "tmp", "emptyDir": {}},
            shm_volume(run),
        ],
    }
    if settings.node_selector:
        spec["nodeSelector"] = dict(settings.node_selector)
    if settings.tolerations:
        spec["tolerations"] = [
            t.model_dump(mode="json", by_alias=True, exclude_none=True)
            for t in settings.tolerations
        ]
    labels = {
        naming.LABEL_ROLE: str(Role.WORKER),
        naming.LABEL_INCARNATION: str(incarnation),
        LABEL_WORKER_INDEX: str(index),
        naming.LABEL_MEMBER_GENERATION: str(generation),
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": builders.metadata(run, worker_pod_name(name, incarnation, index), **labels),
        "spec": spec,
    }
    return builders.shape(pod, settings, "spec.workers")


def keep_workers(p: Pass, members: list[PodView], trainer: PodView | None) -> Loss | None:
    """The worker pods of the running incarnation: none before the trainer has an address;
    then each index's first pod (generation 0), and a lost one (failed, evicted, being
    deleted) replaced under its index with the next generation and counted
    (:func:`members.replace_members`). Returns the loss that ends the incarnation when a
    worker failed too often. Standby pods (``spec.workers.standby``) are more of the same
    pods under the next indices: which of them serve and which wait is the trainer's (its
    Ray actors), so a lost one is replaced alike and counted alike."""
    settings = p.run.spec.workers
    replicas = settings.replicas + settings.standby
    if settings.replicas == 0 or trainer is None or not trainer.pod_ip or trainer.terminated:
        return None
    n = p.status.incarnation
    trainer_ip = trainer.pod_ip
    workers = {pod.worker_index: pod for pod in members if pod.role == Role.WORKER}
    first = [
        i for i in range(replicas) if i not in workers and member_state(p, Role.WORKER, i) is None
    ]
    for index in first:  # never created (never seen): generation 0, not a replacement
        p.create(worker_pod(p.run, n, index, 0, trainer_ip))
    if not p.run.spec.recovery.elastic_members:  # any lost member ends the incarnation
        lost = (pod_loss(p, pod) for pod in workers.values() if pod is not None)
        return next((loss for loss in lost if loss is not None), None)

    for seen in workers:  # created after the trainer: one may vanish before a pass sees it go
        if seen is not None and seen < replicas:
            seen_member(p, Role.WORKER, seen)

    def build(index: int, generation: int) -> Manifest:
        return worker_pod(p.run, n, index, generation, trainer_ip)

    known = [i for i in range(replicas) if i not in first]
    return replace_members(p, Role.WORKER, replicas, workers, build, indices=known)
