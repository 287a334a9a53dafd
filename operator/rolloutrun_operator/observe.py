"""What the operator sees of a run's children, as small frozen values built from API JSON.

Why a separate layer: the reconcile must be a pure function a table test can drive, so it
takes these values rather than API objects. Parsing pod status (exit codes, eviction reasons,
the ``DisruptionTarget`` condition), Lease times and node readiness happens here, once, and is
tested on literal JSON of the shape the API server returns.
"""

from __future__ import annotations

import datetime as dt
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rolloutrun_operator import naming
from rolloutrun_runtime.contract.pod import LABEL_WORKER_INDEX


def parse_time(value: Any) -> dt.datetime | None:
    """An RFC 3339 timestamp (``...Z`` or with microseconds) as an aware datetime."""
    if not value:
        return None
    if isinstance(value, dt.datetime):
        return value if value.tzinfo else value.replace(tzinfo=dt.UTC)
    text = str(value).replace("Z", "+00:00")
    try:
        parsed = dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=dt.UTC)


def format_time(value: dt.datetime) -> str:
    """RFC 3339 in UTC with a ``Z``, whole seconds (what Kubernetes writes)."""
    return value.astimezone(dt.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _int(value: Any) -> int | None:
    try:
        number = int(str(value))
    except (TypeError, ValueError):
        return None
    return number if number >= 0 else None


#: The bound of ``status.lastReward`` in the CRD: a number past it would make the API server
#: refuse every status write of the run, so it reads as no reward.
REWARD_BOUND = 1e15


def _float(value: Any) -> float | None:
    """A finite number within :data:`REWARD_BOUND`, or None (a missing or garbled
    annotation is no reward)."""
    try:
        number = float(str(value))
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) and abs(number) <= REWARD_BOUND else None


def controller_uid(obj: Mapping[str, Any]) -> str | None:
    """The uid of the object's controller (the owner reference with ``controller: true``)."""
    for reference in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if reference.get("controller"):
            return str(reference.get("uid") or "") or None
    return None


def owned_by(obj: Mapping[str, Any], uid: str) -> bool:
    """Whether the run with ``uid`` controls the object: the only objects a run adopts,
    watches or deletes. Names and labels anyone may write; an owner uid only the API
    server's own run object has."""
    return bool(uid) and controller_uid(obj) == uid


def owner_text(obj: Mapping[str, Any]) -> str:
    """Who controls the object, for a message: ``RolloutRun/other (uid ...)`` or ``no owner``."""
    for reference in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if reference.get("controller"):
            kind, name = reference.get("kind", "?"), reference.get("name", "?")
            return f"{kind}/{name} (uid {reference.get('uid', '?')})"
    return "no owner"


#: Waiting reasons of a container that is merely starting: not a problem to report.
STARTING_REASONS = frozenset({"", "ContainerCreating", "PodInitializing"})


@dataclass(frozen=True)
class ContainerWaiting:
    """A container the kubelet holds back, as ``state.waiting`` says."""

    container: str
    reason: str
    message: str = ""


def _waiting(status: Mapping[str, Any]) -> ContainerWaiting | None:
    """The first container (init containers first) waiting for a reason worth reporting."""
    for key in ("initContainerStatuses", "containerStatuses"):
        for container in status.get(key) or []:
            waiting = (container.get("state") or {}).get("waiting") or {}
            reason = str(waiting.get("reason") or "")
            if waiting and reason not in STARTING_REASONS:
                name, message = str(container.get("name", "")), str(waiting.get("message") or "")
                return ContainerWaiting(name, reason, message)
    return None


def _unschedulable(conditions: Iterable[Mapping[str, Any]]) -> str | None:
    for condition in conditions:
        if condition.get("type") == "PodScheduled" and condition.get("status") == "False":
            return str(condition.get("message") or condition.get("reason") or "Unschedulable")
    return None


@dataclass(frozen=True)
class PodView:
    """One member pod, reduced to what recovery decisions need."""

    name: str
    role: str
    incarnation: int | None
    gym_index: int | None = None
    worker_index: int | None = None
    phase: str = "Pending"
    pod_ip: str | None = None
    node_name: str | None = None
    deletion_time: dt.datetime | None = None
    disruption: str | None = None
    """Reason of a ``DisruptionTarget=True`` condition (preemption, eviction, taint, ...)."""
    status_reason: str | None = None
    """``status.reason``, e.g. ``Evicted`` or ``NodeLost``."""
    exit_code: int | None = None
    terminated_reason: str | None = None
    terminated_message: str | None = None
    """The container's termination message (``terminationMessagePath``, or the tail of its
    log with ``FallbackToLogsOnError``), if it wrote one."""
    ready: bool = False
    waiting: ContainerWaiting | None = None
    """The first container the kubelet holds in ``Waiting`` with a reason other than
    ``ContainerCreating``/``PodInitializing`` (``ImagePullBackOff``, ``CrashLoopBackOff``...)."""
    unschedulable: str | None = None
    """The scheduler's message of a ``PodScheduled=False`` condition (reason Unschedulable)."""
    started: dt.datetime | None = None
    """When its container started running (``state.running.startedAt``)."""
    uid: str | None = None
    """The pod's uid: its deletion is conditional on it (a same-named pod that replaced it
    in the meantime is not the run's to delete)."""
    service_account: str | None = None
    """The ServiceAccount it runs as: a live trainer's stays bound to the Lease Role."""
    generation: int = 0
    """Its member generation (``LABEL_MEMBER_GENERATION``): 0 unless it replaced a lost one."""

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")


def pod_view(pod: Mapping[str, Any]) -> PodView:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    status = pod.get("status") or {}
    disruption = None
    ready = False
    for condition in status.get("conditions") or []:
        if condition.get("type") == "DisruptionTarget" and condition.get("status") == "True":
            disruption = condition.get("reason") or "DisruptionTarget"
        if condition.get("type") == "Ready" and condition.get("status") == "True":
            ready = True
    exit_code = terminated_reason = terminated_message = None
    started = None
    for container in status.get("containerStatuses") or []:
        running = (container.get("state") or {}).get("running")
        if running:
            started = parse_time(running.get("startedAt"))
        terminated = (container.get("state") or {}).get("terminated")
        if terminated:
            exit_code = _int(terminated.get("exitCode"))
            terminated_reason = terminated.get("reason")
            terminated_message = terminated.get("message") or None
            if exit_code:
                break
    return PodView(
        name=str(meta.get("name", "")),
        role=str(labels.get(naming.LABEL_ROLE, "")),
        incarnation=_int(labels.get(naming.LABEL_INCARNATION)),
        gym_index=_int(labels.get(naming.LABEL_GYM_INDEX)),
        worker_index=_int(labels.get(LABEL_WORKER_INDEX)),
        phase=str(status.get("phase") or "Pending"),
        pod_ip=status.get("podIP") or None,
        node_name=(pod.get("spec") or {}).get("nodeName") or None,
        deletion_time=parse_time(meta.get("deletionTimestamp")),
        disruption=disruption,
        status_reason=status.get("reason") or None,
        exit_code=exit_code,
        terminated_reason=terminated_reason,
        terminated_message=terminated_message,
        waiting=_waiting(status),
        unschedulable=_unschedulable(status.get("conditions") or []),
        ready=ready,
        started=started,
        uid=meta.get("uid") or None,
        service_account=(pod.get("spec") or {}).get("serviceAccountName") or None,
        generation=_int(labels.get(naming.LABEL_MEMBER_GENERATION)) or 0,
    )


@dataclass(frozen=True)
class LeaseView:
    """The trainer Lease: who holds it, when it was renewed, and what the trainer reported."""

    holder: str | None = None
    renew_time: str | None = None
    """``renewTime`` (else ``acquireTime``) as the trainer wrote it, on the trainer's clock:
    compared for change only (see ``losses.lease_loss``), never with the operator's clock."""
    duration_seconds: int | None = None
    train_step: int | None = None
    anchor_step: int | None = None
    latest_manifest: str | None = None
    latest_manifest_time: str | None = None
    reward: float | None = None
    """The mean reward of the trainer's last step (``ANNOTATION_REWARD``)."""
    endpoints: Mapping[str, str] = field(default_factory=dict)
    """Role -> the member endpoints annotation the operator last wrote (raw text)."""

    @property
    def holder_incarnation(self) -> int | None:
        return naming.holder_incarnation(self.holder)


def lease_view(lease: Mapping[str, Any]) -> LeaseView:
    spec = lease.get("spec") or {}
    notes = (lease.get("metadata") or {}).get("annotations") or {}
    return LeaseView(
        holder=spec.get("holderIdentity") or None,
        renew_time=str(spec.get("renewTime") or spec.get("acquireTime") or "") or None,
        duration_seconds=_int(spec.get("leaseDurationSeconds")),
        train_step=_int(notes.get(naming.ANNOTATION_TRAIN_STEP)),
        reward=_float(notes.get(naming.ANNOTATION_REWARD)),
        anchor_step=_int(notes.get(naming.ANNOTATION_ANCHOR_STEP)),
        latest_manifest=notes.get(naming.ANNOTATION_LATEST_MANIFEST) or None,
        # the trainer's text goes into status.latestManifestTime (format: date-time): an
        # unparsable one would make the API server refuse every status write of the run
        latest_manifest_time=_rfc3339(notes.get(naming.ANNOTATION_LATEST_MANIFEST_TIME)),
        endpoints={
            key.removeprefix(naming.ANNOTATION_MEMBER_ENDPOINTS_PREFIX): str(value)
            for key, value in notes.items()
            if key.startswith(naming.ANNOTATION_MEMBER_ENDPOINTS_PREFIX)
        },
    )


def _rfc3339(value: Any) -> str | None:
    parsed = parse_time(value)
    return format_time(parsed) if parsed is not None else None


@dataclass(frozen=True)
class NodeView:
    """A node a member pod runs on: Ready or not, and since when."""

    name: str
    ready: bool
    since: dt.datetime | None = None


def node_view(node: Mapping[str, Any]) -> NodeView:
    for condition in (node.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "Ready":
            return NodeView(
                name=str((node.get("metadata") or {}).get("name", "")),
                ready=condition.get("status") == "True",
                since=parse_time(condition.get("lastTransitionTime")),
            )
    return NodeView(name=str((node.get("metadata") or {}).get("name", "")), ready=True)


@dataclass(frozen=True)
class Observed:
    """Everything one reconcile pass knows about a run's children."""

    pods: tuple[PodView, ...] = ()
    lease: LeaseView | None = None
    config: dict[str, str] | None = None
    """The ConfigMap's data, or None when it does not exist."""
    config_incarnation: int | None = None
    present: frozenset[str] = frozenset()
    """``Kind/name`` of the static children that exist (Secret, Services, Lease, RBAC)."""
    secrets: frozenset[str] = frozenset()
    """User Secrets (named in the spec) that exist."""
    nodes: Mapping[str, NodeView] = field(default_factory=dict)
    new_token: str = ""
    """A fresh random token, used only if the Gym token Secret must be created."""
    new_metrics_token: str = ""
    """Another one, used only if the metrics token Secret must be created."""
    foreign: Mapping[str, str] = field(default_factory=dict)
    """``Kind/name`` -> owner (:func:`owner_text`) of objects with a child's name or the
    run's label that this run does not own: never adopted, deleted or counted as members."""
    account: Mapping[str, str] | None = None
    """Annotations of the ServiceAccount ``spec.serviceAccountName`` names; None when the
    spec names none or it does not exist."""
    binding_accounts: tuple[str, ...] | None = None
    """The ServiceAccounts the member RoleBinding binds (sorted); None when it is absent."""
    workload: Mapping[str, Any] | None = None
    """The run's Kueue Workload (runs labelled ``kueue.x-k8s.io/queue-name``), if any."""
    flavors: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """The ResourceFlavors its admission names, by name (:mod:`rolloutrun_operator.kueue`)."""

    def members(self, incarnation: int) -> list[PodView]:
        return [pod for pod in self.pods if pod.incarnation == incarnation]


def observed_from(
    pods: Iterable[Mapping[str, Any]],
    lease: Mapping[str, Any] | None,
    config_map: Mapping[str, Any] | None,
    children: Mapping[str, Mapping[str, Any] | None],
    secrets: Iterable[str],
    nodes: Iterable[Mapping[str, Any]],
    new_token: str,
    uid: str,
    account: Mapping[str, Any] | None = None,
    new_metrics_token: str = "",
) -> Observed:
    """Build an :class:`Observed` from the JSON the API server returned.

    ``children`` maps ``Kind/name`` of each static child to the object found (or None);
    ``uid`` is the run's: pods, Lease, ConfigMap and children it does not control are set
    apart in :attr:`Observed.foreign` and otherwise ignored. ``account`` is the
    ServiceAccount the spec names, if found."""
    foreign: dict[str, str] = {}
    objects = {**children, **{f"Pod/{_name(pod)}": pod for pod in pods}}
    if lease is not None:
        objects[f"Lease/{_name(lease)}"] = lease
    if config_map is not None:
        objects[f"ConfigMap/{_name(config_map)}"] = config_map
    for ref, obj in objects.items():
        if obj is not None and not owned_by(obj, uid):
            foreign[ref] = owner_text(obj)
    pods = [pod for pod in pods if owned_by(pod, uid)]
    lease = lease if lease is not None and owned_by(lease, uid) else None
    config_map = config_map if config_map is not None and owned_by(config_map, uid) else None
    present = [ref for ref, obj in children.items() if obj is not None and ref not in foreign]
    config = None
    config_incarnation = None
    if config_map is not None:
        config = dict(config_map.get("data") or {})
        notes = (config_map.get("metadata") or {}).get("annotations") or {}
        config_incarnation = _int(notes.get(naming.ANNOTATION_CONFIG_INCARNATION))
    node_views = {view.name: view for view in (node_view(node) for node in nodes)}
    return Observed(
        pods=tuple(sorted((pod_view(pod) for pod in pods), key=lambda p: p.name)),
        lease=lease_view(lease) if lease is not None else None,
        config=config,
        config_incarnation=config_incarnation,
        present=frozenset(present),
        secrets=frozenset(secrets),
        nodes=node_views,
        new_token=new_token,
        new_metrics_token=new_metrics_token,
        foreign=foreign,
        account=dict((account.get("metadata") or {}).get("annotations") or {})
        if account is not None
        else None,
        binding_accounts=_binding_accounts({ref: children[ref] for ref in present}),
    )


def _binding_accounts(children: Mapping[str, Mapping[str, Any] | None]) -> tuple[str, ...] | None:
    """The ServiceAccount subjects of the run's own member RoleBinding, if it has one."""
    binding = next(
        (obj for ref, obj in children.items() if ref.startswith("RoleBinding/") and obj), None
    )
    if binding is None:
        return None
    subjects = binding.get("subjects") or []
    return tuple(sorted(str(s.get("name")) for s in subjects if s.get("kind") == "ServiceAccount"))


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name", ""))
