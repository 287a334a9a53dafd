"""Kueue admission of a RolloutRun: the operator is the run's Kueue job controller.

Why this integration: Kueue admits custom workloads either through its pod-group
integration (Kueue gates and deletes bare pods, which would kill the trainer and its Gyms
together, without the forced snapshot the trainer publishes on its own SIGTERM) or through
a controller that creates a ``kueue.x-k8s.io/v1beta1`` Workload for its job and obeys its
admission, as Kueue's own ``jobframework`` controllers do for Jobs and JobSets. The second
keeps recovery ours: a run labelled ``kueue.x-k8s.io/queue-name`` owns one Workload
(podSets ``trainer`` 1 and ``gym`` N, with the member pods' resources), keeps its members
stopped until Kueue admits it, places them on the admitted flavors, stops them (trainer
first: its forced snapshot) when Kueue evicts it, then gives the quota back and waits to be
admitted again; a finished run finishes its Workload.

When the run's size changes (Gym replicas, resources, scheduling), its podSets follow by
Kueue's own rule (``jobframework``'s ``ensureOneWorkload``; podSets are immutable while
quota is reserved): a Workload without a reservation is updated in place; one with a
reservation no longer matches the run, so the members are stopped (the forced snapshot
again) and, once they are gone, the Workload is deleted and a new one queued.

Pure: :func:`gate` maps the run, its Workload and what is left of its pods to a
:class:`Gate`; the actuator only fetches the Workload and the admitted ResourceFlavors and
applies the actions.
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from rolloutrun_operator import builders
from rolloutrun_operator.api.v1alpha1 import RolloutRun
from rolloutrun_operator.observe import format_time, owned_by
from rolloutrun_operator.plan import Action, Verb

GROUP = "kueue.x-k8s.io"
API_VERSION = f"{GROUP}/v1beta1"
QUEUE_LABEL = f"{GROUP}/queue-name"
"""The label a user puts on a RolloutRun to have Kueue admit it (as on a Job)."""
PRIORITY_LABEL = f"{GROUP}/priority-class"
"""Optional: a WorkloadPriorityClass for the run's Workload (as on a Job)."""
TRAINER_POD_SET = "trainer"
GYM_POD_SET = "gym"
#: Eviction reasons after which Kueue requeues the Workload at once (its ``Requeued``).
REQUEUED_AFTER = frozenset({"Preempted", "NodeFailures"})
#: What the run's ``Ready``/``Progressing`` say while Kueue holds it.
QUEUED = "QueuedByKueue"
EVICTED = "EvictedByKueue"
RESIZED = "WorkloadOutOfDate"
"""The run's size changed under an admitted Workload: stopping, then queued anew."""
#: What of a podSet's pod spec Kueue's quota and flavor assignment see (besides its count).
SHAPE_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName")


def queue_name(run: RolloutRun) -> str | None:
    """The LocalQueue the run is submitted to, or None when Kueue does not manage it."""
    labels = run.metadata.get("labels") or {}
    value = labels.get(QUEUE_LABEL)
    return str(value) if value else None


def workload_name(run_name: str) -> str:
    """The run's Workload: one per run, named after it (Kueue's own are ``<kind>-<name>``)."""
    return f"rolloutrun-{run_name}"[:253]


def _pod_template(pod: Mapping[str, Any]) -> dict[str, Any]:
    spec = dict(pod["spec"])
    return {"metadata": {"labels": dict(pod["metadata"].get("labels") or {})}, "spec": spec}


def workload_manifest(run: RolloutRun, queue: str) -> dict[str, Any]:
    """The Workload the run asks Kueue to admit: its members' pod specs as podSets (Kueue
    sums their containers' requests), owned by the run (deleted with it)."""
    name = builders.run_name(run)
    meta = builders.metadata(run, workload_name(name))
    spec: dict[str, Any] = {
        "queueName": queue,
        "podSets": [
            {
                "name": TRAINER_POD_SET,
                "count": 1,
                "template": _pod_template(builders.trainer_pod(run, 0)),
            },
            {
                "name": GYM_POD_SET,
                "count": run.spec.gym.pods,
                "template": _pod_template(builders.gym_pod(run, 0, 0)),
            },
        ],
    }
    priority = (run.metadata.get("labels") or {}).get(PRIORITY_LABEL)
    if priority:
        meta["labels"][PRIORITY_LABEL] = str(priority)
        spec["priorityClassName"] = str(priority)
        spec["priorityClassSource"] = f"{GROUP}/workloadpriorityclass"
    return {"apiVersion": API_VERSION, "kind": "Workload", "metadata": meta, "spec": spec}


def _containers_shape(spec: Mapping[str, Any], key: str) -> list[Any]:
    return [(c.get("name"), c.get("resources") or {}) for c in spec.get(key) or []]


def pod_sets_shape(pod_sets: Any) -> list[Any]:
    """What must match between the run and its Workload: each podSet's name, count, and
    the resources and scheduling fields of its pod template (what quota and flavors see; an
    env var or a command is not Kueue's business)."""
    shape = []
    for pod_set in pod_sets or []:
        spec = (pod_set.get("template") or {}).get("spec") or {}
        shape.append(
            (
                pod_set.get("name"),
                pod_set.get("count"),
                _containers_shape(spec, "initContainers"),
                _containers_shape(spec, "containers"),
                [spec.get(key) for key in SHAPE_FIELDS],
            )
        )
    return shape


@dataclass(frozen=True)
class Placement:
    """What an admission adds to one podSet's pods: the admitted flavors' node labels and
    tolerations (what Kueue's ``RunWithPodSetsInfo`` injects into a Job's template)."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


@dataclass(frozen=True)
class WorkloadView:
    """The parts of a Workload the gate decides on."""

    name: str
    resource_version: str
    conditions: tuple[Mapping[str, Any], ...]
    reserved: bool
    """``status.admission`` is set: Kueue holds quota for the run."""
    flavors: Mapping[str, tuple[str, ...]]
    """PodSet name -> the ResourceFlavors admitted for it."""
    pod_sets: tuple[Mapping[str, Any], ...] = ()
    """``spec.podSets`` as Kueue admits them."""
    uid: str = ""

    def condition(self, kind: str) -> Mapping[str, Any] | None:
        return next((c for c in self.conditions if c.get("type") == kind), None)

    def true(self, kind: str) -> bool:
        found = self.condition(kind)
        return found is not None and found.get("status") == "True"

    @property
    def admitted(self) -> bool:
        return self.reserved and self.true("Admitted")


def workload_view(obj: Mapping[str, Any] | None, run_uid: str) -> WorkloadView | None:
    """The run's Workload, or None when it does not exist or is not the run's own."""
    if obj is None or not owned_by(obj, run_uid):
        return None
    status = obj.get("status") or {}
    admission = status.get("admission") or None
    flavors: dict[str, tuple[str, ...]] = {}
    for assignment in (admission or {}).get("podSetAssignments") or []:
        names = sorted({str(f) for f in (assignment.get("flavors") or {}).values()})
        flavors[str(assignment.get("name"))] = tuple(names)
    meta = obj.get("metadata") or {}
    return WorkloadView(
        name=str(meta.get("name")),
        resource_version=str(meta.get("resourceVersion") or ""),
        conditions=tuple(c for c in status.get("conditions") or [] if isinstance(c, Mapping)),
        reserved=admission is not None,
        flavors=flavors,
        pod_sets=tuple((obj.get("spec") or {}).get("podSets") or ()),
        uid=str(meta.get("uid") or ""),
    )


def placements(
    workload: WorkloadView, flavors: Mapping[str, Mapping[str, Any]]
) -> dict[str, Placement]:
    """PodSet name -> the node labels and tolerations of its admitted ResourceFlavors
    (``flavors``: ResourceFlavor name -> object, those the actuator found)."""
    result: dict[str, Placement] = {}
    for pod_set, names in workload.flavors.items():
        selector: dict[str, str] = {}
        tolerations: list[Mapping[str, Any]] = []
        for flavor in names:
            spec = (flavors.get(flavor) or {}).get("spec") or {}
            selector.update({str(k): str(v) for k, v in (spec.get("nodeLabels") or {}).items()})
            tolerations += [t for t in spec.get("tolerations") or [] if t not in tolerations]
        result[pod_set] = Placement(selector, tuple(tolerations))
    return result


def place(pod: dict[str, Any], placement: Placement | None) -> dict[str, Any]:
    """The pod with its admission's node labels and tolerations added (the run's own
    node selector keeps any key the flavor does not set)."""
    if placement is None or (not placement.node_selector and not placement.tolerations):
        return pod
    spec = pod["spec"]
    if placement.node_selector:
        spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **placement.node_selector}
    if placement.tolerations:
        existing = list(spec.get("tolerations") or [])
        spec["tolerations"] = existing + [t for t in placement.tolerations if t not in existing]
    return pod


@dataclass(frozen=True)
class Gate:
    """What Kueue's state means for one pass."""

    hold: bool
    """Keep (or get) the members stopped: not admitted, or evicted."""
    reason: str = ""
    message: str = ""
    actions: tuple[Action, ...] = ()
    """Create the Workload, or write its status as its job controller."""
    placements: Mapping[str, Placement] = field(default_factory=dict)


def _set(
    conditions: list[dict[str, Any]], kind: str, status: bool, reason: str, message: str, now: str
) -> None:
    value = "True" if status else "False"
    for condition in conditions:
        if condition.get("type") == kind:
            if condition.get("status") != value:
                condition["lastTransitionTime"] = now
            condition.update(status=value, reason=reason, message=message[:32_768])
            return
    conditions.append(
        {
            "type": kind,
            "status": value,
            "reason": reason,
            "message": message[:32_768],
            "lastTransitionTime": now,
        }
    )


def _status_action(workload: WorkloadView, status: dict[str, Any]) -> Action:
    """A merge patch of the Workload's status, conditional on the version observed (Kueue
    writes it too; a conflict leaves it to the next pass)."""
    body = {"metadata": {"resourceVersion": workload.resource_version}, "status": status}
    return Action(Verb.PATCH_STATUS, "Workload", workload.name, body)


def release(workload: WorkloadView, reason: str, message: str, now: dt.datetime) -> Action:
    """Give the quota back after an eviction once the members are gone: what Kueue's job
    reconciler does (``UnsetQuotaReservationWithCondition`` and ``SetRequeuedCondition``)."""
    stamp = format_time(now)
    conditions = [dict(c) for c in workload.conditions]
    _set(conditions, "QuotaReserved", False, "Pending", message, stamp)
    _set(conditions, "Admitted", False, "NoReservation", "The workload has no reservation", stamp)
    _set(conditions, "Requeued", reason in REQUEUED_AFTER, reason, message, stamp)
    if workload.condition("PodsReady") is not None:  # the next admission's pods are not
        _set(conditions, "PodsReady", False, "WaitForStart", "Not all pods are ready", stamp)
    return _status_action(workload, {"admission": None, "conditions": conditions})


def _mark(
    workload: WorkloadView, kind: str, status: bool, reason: str, message: str, now: str
) -> Action:
    conditions = [dict(c) for c in workload.conditions]
    _set(conditions, kind, status, reason, message, now)
    return _status_action(workload, {"conditions": conditions})


def gate(
    run: RolloutRun,
    workload: WorkloadView | None,
    flavors: Mapping[str, Mapping[str, Any]],
    pods_left: bool,
    members_ready: bool,
    finished: tuple[str, str] | None,
    now: dt.datetime,
) -> Gate | None:
    """Kueue's say in this pass; None when the run has no queue label.

    ``pods_left``: some member pod still exists; ``members_ready``: every member of the
    current incarnation runs; ``finished``: ``(reason, message)`` once the run succeeded or
    failed for good."""
    queue = queue_name(run)
    if queue is None:
        return None
    stamp = format_time(now)
    if finished is not None:
        if workload is None or workload.true("Finished"):
            return Gate(hold=False)
        return Gate(hold=False, actions=(_mark(workload, "Finished", True, *finished, stamp),))
    if workload is None:
        manifest = workload_manifest(run, queue)
        name = manifest["metadata"]["name"]
        create = Action(Verb.CREATE, "Workload", name, manifest)
        message = f"Workload {name} created in queue {queue}; waiting for admission"
        return Gate(hold=True, reason=QUEUED, message=message, actions=(create,))
    evicted = workload.condition("Evicted")
    if evicted is not None and evicted.get("status") == "True":
        why = str(evicted.get("reason") or "Evicted")
        text = str(evicted.get("message") or "")
        message = f"Kueue evicted Workload {workload.name} ({why}): {text}".rstrip(": ")
        actions: tuple[Action, ...] = ()
        if workload.reserved and not pods_left:
            actions = (release(workload, why, text, now),)
        return Gate(hold=True, reason=EVICTED, message=message, actions=actions)
    wanted = workload_manifest(run, queue)
    if pod_sets_shape(wanted["spec"]["podSets"]) != pod_sets_shape(workload.pod_sets):
        return follow_size(workload, wanted, pods_left)
    if not workload.admitted:
        pending = workload.condition("QuotaReserved")
        detail = str((pending or {}).get("message") or "")
        message = f"Workload {workload.name} waits for admission in queue {queue}"
        return Gate(hold=True, reason=QUEUED, message=f"{message}: {detail}" if detail else message)
    actions = ()
    if members_ready and not workload.true("PodsReady"):
        actions = (
            _mark(workload, "PodsReady", True, "PodsReady", "All pods reached readiness", stamp),
        )
    return Gate(hold=False, actions=actions, placements=placements(workload, flavors))


def follow_size(workload: WorkloadView, wanted: dict[str, Any], pods_left: bool) -> Gate:
    """The run's podSets changed: Kueue's rule for a Workload that no longer matches its job.

    Without a reservation the Workload takes the new podSets in place (``Updated not
    matching Workload``, conditional on the version observed); with one, its podSets are
    immutable: the members stop (trainer first, as on an eviction) and, once they are gone,
    the Workload is deleted (``Deleted not matching Workload``) and the next pass queues a
    new one."""
    name = workload.name
    if not workload.reserved:
        body = copy.deepcopy(wanted)
        body["metadata"]["resourceVersion"] = workload.resource_version
        message = f"Workload {name} updated to the run's podSets; waiting for admission"
        update = Action(Verb.REPLACE, "Workload", name, body)
        return Gate(hold=True, reason=QUEUED, message=message, actions=(update,))
    message = f"the run's podSets changed under admitted Workload {name}: " + (
        "stopping the members, then it is queued anew" if pods_left else "queued anew"
    )
    actions: tuple[Action, ...] = ()
    if not pods_left:
        actions = (Action(Verb.DELETE, "Workload", name, uid=workload.uid or None),)
    return Gate(hold=True, reason=RESIZED, message=message, actions=actions)
