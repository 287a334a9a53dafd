"""When a member of the current incarnation counts as lost, and whether that is a failure.

Why its own module: this is the question the whole operator exists to answer quickly and
correctly (a preempted pod must not burn ``maxRestarts``; a hung trainer must not wait for
the 300 s pod eviction). Pure like :mod:`reconcile`: it reads the :class:`~plan.Pass` and
asks to look again at the next deadline (node-loss timeout, lease acquire timeout).
"""

from __future__ import annotations

import datetime as dt

from rolloutrun_operator import naming
from rolloutrun_operator.observe import PodView, format_time
from rolloutrun_operator.plan import Loss, LossKind, Pass
from rolloutrun_runtime.contract.run_config import UNRESTORABLE_EXIT_CODE

#: Reasons (pod ``status.reason`` or ``DisruptionTarget``) that are preemption, not failure.
PREEMPTION_REASONS = frozenset(
    {
        "Evicted",
        "Preempting",
        "NodeLost",
        "NodeShutdown",
        "Shutdown",
        "Terminated",
        "PreemptionByScheduler",
        "PreemptionByKubeScheduler",
        "EvictionByEvictionAPI",
        "DeletionByTaintManager",
        "DeletionByPodGC",
        "TerminationByKubelet",
    }
)


def serving(pod: PodView) -> bool:
    """Running, and its readiness probe (the Gym port accepts connections) passed."""
    return pod.phase == "Running" and pod.ready and pod.deletion_time is None


def pod_loss(p: Pass, pod: PodView) -> Loss | None:
    role = "Trainer" if pod.role == naming.Role.TRAINER else "Gym"
    preempted = pod.disruption or (
        pod.status_reason if pod.status_reason in PREEMPTION_REASONS else None
    )
    if pod.deletion_time is not None:
        reason = preempted or "PodDeleted"
        return Loss(reason, pod.name, LossKind.PREEMPTION, f"{pod.name} is being deleted")
    if pod.phase == "Failed":
        detail = f"exit code {pod.exit_code}" if pod.exit_code is not None else "failed"
        if pod.terminated_reason:
            detail += f" ({pod.terminated_reason})"
        if preempted:
            return Loss(preempted, pod.name, LossKind.PREEMPTION, f"{pod.name}: {detail}")
        if pod.role == naming.Role.TRAINER and pod.exit_code == UNRESTORABLE_EXIT_CODE:
            return unrestorable(pod, detail)
        return Loss(f"{role}Failed", pod.name, LossKind.FAILURE, f"{pod.name}: {detail}")
    if pod.phase == "Succeeded":
        if preempted:
            return Loss(preempted, pod.name, LossKind.PREEMPTION, f"{pod.name} was stopped")
        return Loss(f"{role}Exited", pod.name, LossKind.FAILURE, f"{pod.name} exited early")
    node = p.observed.nodes.get(pod.node_name or "")
    if node is not None and not node.ready:
        timeout = dt.timedelta(seconds=p.run.spec.recovery.node_loss_timeout_seconds)
        since = node.since or p.now
        if p.now >= since + timeout:
            message = f"node {node.name} NotReady since {format_time(since)}"
            return Loss("NodeLost", pod.name, LossKind.PREEMPTION, message)
        p.look_again_at(since + timeout)
    return None


def unrestorable(pod: PodView, detail: str) -> Loss:
    """The trainer refused every durable entry for a reason a restart cannot change (exit
    ``UNRESTORABLE_EXIT_CODE``): restarting would only refuse again until ``maxRestarts``."""
    message = f"{pod.name}: {detail}: no durable entry of the run can be restored"
    last = (pod.terminated_message or "").strip().splitlines()
    if last:
        message += f": {last[-1].strip()[-1024:]}"
    return Loss("Unrestorable", pod.name, LossKind.UNRECOVERABLE, message)


def find_loss(
    p: Pass, trainer: PodView | None, gyms: dict[int | None, PodView], launched: bool
) -> Loss | None:
    if launched and trainer is None:
        name = naming.trainer_pod_name(p.name, p.status.incarnation)
        return Loss("PodDeleted", name, LossKind.PREEMPTION, f"{name} disappeared")
    if trainer is not None:
        loss = pod_loss(p, trainer)
        if loss is not None:
            return loss
        loss = lease_loss(p, trainer)
        if loss is not None:
            return loss
    for index in range(p.run.spec.gym.replicas):
        pod = gyms.get(index)
        if pod is None:
            if launched:
                name = naming.gym_pod_name(p.name, p.status.incarnation, index)
                return Loss("PodDeleted", name, LossKind.PREEMPTION, f"{name} disappeared")
            continue
        loss = pod_loss(p, pod)
        if loss is not None:
            return loss
    return None


def lease_loss(p: Pass, trainer: PodView) -> Loss | None:
    """The trainer's lease expired (hung, partitioned), or it never took it after starting."""
    lease = p.observed.lease
    n = p.status.incarnation
    if lease is not None and lease.holder_incarnation == n:
        if lease.expired(p.now):
            message = f"lease {lease.holder} not renewed since {lease.renew_time}"
            return Loss("LeaseExpired", trainer.name, LossKind.FAILURE, message)
        return None
    timeout = p.run.spec.recovery.lease_acquire_timeout_seconds
    if timeout and trainer.phase == "Running" and trainer.started is not None:
        deadline = trainer.started + dt.timedelta(seconds=timeout)
        if p.now >= deadline:
            message = f"{trainer.name} running since {format_time(trainer.started)}, no lease"
            return Loss("LeaseNotAcquired", trainer.name, LossKind.FAILURE, message)
        p.look_again_at(deadline)
    return None
