"""One reconcile pass against the API: fetch, observe, decide (purely), apply, write status.

Why apart from the handlers: the Kopf module should only wire events to passes; this module
holds the I/O around :func:`~rolloutrun_operator.reconcile.reconcile` and takes no decision
itself. Order matters and is kept here: actions first (in the order the reconcile gave, so
the ConfigMap precedes the pods that mount it), then one status patch per pass, and only
then does the caller emit Events. If an action fails the status is not written, so a status
never claims what did not happen; the next pass observes again and decides again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rolloutrun_operator import builders, kueue, naming
from rolloutrun_operator.api.v1alpha1 import (
    Condition,
    LeaseObservation,
    RolloutRun,
    RolloutRunStatus,
)
from rolloutrun_operator.api.validation import RolloutRunInvalid, parse_rolloutrun
from rolloutrun_operator.conditions import ConditionType, Desired, find, merge
from rolloutrun_operator.kube import ChildConflict, Json, Kube, NameFreed
from rolloutrun_operator.observe import Observed, observed_from, owned_by
from rolloutrun_operator.ownership import CHILD_CONFLICT, conflict_message
from rolloutrun_operator.plan import Action, Event, Verb
from rolloutrun_operator.reconcile import (
    IDLE_REQUEUE_SECONDS,
    Result,
    reconcile,
    static_child_refs,
)
from rolloutrun_operator.watching import INDEXED_CHILD_KINDS

logger = logging.getLogger(__name__)

#: Seconds between passes while a conflicting object is terminating: its name is free once
#: it is gone, and no watch event says so (it does not carry the run's label).
TERMINATING_HOLDER_RECHECK_SECONDS = 2.0


@dataclass
class Outcome:
    """What a pass did: the run's body (for Events), the decision, and the new status."""

    body: Json
    result: Result
    previous: RolloutRunStatus | None
    wrote_status: bool
    version: str = ""
    """The run's ``resourceVersion`` once the pass ended: its status write's, else the one
    it read (a later pass may take a watched body that is not older, see ``run_pass``)."""
    written: Json | None = None
    """The run as the API answered the pass's status write (None: none written): the next
    pass may start from it while the watch has not yet shown that write."""


@dataclass
class Known:
    """The run's pods and Lease as the operator's watch indexes hold them (no request), and
    its static children of the :data:`~rolloutrun_operator.watching.INDEXED_CHILD_KINDS`
    (``Kind/name`` to the object; one not in it is read from the API)."""

    pods: list[Json]
    lease: Json | None
    children: Mapping[str, Json] | None = None
    recent: Mapping[str, Json] = dataclasses.field(default_factory=dict)
    """Children of the kinds no index holds (``Kind/name``) that a pass found present
    moments ago (:meth:`~rolloutrun_operator.watching.RunMemory.recent_reads`): not read
    again."""


#: What a pass tells its caller it decided on: the pods, the Lease, and the static children
#: of the indexed kinds as found (``Kind/name`` to the object or None).
Saw = Callable[[list[Json], Json | None, Mapping[str, Json | None]], None]


async def observe(
    kube: Kube,
    run: RolloutRun,
    known: Known | None = None,
    saw: Saw | None = None,
    indexed_children: Mapping[str, Json] | None = None,
) -> Observed:
    """Everything the reconcile needs to know about ``run``'s children, fetched concurrently
    (the pods, the Lease and the children of the indexed kinds from ``known`` when given:
    a steady pass GETs only the Secrets, which are not watched, and the nodes)."""
    name, namespace = builders.run_name(run), builders.run_namespace(run)
    static = static_child_refs(run)
    user_secrets = builders.referenced_secrets(run)
    account = run.spec.service_account_name
    uid = str(run.metadata.get("uid") or "")
    gets = [
        ("Lease", naming.lease_name(name)),
        ("ConfigMap", naming.config_map_name(name)),
        *static,
        *(("Secret", secret) for secret in user_secrets),
        *([("ServiceAccount", account)] if account else []),
    ]
    if known is None:
        current = Known([], None, indexed_children)  # those the indexes hold, known current
        unique = list(dict.fromkeys(gets))  # the Lease is a static child too: read once
        pods, answers = await asyncio.gather(
            kube.list("Pod", namespace, naming.run_selector(name)),
            asyncio.gather(*(_child(kube, current, namespace, k, c) for k, c in unique)),
        )
        found = [dict(zip(unique, answers, strict=True))[ref] for ref in gets]
        nodes = await _nodes(kube, pods, uid)
    else:  # the nodes read with the children: the pods are known before any request
        pods = known.pods
        children_found, nodes = await asyncio.gather(
            asyncio.gather(*(_child(kube, known, namespace, k, c) for k, c in gets[1:])),
            _nodes(kube, pods, uid, known.recent),
        )
        found = [known.lease, *children_found]
    lease, config = found[0], found[1]
    if saw is not None:  # the unindexed ones too: a pass moments later need not read them
        read = {f"{k}/{c}": obj for (k, c), obj in zip(gets[1:], found[1:], strict=True)}
        saw(pods, lease, {**read, **{f"Node/{_name(node)}": node for node in nodes}})
    statics = found[2 : 2 + len(static)]
    children = {f"{kind}/{child}": obj for (kind, child), obj in zip(static, statics, strict=True)}
    secret_objs = found[2 + len(static) : 2 + len(static) + len(user_secrets)]
    existing = [s for s, obj in zip(user_secrets, secret_objs, strict=True) if obj]
    account_obj = found[-1] if account else None
    return observed_from(
        pods=pods,
        lease=lease,
        config_map=config,
        children=children,
        secrets=existing,
        nodes=nodes,
        new_token=secrets.token_urlsafe(32),
        new_metrics_token=secrets.token_urlsafe(32),
        uid=uid,
        account=account_obj,
    )


async def _child(kube: Kube, known: Known, namespace: str, kind: str, name: str) -> Json | None:
    """A static child from the indexes when they hold it (the Lease from its own), else
    from the API: one missing from an index may be someone else's object of that name
    (without the run's label), a conflict the pass must name rather than meet on create."""
    if kind == "Lease" and known.lease is not None and name == _name(known.lease):
        return known.lease
    found = known.children.get(f"{kind}/{name}") if known.children is not None else None
    if found is not None and kind in INDEXED_CHILD_KINDS:
        return found
    if kind not in INDEXED_CHILD_KINDS and f"{kind}/{name}" in known.recent:
        return known.recent[f"{kind}/{name}"]
    return await kube.get(kind, namespace, name)


async def _nodes(
    kube: Kube, pods: list[Json], uid: str, recent: Mapping[str, Json] | None = None
) -> list[Json]:
    """The nodes the run's own pods are bound to (read for their readiness); a node only
    pods being deleted or ended are on is taken from ``recent`` when a pass read it moments
    ago (a lost pod's old members, deleting, were read on its reaction's path; a running
    member's node is always read: its readiness decides a loss)."""
    members = [pod for pod in pods if owned_by(pod, uid)]
    running = {_node_of(pod) for pod in members if not _ending(pod)}
    names = sorted({_node_of(pod) for pod in members} - {""})
    recent = recent or {}

    async def read(node: str) -> Json | None:
        if node not in running and f"Node/{node}" in recent:
            return recent[f"Node/{node}"]
        return await kube.get("Node", None, node)

    found = await asyncio.gather(*(read(node) for node in names))
    return [node for node in found if node]


def _node_of(pod: Json) -> str:
    return str((pod.get("spec") or {}).get("nodeName") or "")


def _ending(pod: Json) -> bool:
    phase = (pod.get("status") or {}).get("phase")
    return bool((pod.get("metadata") or {}).get("deletionTimestamp")) or phase in (
        "Succeeded",
        "Failed",
    )


def _version(obj: Json) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def _name(obj: Json) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))


async def observe_workload(kube: Kube, run: RolloutRun, observed: Observed) -> Observed:
    """Add the run's Kueue Workload and the ResourceFlavors its admission names (only for a
    run labelled ``kueue.x-k8s.io/queue-name``: other runs never touch Kueue's API)."""
    if kueue.queue_name(run) is None:
        return observed
    name = kueue.workload_name(builders.run_name(run))
    workload = await kube.get("Workload", builders.run_namespace(run), name)
    view = kueue.workload_view(workload, str(run.metadata.get("uid") or ""))
    names = sorted(
        {flavor for flavors in (view.flavors if view else {}).values() for flavor in flavors}
    )
    found = await asyncio.gather(*(kube.get("ResourceFlavor", None, flavor) for flavor in names))
    flavors = {flavor: obj for flavor, obj in zip(names, found, strict=True) if obj is not None}
    return dataclasses.replace(observed, workload=workload, flavors=flavors)


async def apply(kube: Kube, namespace: str, actions: list[Action]) -> None:
    """Apply the actions in order; a create of an existing child the run owns or a delete
    of a gone one counts as done. A name held by an object the run does not own raises
    :class:`~rolloutrun_operator.kube.ChildConflict` and stops the actions after it (they
    may depend on it); any other API error propagates (the pass is retried).

    Consecutive deletes are sent together (:func:`in_steps`): none depends on another (a
    Gym pod its trainer may still need is not among them, see ``reconcile._stop``), and a
    lost trainer's Gym pods one after another cost a round trip each before the next
    incarnation could start."""
    for step in in_steps(actions):
        if len(step) == 1:
            await _apply_one(kube, namespace, step[0])
            continue
        done = await asyncio.gather(
            *(_apply_one(kube, namespace, action) for action in step), return_exceptions=True
        )
        for outcome in done:  # every one ended (none left running); the first error raised
            if isinstance(outcome, BaseException):
                raise outcome


def in_steps(actions: list[Action]) -> list[list[Action]]:
    """``actions`` in order, each run of consecutive deletes one step, any other action a
    step of its own."""
    steps: list[list[Action]] = []
    for action in actions:
        if steps and action.verb is Verb.DELETE and steps[-1][-1].verb is Verb.DELETE:
            steps[-1].append(action)
        else:
            steps.append([action])
    return steps


async def _apply_one(kube: Kube, namespace: str, action: Action) -> None:
    if action.verb is Verb.CREATE and action.manifest is not None:
        created = await kube.create_owned(action.manifest)
        logger.info("created %s/%s%s", action.kind, action.name, "" if created else " (existed)")
    elif action.verb is Verb.REPLACE and action.manifest is not None:
        await kube.replace(action.manifest)
        logger.info("replaced %s/%s", action.kind, action.name)
    elif action.verb is Verb.PATCH_STATUS and action.manifest is not None:
        if await kube.patch_status_at(action.kind, namespace, action.name, action.manifest):
            logger.info("patched %s/%s status", action.kind, action.name)
    elif action.verb is Verb.ANNOTATE and action.manifest is not None:
        await kube.patch(action.kind, namespace, action.name, action.manifest)
        logger.info("annotated %s/%s", action.kind, action.name)
    elif action.verb is Verb.DELETE:
        await kube.delete(action.kind, namespace, action.name, action.grace_seconds, uid=action.uid)
        logger.info("deleted %s/%s", action.kind, action.name)


def lenient_status(raw: Any, where: str) -> RolloutRunStatus | None:
    """The run's last status, tolerant of what only the spec must not have: fields this
    version does not know (written by a newer operator) are dropped, an unreadable status
    keeps at least its incarnation (so no incarnation number is ever reused)."""
    if not isinstance(raw, dict) or not raw:
        return None
    known = {field.alias or key for key, field in RolloutRunStatus.model_fields.items()}
    try:
        return RolloutRunStatus.model_validate({k: v for k, v in raw.items() if k in known})
    except ValueError as error:
        logger.warning(
            "status of RolloutRun %s unreadable, keeping its incarnation: %s", where, error
        )
        incarnation = raw.get("incarnation")
        return RolloutRunStatus(incarnation=incarnation if isinstance(incarnation, int) else 0)


def status_json(status: RolloutRunStatus) -> Json:
    """The status as a merge patch: None values are explicit nulls, so cleared fields vanish."""
    return status.model_dump(mode="json", by_alias=True)


def invalid_status(body: Json, problem: RolloutRunInvalid, now: dt.datetime) -> Json:
    """Status of a run whose spec the models reject: Ready=False with what to fix."""
    raw = body.get("status") or {}
    previous = []
    for item in raw.get("conditions") or []:
        try:
            previous.append(Condition.model_validate(item))
        except ValueError:
            continue
    message = "; ".join(problem.problems)[:32_768]
    desired = {
        ConditionType.READY: Desired(False, "InvalidSpec", message),
        ConditionType.PROGRESSING: Desired(False, "InvalidSpec", message),
    }
    generation = (body.get("metadata") or {}).get("generation")
    conditions = merge(previous, desired, now, generation)
    return {
        "observedGeneration": generation,
        "conditions": [c.model_dump(mode="json", by_alias=True) for c in conditions],
    }


async def run_pass(
    kube: Kube,
    namespace: str,
    name: str,
    now: dt.datetime,
    known: Known | None = None,
    lease_seen: Callable[[Json | None, LeaseObservation | None], LeaseObservation | None]
    | None = None,
    saw: Saw | None = None,
    children: Mapping[str, Json] | None = None,
    body: Json | None = None,
) -> Outcome | None:
    """One full pass over the run ``namespace/name``; None when the run is gone. ``known``:
    its pods and Lease from the watch indexes; ``lease_seen`` gives ``status.lease`` from the
    renewals the operator saw (see :meth:`watching.RunMemory.lease_for_pass`); ``saw`` is
    told the pods and Lease the pass decided on; ``children``: without ``known``, the
    static children the indexes hold that are known current (the others are read);
    ``body``: the run as the watch holds it, when it is known to be no older than this
    operator's last write of its status (else it is read: one round trip less on a lost
    pod's path, where each costs most under load)."""
    if body is None:
        body = await kube.get("RolloutRun", namespace, name)
    if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
        return None
    try:
        spec_only = {key: value for key, value in body.items() if key != "status"}
        run = parse_rolloutrun(spec_only, f"RolloutRun {namespace}/{name}")
    except RolloutRunInvalid as problem:
        patch = invalid_status(body, problem, now)
        changed = patch != _subset(body.get("status") or {}, patch)
        written = await kube.patch_status("RolloutRun", namespace, name, patch) if changed else {}
        events = [Event("Warning", "InvalidSpec", "; ".join(problem.problems)[:1024])]
        result = Result([], RolloutRunStatus(), events if changed else [], IDLE_REQUEUE_SECONDS)
        return Outcome(body, result, None, changed, _version(written or body))
    run.status = lenient_status(body.get("status"), f"{namespace}/{name}")
    if lease_seen is not None and known is not None:
        recorded = run.status.lease if run.status is not None else None
        seen = lease_seen(known.lease, recorded)
        renewal = recorded is not None and seen is not None and seen.holder == recorded.holder
        if renewal and seen is not recorded and run.status is not None:
            run.status.lease = seen  # a renewal alone is not worth a status write
    observed = await observe_workload(kube, run, await observe(kube, run, known, saw, children))
    result = reconcile(run, observed, now)
    try:
        await apply(kube, namespace, result.actions)
    except ChildConflict as conflict:
        result = conflict_result(run, conflict, now)
    except NameFreed as freed:
        logger.info("%s: the pass ends unclaimed, the next one observes again", freed)
        result = freed_result(run)
    new = status_json(result.status)
    old = status_json(run.status) if run.status is not None else None
    wrote = new != old
    written = await kube.patch_status("RolloutRun", namespace, name, new) if wrote else {}
    after = written if _version(written) else None
    return Outcome(body, result, run.status, wrote, _version(written or body), after)


def conflict_result(run: RolloutRun, conflict: ChildConflict, now: dt.datetime) -> Result:
    """A pass cut short by a :class:`ChildConflict` on create: the last status (nothing
    this pass decided is claimed) with ``Ready=False`` naming the object and its owner;
    looked at again soon when that object is terminating, else when idle."""
    status = (run.status or RolloutRunStatus()).model_copy(deep=True)
    message = conflict_message([(conflict.ref, conflict.owner)])
    desired = {
        ConditionType.READY: Desired(False, CHILD_CONFLICT, message),
        ConditionType.PROGRESSING: Desired(False, CHILD_CONFLICT, message),
    }
    before = find(status.conditions, ConditionType.READY)
    status.conditions = merge(status.conditions, desired, now, run.metadata.get("generation"))
    fresh = before is None or before.reason != CHILD_CONFLICT or before.message != message
    events = [Event("Warning", CHILD_CONFLICT, message[:1024])] if fresh else []
    again = TERMINATING_HOLDER_RECHECK_SECONDS if conflict.terminating else IDLE_REQUEUE_SECONDS
    return Result([], status, events, again, other_requeue_after=again)


def freed_result(run: RolloutRun) -> Result:
    """A pass cut short by :class:`~rolloutrun_operator.kube.NameFreed`: the last status
    unchanged (this pass's decision assumed the child was created, and a trainer counted
    launched but never created would be a trainer lost: a restart nothing caused), and the
    next pass at once, which finds the name free."""
    status = (run.status or RolloutRunStatus()).model_copy(deep=True)
    return Result([], status, [], 0.0, other_requeue_after=0.0)


def _subset(status: dict[str, Any], patch: Json) -> Json:
    return {key: status.get(key) for key in patch}
