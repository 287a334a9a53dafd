"""Elastic members: a lost member of a running incarnation is recreated, not the run.

Why its own module: before it, any lost pod ended the incarnation, so a Gym on a spot node
cost the trainer's warm weights and every rollout in flight on the other Gyms. Only the
trainer's loss (or its Lease expiring) needs that: a Gym holds nothing the trainer cannot
redispatch (its ledger marks the lost member's attempts abandoned and relaunches them on
the survivors). Pure like :mod:`reconcile`: it reads the :class:`~plan.Pass` and appends
actions and status.

Role-generic on purpose: a member is ``(role, index)``; the caller names the role, the
pods it observed by index and how to build generation ``g`` of index ``i``. Its pod keeps
its name and gets the next *member generation* (``LABEL_MEMBER_GENERATION``), so two pods
of one index (same instance id, same audit file) never run at once: the replacement is
created once the lost pod is gone. Failures of one member are bounded
(``recovery.maxMemberFailures``): past it the incarnation ends ``MemberFailuresExhausted``
(a failure, counted against ``maxRestarts``), never an endless loop of replacements.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from rolloutrun_operator import builders, naming
from rolloutrun_operator.api.v1alpha1 import MemberReplacements, MemberState
from rolloutrun_operator.losses import pod_loss, serving
from rolloutrun_operator.observe import PodView, format_time, parse_time
from rolloutrun_operator.plan import Action, Event, Loss, LossKind, Pass, Verb
from rolloutrun_runtime.contract.pod import worker_pod_name

#: Replacement times kept per role in ``status.memberReplacements[].recentSeconds``.
RECENT_REPLACEMENTS = 16
#: The reason of the loss that ends an incarnation once one member failed too often.
FAILURES_EXHAUSTED = "MemberFailuresExhausted"


def member_state(p: Pass, role: str, index: int) -> MemberState | None:
    return next((m for m in p.status.members if (m.role, m.index) == (role, index)), None)


def seen_member(p: Pass, role: str, index: int) -> None:
    """Record member ``(role, index)`` once its first pod is seen, if it has no state yet:
    a pod that then vanishes unseen (deleted with grace 0, its node lost and its pods
    removed) is a loss to replace and count, not a member never created."""
    if member_state(p, role, index) is None:
        p.status.members.append(MemberState(role=role, index=index, generation=0))
        p.status.members.sort(key=lambda m: (m.role, m.index))


def _lost(p: Pass, role: str, index: int, loss: Loss) -> MemberState:
    """Record ``loss`` of member ``(role, index)``: the next generation is wanted now."""
    state = member_state(p, role, index)
    if state is None:
        state = MemberState(role=role, index=index, generation=0)
        p.status.members.append(state)
        p.status.members.sort(key=lambda m: (m.role, m.index))
    state.generation += 1
    if state.lost_at is None:  # a replacement lost before Ready: timed from the first loss
        state.lost_at = format_time(p.now)
    state.lost_reason = loss.reason[:128]
    if loss.kind is not LossKind.PREEMPTION:
        state.failures += 1
    return state


def _replaced(p: Pass, state: MemberState) -> None:
    """The wanted generation serves: count the replacement and the time it took."""
    lost = parse_time(state.lost_at) or p.now
    seconds = round(max((p.now - lost).total_seconds(), 0.0), 3)
    state.lost_at = None
    record = next((r for r in p.status.member_replacements if r.role == state.role), None)
    if record is None:
        record = MemberReplacements(role=state.role)
        p.status.member_replacements.append(record)
    record.count += 1
    record.last_seconds = seconds
    record.max_seconds = max(record.max_seconds or 0.0, seconds)
    record.recent_seconds = [*record.recent_seconds, seconds][-RECENT_REPLACEMENTS:]


def replace_members(
    p: Pass,
    role: str,
    replicas: int,
    pods: Mapping[int | None, PodView],
    build: Callable[[int, int], builders.Manifest],
    indices: Iterable[int] | None = None,
) -> Loss | None:
    """Keep members ``0..replicas-1`` of ``role`` serving in the running incarnation.

    A lost pod (:func:`losses.pod_loss`, or gone) is deleted and recreated under its index
    with the next generation; a pod of an older generation is only waited for. Returns the
    loss that ends the incarnation when a member's failures reached the limit, else None.
    ``indices``: the members to look at (default: all).
    """
    limit = p.run.spec.recovery.max_member_failures
    for index in range(replicas) if indices is None else indices:
        state = member_state(p, role, index)
        wanted = state.generation if state is not None else 0
        pod = pods.get(index)
        if pod is not None and pod.generation < wanted:
            p.delete_pods([pod])  # the lost one, going: its replacement takes its name
            continue
        loss = pod_loss(p, pod) if pod is not None else _gone(p, role, index, state)
        if loss is not None:
            state = _lost(p, role, index, loss)
            if state.failures >= limit:
                message = (
                    f"{role} {index} failed {state.failures} times in incarnation "
                    f"{p.status.incarnation} (maxMemberFailures {limit}); last: {loss.message}"
                )
                return Loss(FAILURES_EXHAUSTED, loss.pod, LossKind.FAILURE, message)
            message = (
                f"{role} {index} lost ({loss.message}): replacing it with generation "
                f"{state.generation}, incarnation {p.status.incarnation} goes on"
            )
            p.events.append(Event("Warning", f"{role.capitalize()}Replacing", message[:1024]))
            if pod is not None:
                p.delete_pods([pod])
                continue
        if pod is None:
            assert state is not None
            p.create(build(index, state.generation))
            p.look_again(5.0)
            continue
        if state is not None and state.lost_at is not None:
            if serving(pod):
                _replaced(p, state)
            else:
                p.look_again(5.0)
    return None


def _gone(p: Pass, role: str, index: int, state: MemberState | None) -> Loss | None:
    """A missing pod is a loss unless its replacement is already wanted (created, not seen)."""
    if state is not None and state.lost_at is not None:
        return None
    pod_name = naming.gym_pod_name if role == naming.Role.GYM else worker_pod_name
    name = pod_name(p.name, p.status.incarnation, index)
    return Loss("PodDeleted", name, LossKind.PREEMPTION, f"{role} {index} ({name}) disappeared")


def _addressable(p: Pass, role: str, index: int, pod: PodView) -> bool:
    """Serving, or the wanted generation's pod started (not going, not finished)."""
    if serving(pod):
        return True
    state = member_state(p, role, index)
    wanted = state.generation if state is not None else 0
    return (
        pod.generation == wanted
        and pod.phase == "Running"
        and pod.deletion_time is None
        and not pod.terminated
    )


def replacing(p: Pass) -> list[MemberState]:
    """The members whose replacement is not Ready yet."""
    return [m for m in p.status.members if m.lost_at is not None]


def endpoints_action(
    p: Pass, role: str, replicas: int, pods: Mapping[int | None, PodView], port: int
) -> Action | None:
    """The Lease annotation the trainer reads the ``role`` members' addresses from, when it
    must change: each member's address and generation, a replacement's as soon as its pod
    has an address (the trainer re-admits it once its ``/healthz`` answers, without waiting
    for the readiness probe and the pass that sees it); an index without one keeps the
    address last written. Written once a member of the incarnation was replaced; until
    then the trainer's config holds."""
    lease = p.observed.lease
    if lease is None or not any(m.role == role for m in p.status.members):
        return None  # nothing replaced: the rendered config's endpoints are right
    n = p.status.incarnation
    known = naming.parse_member_endpoints(lease.endpoints.get(role), n)
    wanted = dict(known)
    for index in range(replicas):
        pod = pods.get(index)
        if pod is not None and pod.pod_ip and _addressable(p, role, index, pod):
            url = builders.gym_endpoint(pod.pod_ip, port)
            wanted[index] = naming.MemberEndpoint(index, url, pod.generation)
    if wanted == known:
        return None
    key = naming.member_endpoints_annotation(role)
    text = naming.format_member_endpoints(n, list(wanted.values()))
    manifest = {"metadata": {"annotations": {key: text}}}
    return Action(Verb.ANNOTATE, "Lease", naming.lease_name(p.name), manifest)
