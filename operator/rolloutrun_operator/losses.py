"""When a member of the current incarnation counts as lost, and whether that is a failure.

Why its own module: this is the question the whole operator exists to answer quickly and
correctly (a preempted pod must not burn ``maxRestarts``; a hung trainer must not wait for
the 300 s pod eviction). Pure like :mod:`reconcile`: it reads the :class:`~plan.Pass` and
asks to look again at the next deadline (node-loss timeout, lease expiry, lease acquire
timeout). The Lease's ``renewTime`` is the trainer's clock: it is watched for change, never
compared with the operator's clock (see :func:`lease_loss`).
"""

from __future__ import annotations

import datetime as dt

from rolloutrun_operator import naming
from rolloutrun_operator.api.v1alpha1 import LeaseObservation
from rolloutrun_operator.observe import LeaseView, PodView, format_time, parse_time
from rolloutrun_operator.plan import Loss, LossKind, Pass
from rolloutrun_runtime.contract.run_config import UNRESTORABLE_EXIT_CODE

#: Seconds past ``leaseDurationSeconds`` of unchanged renewal before the Lease counts as
#: expired: the Lease watch's delivery delay, and ``observedAt`` kept to whole seconds.
LEASE_EXPIRY_MARGIN_SECONDS = 2

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


#: Terminated reasons of a container that never ran its command (``exec`` failed: a command
#: that does not exist, a bad working directory): reported as ``GymStartError`` with the
#: kubelet's message rather than as a bare ``GymFailed`` exit code 128.
START_ERRORS = frozenset({"StartError", "ContainerCannotRun"})


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
        if pod.terminated_reason in START_ERRORS:
            why = (pod.terminated_message or "").strip()[-1024:]
            message = f"{pod.name}: {detail}" + (f": {why}" if why else "")
            return Loss(f"{role}{pod.terminated_reason}", pod.name, LossKind.FAILURE, message)
        return Loss(f"{role}Failed", pod.name, LossKind.FAILURE, failed_message(pod, detail))
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


def failed_message(pod: PodView, detail: str) -> str:
    """``<pod>: exit code N``, then the container's last line when it left one (a trainer's
    exception, e.g. ``RayNodeEndedError: ...``; a launcher's ``mountns: ...``): the run's
    status then says why, not only that, a member failed."""
    last = (pod.terminated_message or "").strip().splitlines()
    return f"{pod.name}: {detail}" + (f": {last[-1].strip()[-1024:]}" if last else "")


def unrestorable(pod: PodView, detail: str) -> Loss:
    """The trainer stopped for a reason a restart cannot change (exit ``UNRESTORABLE_EXIT_CODE``:
    every durable entry refused, a model it cannot load, or a prompt file it cannot read or
    map): restarting would only stop again until ``maxRestarts``. The trainer's last line
    says which (for a prompt file: the file, the row and the field)."""
    message = f"{pod.name}: {detail}: the trainer cannot start or restore the run (a restart"
    message += " would not change that)"
    last = (pod.terminated_message or "").strip().splitlines()
    if last:
        message += f": {last[-1].strip()[-1024:]}"
    return Loss("Unrestorable", pod.name, LossKind.UNRECOVERABLE, message)


def find_loss(
    p: Pass,
    trainer: PodView | None,
    gyms: dict[int | None, PodView],
    launched: bool,
    elastic: bool = False,
) -> Loss | None:
    """The loss that ends the incarnation, if any. ``elastic``: the Gyms of a launched
    incarnation are replaced instead (:mod:`rolloutrun_operator.members`), only the
    trainer's loss (its pod or its Lease) counts here."""
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
    if elastic and launched:
        return None
    for index in range(p.run.spec.gym.pods):
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


def observe_lease(
    previous: LeaseObservation | None, lease: LeaseView, now: dt.datetime
) -> LeaseObservation:
    """The observation after seeing ``lease`` at ``now`` (operator clock): unchanged while the
    holder and ``renewTime`` are the ones seen before, else a new one first seen ``now``.

    ``renewTime`` comes from the trainer's clock: it is only ever compared with the value
    seen before, never with ``now``, so a skew between the two clocks cannot expire it."""
    holder, renewed = (lease.holder or "")[:253], (lease.renew_time or "")[:64]
    same = previous is not None and (previous.holder, previous.renew_time) == (holder, renewed)
    if same and previous is not None and parse_time(previous.observed_at) is not None:
        return previous
    return LeaseObservation(holder=holder, renew_time=renewed, observed_at=format_time(now))


def lease_expiry(observation: LeaseObservation, duration_seconds: int) -> dt.datetime:
    """When (operator clock) a Lease whose renewal has not changed since ``observation``
    counts as expired: ``leaseDurationSeconds`` plus :data:`LEASE_EXPIRY_MARGIN_SECONDS`."""
    seen = parse_time(observation.observed_at)
    assert seen is not None  # observe_lease never keeps an unreadable time
    return seen + dt.timedelta(seconds=duration_seconds + LEASE_EXPIRY_MARGIN_SECONDS)


def lease_loss(p: Pass, trainer: PodView) -> Loss | None:
    """The trainer's lease expired (hung, partitioned), or it never took it after starting.

    Expiry is judged as client-go's leader election judges it: the operator remembers the
    holder and ``renewTime`` it last saw change and when, on its own clock (kept in
    ``status.lease``, so a restarted operator keeps counting), and declares the Lease expired
    when no change was seen for ``leaseDurationSeconds`` (+ a margin)."""
    lease = p.observed.lease
    n = p.status.incarnation
    if lease is not None and lease.holder_incarnation == n:
        observation = observe_lease(p.status.lease, lease, p.now)
        p.status.lease = observation
        if lease.duration_seconds is None:
            return None
        expiry = lease_expiry(observation, lease.duration_seconds)
        if p.now >= expiry:
            message = (
                f"lease {lease.holder} not renewed for {lease.duration_seconds}s: its renewTime "
                f"{observation.renew_time or '(unset)'} unchanged since the operator saw it at "
                f"{observation.observed_at}"
            )
            return Loss("LeaseExpired", trainer.name, LossKind.FAILURE, message)
        p.lease_expiry = expiry
        return None
    p.status.lease = None
    timeout = p.run.spec.recovery.lease_acquire_timeout_seconds
    if timeout and trainer.phase == "Running" and trainer.started is not None:
        deadline = trainer.started + dt.timedelta(seconds=timeout)
        if p.now >= deadline:
            message = f"{trainer.name} running since {format_time(trainer.started)}, no lease"
            return Loss("LeaseNotAcquired", trainer.name, LossKind.FAILURE, message)
        p.look_again_at(deadline)
    return None
