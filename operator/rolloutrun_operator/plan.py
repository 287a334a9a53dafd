"""The vocabulary of a reconcile pass: actions, Events, member losses, the backoff, and the
:class:`Pass` that collects them.

Why separate from :mod:`rolloutrun_operator.reconcile`: the handlers apply these values and
the tests compare them, neither needs the decision logic; keeping them small frozen
dataclasses makes a table test's expected row readable. The decisions are split between
:mod:`reconcile` (the run's life) and :mod:`losses` (when a member counts as lost).
"""

from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass, field
from typing import Any

from rolloutrun_operator import builders
from rolloutrun_operator.api.v1alpha1 import RecoveryPolicy, RolloutRun, RolloutRunStatus
from rolloutrun_operator.conditions import ConditionType, Desired
from rolloutrun_operator.observe import Observed, PodView

#: A pod still present this long after its deletion deadline is force-deleted.
STUCK_TERMINATING_SECONDS = 30


class Verb(enum.StrEnum):
    """What to do with a child."""

    CREATE = "create"
    """Create it; an existing one of that name counts as done."""
    REPLACE = "replace"
    """Overwrite it with the manifest (only the ConfigMap is ever replaced)."""
    DELETE = "delete"
    """Delete it; a missing one counts as done."""
    PATCH_STATUS = "patch-status"
    """Merge-patch its status, if still at the manifest's resourceVersion (the Workload a
    run writes as its Kueue job controller: :mod:`rolloutrun_operator.kueue`)."""
    ANNOTATE = "annotate"
    """Merge-patch the manifest's ``metadata.annotations`` onto it (the trainer's Lease:
    the member endpoints, :mod:`rolloutrun_operator.members`)."""


@dataclass(frozen=True)
class Action:
    """One API call on one child of the run."""

    verb: Verb
    kind: str
    name: str
    manifest: dict[str, Any] | None = None
    grace_seconds: int | None = None
    """For pod deletes: None keeps the pod's own grace period, 0 forces."""
    uid: str | None = None
    """For deletes: the uid of the object observed, a precondition of the delete."""

    def __str__(self) -> str:
        grace = f" (grace {self.grace_seconds}s)" if self.grace_seconds is not None else ""
        return f"{self.verb} {self.kind}/{self.name}{grace}"


@dataclass(frozen=True)
class Event:
    """A Kubernetes Event on the run, emitted after the status write."""

    type: str
    """``Normal`` or ``Warning``."""
    reason: str
    message: str


class LossKind(enum.StrEnum):
    """What a lost member costs: a restart with backoff, a free restart, or the run."""

    FAILURE = "failure"
    """Counts against ``maxRestarts`` and grows the backoff."""
    PREEMPTION = "preemption"
    """The next incarnation starts as soon as the old pods are gone: no backoff, no count."""
    UNRECOVERABLE = "unrecoverable"
    """A restart cannot help (the trainer found nothing it can ever restore): ``Failed``."""


@dataclass(frozen=True)
class Loss:
    """Why the current incarnation ends."""

    reason: str
    pod: str
    kind: LossKind
    message: str


def backoff_seconds(policy: RecoveryPolicy, consecutive_failures: int) -> int:
    """``backoffSeconds * 2^(k-1)`` for the k-th failure in a row, capped at
    ``maxBackoffSeconds``. Only failures back off: a preempted incarnation did nothing wrong,
    and waiting after it only adds to the rollout time the preemption already cost."""
    if consecutive_failures <= 0 or policy.backoff_seconds == 0:
        return 0
    exponent = min(consecutive_failures - 1, 32)
    return min(policy.backoff_seconds * 2**exponent, policy.max_backoff_seconds)


def restart_delay(policy: RecoveryPolicy, kind: LossKind, consecutive_failures: int) -> int:
    """Seconds between the end of an incarnation lost to ``kind`` and the next one's start
    (``consecutive_failures`` already counts this loss when it is a failure)."""
    if kind is not LossKind.FAILURE:
        return 0
    return backoff_seconds(policy, consecutive_failures)


@dataclass
class Pass:
    """What one reconcile pass has decided so far (the pure functions append to it)."""

    run: RolloutRun
    observed: Observed
    now: dt.datetime
    status: RolloutRunStatus
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    desired: dict[ConditionType, Desired] = field(default_factory=dict)
    requeue: float | None = None
    lease_expiry: dt.datetime | None = None
    """When the trainer's Lease expires unless renewed (``losses.lease_loss``): kept apart
    from ``requeue`` so the daemon can move it with each renewal it sees."""
    forced: list[str] = field(default_factory=list)
    """Pods force-deleted in this pass because they outlived their grace period."""
    placements: dict[str, Any] = field(default_factory=dict)
    """PodSet name -> :class:`~rolloutrun_operator.kueue.Placement` of a Kueue admission."""

    @property
    def name(self) -> str:
        return builders.run_name(self.run)

    def look_again(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.requeue = seconds if self.requeue is None else min(self.requeue, seconds)

    def look_again_at(self, when: dt.datetime) -> None:
        self.look_again((when - self.now).total_seconds())

    def say(self, **conditions: Desired) -> None:
        for key, value in conditions.items():
            self.desired[ConditionType[key.upper()]] = value

    def create(self, manifest: builders.Manifest) -> None:
        meta = manifest["metadata"]
        self.actions.append(Action(Verb.CREATE, manifest["kind"], meta["name"], manifest))

    def delete_pods(self, pods: list[PodView], grace_seconds: int | None = None) -> bool:
        """Delete pods (force the stuck ones); True when some still exist. ``grace_seconds``:
        the grace period asked for (None: each pod's own); a pod on a lost node gets 0."""
        for pod in pods:
            node = self.observed.nodes.get(pod.node_name or "")
            node_lost = node is not None and not node.ready
            if pod.deletion_time is None:
                grace = 0 if node_lost else grace_seconds
                self.actions.append(
                    Action(Verb.DELETE, "Pod", pod.name, grace_seconds=grace, uid=pod.uid)
                )
            else:
                deadline = pod.deletion_time + dt.timedelta(seconds=STUCK_TERMINATING_SECONDS)
                if self.now >= deadline or node_lost:
                    force = Action(Verb.DELETE, "Pod", pod.name, grace_seconds=0, uid=pod.uid)
                    self.actions.append(force)
                    if not node_lost:
                        self.forced.append(pod.name)
                else:
                    self.look_again_at(deadline)
        if pods:
            self.look_again(5.0)
        return bool(pods)
