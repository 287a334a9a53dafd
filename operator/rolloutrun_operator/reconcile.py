"""The operator's decisions: ``reconcile(run, observed, now) -> Result``.

Pure on purpose: given the RolloutRun (spec and last status), what exists of its children
(:class:`~rolloutrun_operator.observe.Observed`) and the time, it returns the actions to take,
the complete new status (written once per pass), the Events to emit after the write, and when
to look again. Tests drive it as tables; the Kopf handlers only fetch, apply and write.

The life of a run, as the conditions tell it:

- **starting** incarnation N (once the Gym pods of earlier incarnations are gone): static
  children (token Secret, RBAC, Lease, Services, the ConfigMap), then the Gym pods; once every
  Gym pod is Ready and every earlier pod is gone (the old trainer's forced snapshot is
  published by then) the trainer's config is rendered with their endpoints and the manifest
  to resume from, and the trainer pod starts.
- **running**: any member lost (see :mod:`losses`: deleted, failed, evicted, preempted, on a
  node NotReady past ``nodeLossTimeoutSeconds``, the trainer's Lease expired or never taken)
  ends the incarnation and ``Restarting`` turns True. Its pods stop trainer first: the trainer
  gets SIGTERM (its own grace period) and publishes its forced snapshot while the Gyms still
  alive keep their episodes; those Gym pods are deleted in the pass that sees the trainer
  exited (its pod event wakes the run); a trainer lost by its Lease (hung) cannot snapshot,
  so then every pod goes at once, the trainer's with a grace period of 1 s. A pod still
  terminating ``STUCK_TERMINATING_SECONDS`` after its grace period is force-deleted and
  named in an Event and in ``Progressing``.
- a preemption starts the next incarnation as soon as the old pods are gone; a failure waits
  an exponential backoff (over failures in a row, reset after ``stablePeriodSeconds`` of
  stable running). The next incarnation number is taken then, never to be reused whatever
  delays its start. Preemptions do not count against ``maxRestarts``; failures do, and past
  it the run is ``Failed``.
- the trainer exiting ``UNRESTORABLE_EXIT_CODE`` (no durable entry can ever be restored)
  ends the run ``Failed`` (``Unrestorable``) at once: a restart would refuse the same way.
- the trainer exiting 0 means ``maxSteps`` were trained: ``Succeeded``, Gym pods removed.
- ``suspend``: pods stopped the same way (the trainer first: its forced snapshot),
  ``Suspended``; unsuspending starts the next incarnation from the latest manifest.
- Kueue (a run labelled ``kueue.x-k8s.io/queue-name``, :mod:`kueue`): held the same way as
  suspended until its Workload is admitted, and again once Kueue evicts it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from rolloutrun_operator import builders, conditions, kueue, naming, network_policies
from rolloutrun_operator.api.v1alpha1 import FailureRecord, RolloutRun, RolloutRunStatus
from rolloutrun_operator.conditions import ConditionType as C
from rolloutrun_operator.conditions import Desired, ended, find, is_true, merge, stopped
from rolloutrun_operator.losses import find_loss, serving
from rolloutrun_operator.members import endpoints_action, replace_members, replacing
from rolloutrun_operator.observe import Observed, PodView, format_time, parse_time
from rolloutrun_operator.ownership import (
    CHILD_CONFLICT,
    account_problem,
    conflict_message,
    conflicts,
)
from rolloutrun_operator.plan import (
    STUCK_TERMINATING_SECONDS,
    Action,
    Event,
    Loss,
    LossKind,
    Pass,
    Verb,
    restart_delay,
)
from rolloutrun_operator.problems import Problem, first_pod_problem, spec_problems
from rolloutrun_operator.progress import step_rate
from rolloutrun_operator.worker_pods import keep_workers

#: How long a healthy run waits before looking again without any event: a resync (events of
#: the run, its pods and its Lease's holder wake it sooner; the Lease's expiry is timed
#: apart, see ``Result.lease_expiry``).
IDLE_REQUEUE_SECONDS = 1200.0
#: Losses that say the trainer cannot snapshot (hung, partitioned from the API, stuck at
#: startup): its Gym pods are not kept for it.
TRAINER_UNRESPONSIVE = frozenset({"LeaseExpired", "LeaseNotAcquired"})
#: The grace period (seconds) such a trainer's pod is deleted with. It can publish nothing
#: more: its Lease fences every commit, and by the trainer's own clock it expired no later
#: than by ours, so its own grace period (the spec's, up to minutes; SIGTERM does not even
#: reach a hung process) only held the next incarnation, which starts once the old pods are
#: gone. 1, not 0: the kubelet still confirms the kill before the pod is gone (0 removes
#: the API object at once, which is for a node that is lost).
UNRESPONSIVE_TRAINER_GRACE_SECONDS = 1


@dataclass
class Result:
    """What one pass decided."""

    actions: list[Action]
    status: RolloutRunStatus
    events: list[Event]
    requeue_after: float | None
    lease_expiry: dt.datetime | None = None
    """When the Lease expires unless renewed; already counted in ``requeue_after``."""
    other_requeue_after: float | None = None
    """``requeue_after`` without the Lease's expiry."""


def reconcile(run: RolloutRun, observed: Observed, now: dt.datetime) -> Result:
    """Decide the actions, the new status and the Events for one pass over ``run``."""
    status = (run.status or RolloutRunStatus()).model_copy(deep=True)
    p = Pass(run, observed, now, status)
    generation = run.metadata.get("generation")
    if late := conditions.change_after_end(
        status.conditions, status.observed_generation, generation
    ):
        p.events.append(Event("Warning", "SpecChangeIgnored", late))
    _mirror_lease(p)
    _decide(p)
    progressing = p.desired.get(C.PROGRESSING)
    step_rate(status, bool(progressing and progressing.status and observed.lease), now)
    _report_forced(p)
    status.observed_generation = generation
    status.conditions = merge(status.conditions, p.desired, now, generation)
    requeue = p.requeue
    if p.lease_expiry is not None:
        until = max((p.lease_expiry - now).total_seconds(), 0.0)
        requeue = until if requeue is None else min(requeue, until)
    return Result(p.actions, status, p.events, requeue, p.lease_expiry, p.requeue)


def _mirror_lease(p: Pass) -> None:
    lease = p.observed.lease
    if lease is None:
        return
    if lease.train_step is not None:
        p.status.train_step = lease.train_step
    if lease.anchor_step is not None:
        p.status.anchor_step = lease.anchor_step
    if lease.latest_manifest:
        p.status.latest_manifest_uri = lease.latest_manifest
        p.status.latest_manifest_time = lease.latest_manifest_time
    if lease.reward is not None:
        p.status.last_reward = lease.reward


def _decide(p: Pass) -> None:
    conditions = p.status.conditions
    gate = _kueue_gate(p)
    if is_true(conditions, C.SUCCEEDED):
        p.delete_pods([pod for pod in p.observed.pods if pod.role == naming.Role.GYM])
        return
    if is_true(conditions, C.FAILED):
        _stop(p, list(p.observed.pods))
        return
    p.say(succeeded=Desired(False, "Running"), failed=Desired(False, "Running"))
    if p.run.spec.suspend:
        _suspend(p)
        return
    if gate is not None and gate.hold:
        _suspend(p, gate.reason, gate.message)  # Workload events wake the run (handlers)
        return
    resuming = is_true(conditions, C.SUSPENDED)
    p.say(suspended=Desired(False, "Resumed" if resuming else "NotSuspended"))
    if resuming or p.status.incarnation == 0:
        after = "Admitted" if gate is not None else "Resumed" if resuming else "Created"
        _start_next(p, after=after)  # why it starts: the IncarnationStarting Event says it
        return
    if is_true(conditions, C.RESTARTING):
        _wait_for_backoff(p)
        return
    _run_incarnation(p)


def _kueue_gate(p: Pass) -> kueue.Gate | None:
    """Kueue's say (:func:`kueue.gate`), its Workload actions queued first."""
    workload = kueue.workload_view(p.observed.workload, str(p.run.metadata.get("uid") or ""))
    finished = None
    for kind in (C.SUCCEEDED, C.FAILED):
        done = find(p.status.conditions, kind)
        if done is not None and is_true(p.status.conditions, kind):
            finished = (done.reason or str(kind), done.message or str(kind))
    n = p.status.incarnation
    members = p.observed.members(n)
    ready = len(members) == p.run.spec.gym.pods + 1 and all(
        pod.phase == "Running" for pod in members
    )
    pods_left = bool(p.observed.pods)
    gate = kueue.gate(p.run, workload, p.observed.flavors, pods_left, ready, finished, p.now)
    if gate is not None:
        p.actions.extend(gate.actions)
        p.placements = dict(gate.placements)
    return gate


def _suspend(p: Pass, reason: str = "Suspended", why: str = "spec.suspend is true") -> None:
    """Stop the members trainer first (its forced snapshot): ``spec.suspend``, or Kueue
    holding the run (``reason`` then says which: queued or evicted)."""
    remaining = _stop(p, list(p.observed.pods))
    state = "Suspending" if remaining else "Suspended"
    before = find(p.status.conditions, C.SUSPENDED)
    if not remaining and (before is None or before.reason != "Suspended"):
        if reason == "Suspended":
            message = "member pods stopped; resume from manifest"
        elif p.status.incarnation == 0:
            message = why  # queued before it ever ran: nothing was stopped
        else:
            message = f"member pods stopped ({why}); resume from manifest"
        p.events.append(Event("Normal", reason, message))
    p.status.incarnation_start_time = None
    p.status.next_start_time = None
    message = "" if reason == "Suspended" else why
    p.say(suspended=Desired(True, state, why), **stopped(reason, message))
    p.say(succeeded=Desired(False, reason), failed=Desired(False, reason))  # not "Running"


def _wait_for_backoff(p: Pass) -> None:
    _stop(p, list(p.observed.pods))
    # The next incarnation is numbered once the old Gym pods are gone (they go once the old
    # trainer exited, _stop); a trainer that lingers without its Gyms (force-deleted Gyms
    # on a lost node) holds back only the new trainer (_run_incarnation).
    remaining = any(pod.role == naming.Role.GYM for pod in p.observed.pods)
    start = parse_time(p.status.next_start_time)
    loss = p.status.last_failure
    reason = loss.reason if loss and loss.reason else "MemberLost"
    waiting = Desired(True, reason, f"next incarnation at {p.status.next_start_time}")
    why = f"{loss.message}; {waiting.message}" if loss and loss.message else waiting.message
    if remaining or (start is not None and p.now < start):
        if start is not None and p.now < start:
            p.look_again_at(start)
        p.say(
            restarting=waiting,
            ready=Desired(False, reason, why),
            progressing=Desired(True, "Restarting", waiting.message),
        )
        return
    _start_next(p, after=reason)


def _start_next(p: Pass, after: str) -> None:
    """Number the next incarnation now (so no later pod can reuse the old number, whatever
    blocks the start); its pods start once every older pod is gone and the spec is usable."""
    p.status.incarnation += 1
    p.status.incarnation_start_time = None
    p.status.members = []
    p.status.next_start_time = None
    p.events.append(
        Event("Normal", "IncarnationStarting", f"incarnation {p.status.incarnation} ({after})")
    )
    p.say(restarting=Desired(False, "Started"))
    _run_incarnation(p)


def static_children(
    run: RolloutRun, token: str, metrics_token: str = ""
) -> list[builders.Manifest]:
    """The children that live as long as the run, in creation order (the members' RBAC
    first: the ServiceAccount unless the spec names its own, the Lease Role and its binding
    to the account the pods run as; then the token Secrets, the Lease, the Services, the
    NetworkPolicies). The one list of them: :func:`static_child_refs` (what the actuator
    fetches) is read off it, so what is observed and what is created cannot disagree."""
    wanted = [
        builders.gym_token_secret(run, token),
        builders.metrics_token_secret(run, metrics_token),
        builders.trainer_lease(run),
        builders.trainer_service(run),
        builders.gym_service(run),
        network_policies.gym_network_policy(run),
        network_policies.generation_network_policy(run),
    ]
    if run.spec.workers.replicas:
        wanted.append(network_policies.worker_network_policy(run))
    wanted[:0] = [builders.member_role(run), builders.member_role_binding(run)]
    if run.spec.service_account_name is None:
        wanted[:0] = [builders.member_service_account(run)]
    return wanted


def static_child_refs(run: RolloutRun) -> list[tuple[str, str]]:
    """``(kind, name)`` of each of :func:`static_children`: what a pass fetches to fill
    :attr:`Observed.present <rolloutrun_operator.observe.Observed.present>`."""
    return [(m["kind"], m["metadata"]["name"]) for m in static_children(run, token="")]


def _ensure_static_children(p: Pass) -> None:
    for manifest in static_children(p.run, p.observed.new_token, p.observed.new_metrics_token):
        if f"{manifest['kind']}/{manifest['metadata']['name']}" not in p.observed.present:
            p.create(manifest)


def _restore_static_children(p: Pass, gyms: dict[int | None, PodView]) -> None:
    """While the incarnation runs, recreate a static child deleted by hand (its watch makes
    the pass due, :data:`~rolloutrun_operator.watching.WATCHED_CHILD_KINDS`), and the
    ConfigMap as the launch rendered it (only when gone: a running trainer read it already)."""
    _ensure_static_children(p)
    if p.observed.config is None:
        _put_config(p, _gym_endpoints(p, [gyms.get(i) for i in range(p.run.spec.gym.pods)]))


def _gym_endpoints(p: Pass, up: list[PodView | None]) -> list[str] | None:
    """The Gym endpoints the trainer's config names: every replica serving, else None."""
    port = p.run.spec.gym.port
    addresses = [pod.pod_ip for pod in up if pod and pod.pod_ip and serving(pod)]
    if len(addresses) != len(up):
        return None
    return [builders.gym_endpoint(ip, port) for ip in addresses]


def _rebind(p: Pass) -> None:
    """The member RoleBinding follows ``spec.serviceAccountName``: bound to the account the
    next pods run as, and to the accounts of trainers still running (a switch takes effect
    at the next incarnation; a running trainer keeps renewing, and publishing to, its Lease
    until it is gone). Replaced when its subjects differ, so a switched account is not left
    with a Lease its trainer cannot renew, nor an old account with one it no longer needs."""
    if p.observed.binding_accounts is None:
        return  # created with the static children
    if account_problem(p.run, p.observed) is not None:
        return  # an account that did not consent gets nothing (the launch reports it)
    live = [
        pod.service_account
        for pod in p.observed.pods
        if pod.role == naming.Role.TRAINER and not pod.terminated and pod.service_account
    ]
    binding = builders.member_role_binding(p.run, live)
    wanted = tuple(subject["name"] for subject in binding["subjects"])
    if wanted != p.observed.binding_accounts:
        name = binding["metadata"]["name"]
        p.actions.append(Action(Verb.REPLACE, "RoleBinding", name, binding))


def _put_config(p: Pass, endpoints: list[str] | None) -> None:
    data = builders.config_data(p.run, endpoints, p.status.latest_manifest_uri)
    if endpoints is None and p.observed.config is not None:
        trainer = p.observed.config.get(naming.CONFIG_KEY)
        if trainer is not None and p.observed.config_incarnation == p.status.incarnation:
            data[naming.CONFIG_KEY] = trainer
    if p.observed.config == data and p.observed.config_incarnation == p.status.incarnation:
        return
    manifest = builders.config_map(p.run, data, p.status.incarnation)
    verb = Verb.CREATE if p.observed.config is None else Verb.REPLACE
    p.actions.append(Action(verb, "ConfigMap", manifest["metadata"]["name"], manifest))


def _run_incarnation(p: Pass) -> None:
    n = p.status.incarnation
    stale = [pod for pod in p.observed.pods if pod.incarnation != n]
    _stop(p, stale)
    _rebind(p)
    members = p.observed.members(n)
    trainer = next((pod for pod in members if pod.role == naming.Role.TRAINER), None)
    gyms = {pod.gym_index: pod for pod in members if pod.role == naming.Role.GYM}
    launched = p.status.incarnation_start_time is not None or trainer is not None
    replicas = p.run.spec.gym.pods

    if trainer is not None and trainer.phase == "Succeeded" and trainer.disruption is None:
        _succeed(p, members)
        return
    elastic = p.run.spec.recovery.elastic_members
    loss = find_loss(p, trainer, gyms, launched, elastic)
    if loss is None and launched and elastic:
        loss = _replace_gyms(p, gyms)
    if loss is None and launched:
        loss = keep_workers(p, members, trainer)
    if loss is not None:
        _end_incarnation(p, members, loss)
        return
    if not launched:
        # The Gym pods of N+1 wait for the old Gym pods (same instance ids, same audit
        # files); the trainer of N+1 waits for every old pod, the old trainer publishing
        # its forced snapshot included. The new Gyms start meanwhile.
        if any(pod.role == naming.Role.GYM for pod in stale):
            _wait_for_previous(p, stale)
            return
        problems = spec_problems(p.run, p.observed)
        account = account_problem(p.run, p.observed)
        if account is not None:
            problems.append(account)
        if problems:
            reason, message = problems[0]
            p.say(**stopped(reason, message))
            p.look_again(IDLE_REQUEUE_SECONDS)
            return
        if _conflicting(p, [i for i in range(replicas) if i not in gyms]):
            return
        _ensure_static_children(p)
        up = [gyms.get(i) for i in range(replicas)]
        endpoints = _gym_endpoints(p, up)
        all_up = endpoints is not None
        _put_config(p, endpoints)
        for index in range(replicas):
            if index not in gyms:
                gym = builders.gym_pod(p.run, n, index)
                p.create(kueue.place(gym, p.placements.get(kueue.GYM_POD_SET)))
        if not all_up:
            ready = sum(1 for pod in up if pod is not None and serving(pod))
            message = f"{ready}/{replicas} Gym pods ready"
            reason, why = _held_back(p, up) or ("StartingGyms", message)
            p.say(ready=Desired(False, reason, why))
            p.say(progressing=Desired(True, "StartingGyms", message))
            p.look_again(5.0)
            return
        if stale:
            _wait_for_previous(p, stale)
            return
        trainer_pod = builders.trainer_pod(p.run, n)
        p.create(kueue.place(trainer_pod, p.placements.get(kueue.TRAINER_POD_SET)))
        p.status.incarnation_start_time = format_time(p.now)
        p.say(ready=Desired(False, "StartingTrainer"), progressing=Desired(True, "StartingTrainer"))
        p.look_again(5.0)
        return
    _keep_running(p, members, trainer, gyms)


def _keep_running(
    p: Pass, members: list[PodView], trainer: PodView | None, gyms: dict[int | None, PodView]
) -> None:
    """A launched incarnation with nothing lost: its static children restored, the stable
    period's reset of ``consecutiveLosses``, and Ready as its members stand."""
    n = p.status.incarnation
    replicas = p.run.spec.gym.pods
    _restore_static_children(p, gyms)
    if p.status.incarnation_start_time is None:
        p.status.incarnation_start_time = format_time(p.now)
    started = parse_time(p.status.incarnation_start_time) or p.now
    stable_at = started + dt.timedelta(seconds=p.run.spec.recovery.stable_period_seconds)
    if p.now >= stable_at:
        p.status.consecutive_losses = 0
    others = sum(1 for pod in members if pod.role != naming.Role.WORKER)  # worker_pods.py
    all_running = all(pod.phase == "Running" for pod in members) and others == replicas + 1
    goal = f"training toward step {p.run.spec.run.grpo.max_steps}"  # reached: trainStep, mirrored
    pending = replacing(p)
    if pending:
        names = ", ".join(f"{m.role} {m.index} (generation {m.generation})" for m in pending)
        p.say(ready=Desired(False, "ReplacingMembers", f"incarnation {n}: replacing {names}"))
    elif all_running:
        p.say(ready=Desired(True, "Running", f"incarnation {n}"))
    else:
        members_now = [trainer, *(gyms.get(i) for i in range(replicas))]
        reason, why = _held_back(p, members_now) or ("StartingTrainer", f"incarnation {n}")
        p.say(ready=Desired(False, reason, why))
    p.say(progressing=Desired(True, "Training", goal), restarting=Desired(False, "Running"))
    p.look_again(IDLE_REQUEUE_SECONDS)  # the Lease's expiry: losses.lease_loss


def _replace_gyms(p: Pass, gyms: dict[int | None, PodView]) -> Loss | None:
    """Elastic members (:mod:`members`): recreate lost Gyms under their index, and tell the
    trainer their addresses on its Lease; the loss that ends the incarnation when one
    failed too often."""
    n = p.status.incarnation
    replicas = p.run.spec.gym.pods

    def build(index: int, generation: int) -> builders.Manifest:
        gym = builders.gym_pod(p.run, n, index, generation)
        return kueue.place(gym, p.placements.get(kueue.GYM_POD_SET))

    loss = replace_members(p, naming.Role.GYM, replicas, gyms, build)
    if loss is None:
        action = endpoints_action(p, naming.Role.GYM, replicas, gyms, p.run.spec.gym.port)
        if action is not None:
            p.actions.append(action)
    return loss


def _held_back(p: Pass, pods: list[PodView | None]) -> Problem | None:
    """The first member the kubelet or the scheduler holds back (:func:`first_pod_problem`),
    announced by a Warning Event when the Ready condition did not say so already."""
    problem = first_pod_problem(pods)
    before = find(p.status.conditions, C.READY)
    if problem is not None and (before is None or (before.reason, before.message) != problem):
        p.events.append(Event("Warning", problem[0], problem[1][:1024]))
    return problem


def _conflicting(p: Pass, missing_gyms: list[int]) -> bool:
    """Report objects the run does not own that hold the names of children it is about to
    create or use (:mod:`ownership`); True when there are any, and nothing is started."""
    n = p.status.incarnation
    wanted = [f"{kind}/{child}" for kind, child in static_child_refs(p.run)]
    wanted.append(f"ConfigMap/{naming.config_map_name(p.name)}")
    wanted += [f"Pod/{naming.gym_pod_name(p.name, n, i)}" for i in missing_gyms]
    wanted.append(f"Pod/{naming.trainer_pod_name(p.name, n)}")
    found = conflicts(p.observed, wanted)
    if not found:
        return False
    message = conflict_message(found)
    before = find(p.status.conditions, C.READY)
    if before is None or before.reason != CHILD_CONFLICT or before.message != message:
        p.events.append(Event("Warning", CHILD_CONFLICT, message[:1024]))
    p.say(**stopped(CHILD_CONFLICT, message))
    p.look_again(IDLE_REQUEUE_SECONDS)
    return True


def _wait_for_previous(p: Pass, stale: list[PodView]) -> None:
    message = f"waiting for {len(stale)} pod(s) of earlier incarnations to stop"
    p.say(ready=Desired(False, "StoppingPrevious", message))
    p.say(progressing=Desired(True, "StoppingPrevious", message))


def _succeed(p: Pass, members: list[PodView]) -> None:
    p.delete_pods([pod for pod in members if pod.role in (naming.Role.GYM, naming.Role.WORKER)])
    p.status.next_start_time = None
    max_steps = p.run.spec.run.grpo.max_steps
    # Its exit 0 says so, also where it trained none itself (it resumed at maxSteps, after a
    # deletion at its last step or a run applied again over its storage): no Lease step.
    p.status.train_step = max(p.status.train_step, max_steps)
    message = f"trained {max_steps} steps"
    p.say(**ended(C.SUCCEEDED, "MaxStepsReached", message))
    p.events.append(Event("Normal", "Succeeded", message))


def _end_incarnation(p: Pass, members: list[PodView], loss: Loss) -> None:
    policy = p.run.spec.recovery
    status = p.status
    if loss.reason in TRAINER_UNRESPONSIVE:
        trainers = [pod for pod in members if pod.role == naming.Role.TRAINER]
        p.delete_pods(trainers, grace_seconds=UNRESPONSIVE_TRAINER_GRACE_SECONDS)
        p.delete_pods([pod for pod in members if pod not in trainers])
    else:
        _stop(p, members)
    started = parse_time(status.incarnation_start_time)
    if started is not None and p.now - started >= dt.timedelta(
        seconds=policy.stable_period_seconds
    ):
        status.consecutive_losses = 0
    status.last_failure = FailureRecord(
        reason=loss.reason, pod=loss.pod, time=format_time(p.now), message=loss.message[:4096]
    )
    status.incarnation_start_time = None
    if loss.kind is LossKind.UNRECOVERABLE:
        p.say(**ended(C.FAILED, loss.reason, loss.message))
        p.events.append(Event("Warning", loss.reason, loss.message[:1024]))
        return
    if loss.kind is LossKind.FAILURE and status.restarts >= policy.max_restarts:
        message = (
            f"{status.restarts} restarts after failures (maxRestarts {policy.max_restarts}); "
            f"last: {loss.reason}: {loss.message}"
        )
        p.say(**ended(C.FAILED, "RestartLimitExceeded", message))
        p.events.append(Event("Warning", "RestartLimitExceeded", message))
        return
    if loss.kind is LossKind.FAILURE:
        status.restarts += 1
        status.consecutive_losses += 1
    else:
        status.preemptions += 1
    delay = restart_delay(policy, loss.kind, status.consecutive_losses)
    start = p.now + dt.timedelta(seconds=delay)
    status.next_start_time = format_time(start)
    p.look_again(delay)
    message = f"incarnation {status.incarnation} ended: {loss.message}; next in {delay}s"
    p.say(
        restarting=Desired(True, loss.reason, message),
        ready=Desired(False, loss.reason, message),
        progressing=Desired(True, "Restarting", message),
    )
    p.events.append(Event("Warning", loss.reason, message))


def _stop(p: Pass, pods: list[PodView]) -> bool:
    """Delete ``pods`` trainer first; True while any of them still exists.

    A Gym pod is kept while the trainer of its incarnation may still be publishing its
    forced snapshot (deleted or not, not yet exited, on a Ready node): that snapshot asks
    every Gym for its episodes, and a Gym deleted with it would make it ``discarded_env``.
    The Gym pods go in the pass that sees that trainer exited or gone (its pod event wakes
    the run). A Gym pod that is already terminating, finished or on a lost node serves
    nothing and goes at once; a trainer that will not exit is force-deleted after its grace
    period (:meth:`Pass.delete_pods`), which then releases its Gyms.
    """
    snapshotting = {
        pod.incarnation
        for pod in pods
        if pod.role == naming.Role.TRAINER and not pod.terminated and _node_ready(p, pod)
    }
    held = [
        pod
        for pod in pods
        if pod.role == naming.Role.GYM
        and pod.incarnation in snapshotting
        and pod.deletion_time is None
        and not pod.terminated
        and _node_ready(p, pod)
    ]
    p.delete_pods([pod for pod in pods if pod not in held])
    return bool(pods)


def _node_ready(p: Pass, pod: PodView) -> bool:
    node = p.observed.nodes.get(pod.node_name or "")
    return node is None or node.ready


def _report_forced(p: Pass) -> None:
    """Name each member force-deleted in this pass: an Event, and in ``Progressing``."""
    if not p.forced:
        return
    message = (
        f"force-deleted {', '.join(p.forced)}: still terminating {STUCK_TERMINATING_SECONDS}s "
        "after its grace period ended"
    )
    p.events.append(Event("Warning", "StuckTerminating", message))
    progressing = p.desired.get(C.PROGRESSING)
    if progressing is not None:
        text = f"{progressing.message}; {message}" if progressing.message else message
        p.desired[C.PROGRESSING] = Desired(progressing.status, progressing.reason, text)
